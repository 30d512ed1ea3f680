"""The pages and the dashboard's data, over HTTP on the tiny model: what GET /stats says is checked against what the
requests did and against /metrics; the pages come with their security policy, open without a key, and go with --no-ui.
The pages in a real browser: tests/e2e/test_browser.py."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
from helpers import ServerThread, openai_client, read_metrics

from tokenmill.api.ui import PAGES
from tokenmill.config import ServerConfig
from tokenmill.loader import LoadedModel

PROMPT = [(5 * i + 3) % 250 for i in range(40)]  # 2 full blocks of 16 and a partial one


def stats_when(srv: ServerThread, ready: Callable[[dict], bool], seconds: float = 10,
               headers: dict[str, str] | None = None) -> dict:
    deadline = time.time() + seconds
    while not ready(stats := httpx.get(srv.root_url + "/stats", headers=headers).json()) and time.time() < deadline:
        time.sleep(0.02)
    return stats


def test_stats_follow_a_streaming_request_and_agree_with_metrics(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", max_num_seqs=4) as srv:
        idle = stats_when(srv, lambda s: True)
        assert (idle["running"], idle["waiting"], idle["sequences"], idle["max_num_seqs"]) == (0, 0, [], 4)
        assert idle["model"] == "tiny" and idle["kv"]["blocks_used"] == 0 and idle["latency"]["ttft_s"]["count"] == 0
        stream = openai_client(srv, timeout=60).completions.create(model="tiny", prompt=PROMPT, max_tokens=4000,
                                                                   stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        during = stats_when(srv, lambda s: s["running"] == 1 and s["sequences"][0]["generated_tokens"] > 20)
        (seq,) = during["sequences"]
        assert seq["state"] == "running" and seq["prompt_tokens"] == 40 and seq["age_s"] > 0
        assert seq["computed_tokens"] >= 40 + seq["generated_tokens"] - 2  # a step or so behind what it has sampled
        # a glance while the loop runs: the blocks of what is computed, and at most one block more being filled
        assert -(-seq["computed_tokens"] // 16) <= seq["blocks"] <= -(-seq["computed_tokens"] // 16) + 1
        assert during["kv"]["blocks_used"] in (seq["blocks"], seq["blocks"] + 1)
        assert during["kv"]["blocks_cached"] == 0  # what the prefix cache shares with a live sequence counts as used
        later = stats_when(srv, lambda s: s["sequences"] and s["sequences"][0]["generated_tokens"]
                           > seq["generated_tokens"])
        assert later["sequences"][0]["generated_tokens"] > seq["generated_tokens"]  # the table moves
        stream.close()
        after = stats_when(srv, lambda s: s["running"] == 0 and s["totals"]["prompt_tokens"] == 40)
        metrics = read_metrics(srv.root_url)
        generated = after["totals"]["generation_tokens"]
        assert (after["running"], after["sequences"], after["kv"]["blocks_used"]) == (0, [], 0)
        assert after["kv"]["blocks_cached"] >= 2  # the prompt's full blocks stay in the prefix cache
        assert generated == metrics["tokenmill:generation_tokens_total"] > 20
        # every token of this server's life lies in the last five minutes' seconds (the current one aside)
        time.sleep(1.05)
        settled = stats_when(srv, lambda s: True)
        assert sum(settled["throughput"]["generation_tokens"]) == generated
        assert sum(settled["throughput"]["prompt_tokens"]) == 40 and len(settled["throughput"]["prompt_tokens"]) == 300
        ttft, itl = settled["latency"]["ttft_s"], settled["latency"]["itl_s"]
        assert ttft["count"] == 1 and itl["count"] == generated - 1
        assert 0 < itl["p50"] <= itl["p90"] <= itl["p99"] and ttft["p50"] > 0
        assert settled["speculative"] is None


def test_stats_count_speculative_proposals(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", speculative="ngram", num_speculative_tokens=3) as srv:
        openai_client(srv).completions.create(model="tiny", prompt=[7, 8, 9] * 20, max_tokens=60, temperature=0,
                                              extra_body={"ignore_eos": True})
        spec = stats_when(srv, lambda s: True)["speculative"]
        metrics = read_metrics(srv.root_url)
        assert spec["draft_tokens"] == metrics["tokenmill:spec_decode_num_draft_tokens_total"] > 0
        assert spec["accepted_tokens"] == metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
        assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
        assert spec["mean_accepted_length"] == spec["accepted_tokens"] / spec["drafts"]


def test_pages_carry_a_script_policy_and_open_without_the_key(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", ServerConfig(api_key=("sesame",))) as srv:
        for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/ui/chat.js", "text/javascript"),
                           ("/ui/markdown.js", "text/javascript"), ("/ui/ui.css", "text/css")):
            page = httpx.get(srv.root_url + path)
            assert page.status_code == 200 and page.headers["content-type"].startswith(kind), path
            assert "script-src 'self'" in page.headers["content-security-policy"]
        for path in PAGES:  # what a page links to is served, its icon too (browsers asked for /favicon.ico)
            linked = re.findall(r'(?:href|src)="(/[^"]*)"', httpx.get(srv.root_url + path).text)
            assert "/ui/icon.svg" in linked
            for link in linked:
                assert httpx.get(srv.root_url + link).status_code == 200, (path, link)
        assert httpx.get(srv.root_url + "/stats").status_code == 401  # the data needs the key
        key = {"Authorization": "Bearer sesame"}
        keyed = httpx.get(srv.root_url + "/stats", headers=key)
        assert keyed.status_code == 200 and keyed.json()["object"] == "tokenmill.stats"
        assert httpx.get(srv.root_url + "/ui/other.js", headers=key).status_code == 404  # the package's files only


def test_no_ui_serves_no_pages(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", ServerConfig(ui=False)) as srv:
        for path in ("/", "/dashboard", "/ui/chat.js"):
            assert httpx.get(srv.root_url + path).status_code == 404, path
        assert httpx.get(srv.root_url + "/stats").status_code == 200  # the data stays, like /metrics
