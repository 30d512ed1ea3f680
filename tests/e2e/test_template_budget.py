"""A model whose own chat template renders slowly, behind a live server: the render runs off the event loop (the
server keeps answering meanwhile) and stops at the server's --chat-template-timeout (400 on `messages`)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import pytest
from helpers import ServerThread

from tokenmill.config import ServerConfig
from tokenmill.loader import LoadedModel
from tokenmill.loader.chat_template import ChatTemplate

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Ten billion turns of a loop that writes nothing: it ends only at the render's deadline.
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def slow_model(tiny4k: LoadedModel) -> LoadedModel:
    """The tiny model, shipping a chat template that never finishes rendering."""
    return replace(tiny4k, chat_template=ChatTemplate(ENDLESS, None, None))


def test_the_server_answers_other_requests_while_a_template_renders(slow_model: LoadedModel) -> None:
    """The render runs in a worker thread: on the event loop it would hold every other request for its whole
    budget (the default 2 s here)."""
    with ServerThread(slow_model, "tiny") as srv:
        answers: list[httpx.Response] = []
        chat = threading.Thread(target=lambda: answers.append(httpx.post(srv.root_url + CHAT, json=BODY,
                                                                         timeout=30)))
        chat.start()
        time.sleep(0.3)  # rendering now
        for path in ("/health", "/v1/models"):
            started = time.monotonic()
            assert httpx.get(srv.root_url + path, timeout=30).status_code == 200
            assert time.monotonic() - started < 0.8, path
        assert chat.is_alive()  # still rendering
        chat.join(30)
        assert answers[0].status_code == 400 and "ran out of time" in answers[0].json()["error"]["message"]


def test_the_chat_template_timeout_alone_bounds_the_render(slow_model: LoadedModel) -> None:
    """--chat-template-timeout, set with no other option, reaches the render: the endless template is stopped
    after 0.2 s, not the default 2 s."""
    with ServerThread(slow_model, "tiny", ServerConfig(chat_template_timeout=0.2)) as srv:
        started = time.monotonic()
        response = httpx.post(srv.root_url + CHAT, json=BODY, timeout=30)
        elapsed = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "ran out of time" in error["message"]
    assert 0.2 <= elapsed < 1.5
