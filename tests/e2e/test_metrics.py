"""/metrics and usage while work runs, on the tiny model: each value is checked against what the requests did."""

from __future__ import annotations

import time
from collections.abc import Callable

from helpers import ServerThread, counted, openai_client, read_metrics

from tokenmill.loader import LoadedModel

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16 dims, fp32
PROMPT = [(5 * i + 3) % 250 for i in range(40)]  # 2 full blocks of 16 and a partial one


def metrics_when(srv: ServerThread, ready: Callable[[dict[str, float]], bool], seconds: float = 10) -> dict:
    """The metrics once ready(metrics) holds (the engine exports after its step), or as they are at the deadline."""
    deadline = time.time() + seconds
    while not ready(values := read_metrics(srv.root_url)) and time.time() < deadline:
        time.sleep(0.02)
    return values


def test_kv_usage_and_running_requests_while_a_request_runs(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny", kv_cache_memory=str(256 * 16 * KV_BYTES_PER_TOKEN)) as srv:  # 256 blocks
        stream = openai_client(srv, timeout=60).completions.create(model="tiny", prompt=PROMPT, max_tokens=4000,
                                                                   stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        during = metrics_when(srv, lambda m: m["tokenmill:num_requests_running"] == 1)
        blocks = len(srv.engine.kv_cache.tables[next(iter(srv.engine.kv_cache.tables))])
        assert during["tokenmill:num_requests_running"] == 1 and during["tokenmill:num_requests_waiting"] == 0
        assert 3 / 256 <= during["tokenmill:kv_cache_usage_perc"] <= blocks / 256  # 40 tokens and growing
        stream.close()
        after = metrics_when(srv, lambda m: m["tokenmill:num_requests_running"] == 0)
        assert after["tokenmill:kv_cache_usage_perc"] == 0


def test_token_counters_prefix_hits_and_cached_tokens_agree(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, "tiny") as srv:
        sdk = openai_client(srv, timeout=60)
        before = read_metrics(srv.root_url)
        expected = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        for prompt, cached in ((PROMPT, 0), (PROMPT, 32), (PROMPT[:20] + [7] * 5, 16)):
            reply = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
            assert reply.usage.prompt_tokens_details.cached_tokens == cached
            expected["prompt_tokens"] += len(prompt)
            expected["generation_tokens"] += reply.usage.completion_tokens
            expected["prefix_cache_queries"] += len(prompt)
            expected["prefix_cache_hits"] += cached

        def deltas(m: dict[str, float]) -> dict[str, float]:
            return {k: m[f"tokenmill:{k}_total"] - before[f"tokenmill:{k}_total"] for k in expected}

        assert deltas(metrics_when(srv, lambda m: deltas(m) == expected)) == expected


def test_preemptions_are_counted(tiny4k: LoadedModel) -> None:
    # 8 blocks of 16 tokens; four requests of up to 100 tokens (7 blocks) each must take turns
    with ServerThread(tiny4k, "tiny", kv_cache_memory=str(8 * 16 * KV_BYTES_PER_TOKEN), max_num_seqs=4) as srv:
        reply = openai_client(srv, timeout=60).completions.create(
            model="tiny", prompt=[PROMPT, PROMPT[1:], PROMPT[2:], PROMPT[3:]], max_tokens=60, temperature=0,
            extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4 * 60
        preemptions = counted(srv.engine.metrics.preemptions)
        assert preemptions > 0
        done = metrics_when(srv, lambda m: m["tokenmill:num_preemptions_total"] == preemptions)
        assert done["tokenmill:num_preemptions_total"] == preemptions
