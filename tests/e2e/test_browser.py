"""The chat page and the dashboard in headless Chromium (Debian's, driven by Playwright) against the live server on
the real model: a reply streams in pieces, Stop aborts it on the server, model text never becomes HTML, the
dashboard moves under load and settles after, and the key dialog. Screenshots of both pages (1280x800) go to
artifacts/screenshots/ ($TOKENMILL_ARTIFACTS overrides the folder); the docs show them.

Skipped where no Chromium is installed (scripts/dev.sh test installs Debian's where it can).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from helpers import ServerThread, openai_client, write_tiny_gguf

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.hosting.pool import ModelPool
from tokenmill.hosting.specs import ModelSpec
from tokenmill.loader import LoadedModel

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium to drive (apt-get install chromium)")
ARTIFACTS = Path(os.environ.get("TOKENMILL_ARTIFACTS", Path(__file__).parents[2] / "artifacts")) / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}
XSS = "<script>window.pwned = 1</script><img src=x onerror=window.pwned=2>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport=VIEWPORT)
    yield context.new_page()
    context.close()


@pytest.fixture
def errors(page: Page) -> list[str]:
    """What went wrong in the page: uncaught script errors, and any alert a script opened."""
    seen: list[str] = []
    page.on("pageerror", lambda error: seen.append(str(error)))
    page.on("dialog", lambda dialog: seen.append(f"dialog: {dialog.message}"))
    return seen


def stats(srv: ServerThread) -> dict:
    return httpx.get(srv.root_url + "/stats").json()


def wait_for(condition: Callable[[], object], seconds: float = 30, every: float = 0.05) -> object:
    deadline = time.time() + seconds
    while not (value := condition()):
        if time.time() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(every)
    return value


def ask(page: Page, srv: ServerThread, question: str, max_tokens: int = 1500) -> None:
    page.goto(srv.root_url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def messages_sent(page: Page, question: str) -> list[dict]:
    """Ask a short question on the open page; the conversation its request carried."""
    page.fill("#max-tokens", "5")
    page.fill("#prompt", question)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    return json.loads(sent.value.post_data)["messages"]


def reply_text(page: Page) -> str:
    return page.inner_text(".msg.assistant .content")


def test_a_reply_streams_in_pieces_and_shows_its_speed(page: Page, errors: list[str], server: ServerThread) -> None:
    question = "Explain in a few sentences what a hash table is, with a short Python example."
    ask(page, server, question, 200)
    lengths = []
    while not page.query_selector(".msg.assistant .meta"):
        lengths.append(len(reply_text(page)))
        time.sleep(0.03)
    seen = sorted(set(lengths) - {0})
    assert len(seen) >= 3, f"the reply arrived in {len(seen)} piece(s): {seen}"  # streamed, not all at once
    assert len(reply_text(page)) > seen[0]
    meta = page.inner_text(".msg.assistant .meta")
    assert "tokens" in meta and "tok/s" in meta and "first token" in meta, meta
    assert page.inner_text(".msg.user .text") == question
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"))
    assert errors == []


def test_stop_aborts_the_request_on_the_server(page: Page, errors: list[str], server: ServerThread) -> None:
    ask(page, server, "Write a long story about a dragon who learns to cook. Make it at least ten paragraphs.")
    wait_for(lambda: len(reply_text(page)) > 20)
    assert stats(server)["running"] == 1  # still answering when Stop is pressed
    page.click("#stop")
    after = wait_for(lambda: (s := stats(server))["running"] == 0 and s, seconds=10)
    assert after["kv"]["blocks_used"] == 0  # its KV blocks are back in the pool
    assert "stopped" in page.inner_text(".msg.assistant .meta")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    generated = len(reply_text(page))
    time.sleep(0.5)
    assert len(reply_text(page)) == generated  # nothing more arrives
    assert errors == []


def test_an_error_shows_and_its_question_is_not_sent_again(page: Page, errors: list[str],
                                                            server: ServerThread) -> None:
    ask(page, server, "What is two plus two?", max_tokens=10**6)  # beyond the context: the server says 400
    page.wait_for_selector(".msg.assistant .error")
    assert "maximum context length" in page.inner_text(".msg.assistant .error")
    assert messages_sent(page, "Hello") == [{"role": "user", "content": "Hello"}]
    page.wait_for_selector(".msg.assistant:nth-of-type(4) .meta")
    assert errors == []


def test_new_chat_mid_answer_starts_clean(page: Page, errors: list[str], server: ServerThread) -> None:
    ask(page, server, "Write a long story about a dragon who learns to cook.")
    wait_for(lambda: len(reply_text(page)) > 20)
    page.click("#new-chat")  # aborts the answer streaming now, which must not land in the new conversation
    wait_for(lambda: stats(server)["running"] == 0, seconds=10)
    assert messages_sent(page, "Hello") == [{"role": "user", "content": "Hello"}]
    page.wait_for_selector(".msg.assistant .meta")
    assert errors == []


def test_model_text_is_never_html(page: Page, errors: list[str], server: ServerThread) -> None:
    """A reply holding <script> and <img onerror> (forced by a JSON schema) shows as text; the Markdown renderer,
    fed such text directly, builds no element from it."""
    page.goto(server.root_url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.select_option("#format", "json_schema")
    page.fill("#schema", json.dumps({"enum": [XSS]}))
    page.fill("#prompt", "Say something.")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .meta")
    content = page.query_selector(".msg.assistant .content")
    assert json.loads(content.inner_text()) == XSS  # shown as the JSON string it is
    assert content.query_selector("script, img") is None
    rendered = page.evaluate("""async (text) => {
        const { renderMarkdown } = await import('/ui/markdown.js');
        const box = document.createElement('div');
        box.append(renderMarkdown(text));
        return { tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                 code: box.querySelector('pre code')?.textContent,
                 hrefs: [...box.querySelectorAll('a')].map(a => a.href), text: box.textContent };
    }""", f"# Title\n**bold**, `x < y` and [ok](https://example.com) {XSS}\n```html\n{XSS}\n```\n- "
          "[bad](javascript:alert(1))")
    assert set(rendered["tags"]) == {"h2", "p", "strong", "code", "pre", "ul", "li", "a"}
    assert rendered["code"] == XSS and rendered["hrefs"] == ["https://example.com/"]
    assert XSS in rendered["text"] and "[bad](javascript:alert(1))" in rendered["text"]
    assert page.evaluate("window.pwned") is None and errors == []


def test_the_dashboard_moves_under_load_and_settles(page: Page, errors: list[str], server: ServerThread) -> None:
    page.goto(server.root_url + "/dashboard")
    wait_for(lambda: page.inner_text("#running") == "0")
    sdk = openai_client(server)

    def one_stream(i: int) -> None:
        sdk.chat.completions.create(model="smollm2-135m", max_tokens=160, extra_body={"ignore_eos": True},
                                    messages=[{"role": "user", "content": f"Count to {i + 20}."}])

    load = [threading.Thread(target=one_stream, args=(i,)) for i in range(8)]
    for thread in load:
        thread.start()
    wait_for(lambda: int(page.inner_text("#running")) >= 4 and float(page.inner_text("#generation-rate")) > 0
             and len(page.query_selector_all("#sequences tr")) >= 4)
    rows = page.query_selector_all("#sequences tr")
    assert page.inner_text("#status").startswith("live")
    wait_for(lambda: max(page.eval_on_selector_all(  # for the picture: well under way (or done)
        "#sequences td:nth-child(5)", "cells => cells.map(c => Number(c.textContent))") or [160]) >= 60)
    assert all(row.query_selector("td:nth-child(2)").inner_text() in ("running", "waiting") for row in rows)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"))
    for thread in load:
        thread.join()
    wait_for(lambda: page.inner_text("#running") == "0" and not page.query_selector_all("#sequences tr"))
    assert page.inner_text("#kv").startswith("0.0")
    assert page.query_selector("#generation-chart polyline") is not None
    assert int(page.inner_text("#generation-sub").split()[0]) >= 8 * 160
    assert errors == []


def test_pages_ask_for_the_api_key(browser: Browser, smollm_served: LoadedModel) -> None:
    with ServerThread(smollm_served, "smollm2-135m", ServerConfig(api_key=("sesame",))) as srv:
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        page.goto(srv.root_url + "/dashboard")
        page.wait_for_selector("#key-dialog[open]")
        assert page.inner_text("#status") == "needs an API key"
        page.fill("#key-dialog input", "sesame")
        page.click("#key-dialog button")
        wait_for(lambda: page.inner_text("#status").startswith("live"))
        page.goto(srv.root_url + "/")  # the key is kept for the chat page too
        page.wait_for_selector("#model option", state="attached")
        assert page.input_value("#model") == "smollm2-135m"
        context.close()


def test_the_dashboard_lists_the_models_and_shows_the_one_clicked(page: Page, errors: list[str],
                                                                  tmp_path: Path) -> None:
    specs = [ModelSpec(name, EngineConfig(model=str(write_tiny_gguf(tmp_path / f"{name}.gguf", seed=seed)),
                                          dtype="float32", threads=1, kv_cache_memory="4MiB"))
             for seed, name in enumerate(("first", "second"))]
    one = 6 * 2**20  # room for one of them: the second loads when asked for, in place of the first
    with ServerThread(ModelPool(specs, max_memory=one)) as srv:
        page.goto(srv.root_url + "/dashboard")
        wait_for(lambda: len(page.query_selector_all("#models tr")) == 2)
        states = lambda: [row.inner_text().split("\t")[:2] for row in page.query_selector_all("#models tr")]  # noqa: E731
        assert states() == [["first", "loaded"], ["second", "unloaded"]]
        assert page.inner_text("#model").startswith("first · context")
        page.click("#models tr:nth-child(2)")
        wait_for(lambda: page.inner_text("#model").startswith("second (not loaded)"))
        openai_client(srv).completions.create(model="second", prompt="hi", max_tokens=2)
        wait_for(lambda: states() == [["first", "unloaded"], ["second", "loaded"]])
        wait_for(lambda: page.inner_text("#model").startswith("second · context"))
    assert errors == []
