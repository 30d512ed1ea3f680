"""`tokenmill bench` against a live tokenmill on a tiny random-weight model, against servers that fail, and its
workloads as pure functions."""

from __future__ import annotations

import asyncio
import random
import socket
import sys
from pathlib import Path

import httpx
import pytest
import torch
from helpers import ServerThread, start_engine

from tokenmill import cli, kernels
from tokenmill.bench import agree, client, report
from tokenmill.bench.attention import AttentionShape, step_time
from tokenmill.bench.decode import _profile, random_prompts
from tokenmill.bench.workloads import WORDS_PER_TOKEN, WorkloadParams, build, synthetic_text
from tokenmill.config import ServerConfig, WeightPlan
from tokenmill.loader import load_model

SMALL = ["--num-requests", "6", "--prompt-len", "16", "--output-len", "8", "--ignore-eos"]


@pytest.fixture(scope="module")
def server(tiny_gguf: Path):
    with ServerThread(load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu")), "tiny") as srv:
        yield srv


def bench(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *argv])
    return exit_.value.code


def run(url: str, endpoint: str = "chat", model: str | None = None, **params) -> dict:
    cfg = client.ClientConfig(url=url, model=model, endpoint=endpoint, ignore_eos=True, warmup=0)
    return asyncio.run(client.run(cfg, WorkloadParams(**params), progress=False))


def test_the_engine_benchs_probes_never_share_a_prompts_first_block() -> None:
    """--prefill's prompts and --long's (warm-ups included) must not begin alike: the prefix cache would serve one
    from the other, and the long prompt's first token would be timed on a partly cached prompt."""
    firsts = [tuple(p[:16]) for seed in range(4) for probe, count in (("prefill", 8), ("long", 1))
              for p in random_prompts(49152, count, 1000, probe, seed)]
    assert len(set(firsts)) == len(firsts) == 36
    assert random_prompts(49152, 2, 50, "long", 1) == random_prompts(49152, 2, 50, "long", 1)


@pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")
def test_the_attention_bench_times_a_step_and_counts_what_it_reads() -> None:
    shape = AttentionShape(2, 40, layers=2, heads=4, kv_heads=2, dim=16, dtype=torch.float32)
    # keys and values, sequences, keys each, KV heads, dim, bytes a number, layers
    assert shape.kv_bytes() == 2 * 2 * 40 * 2 * 16 * 4 * 2
    median, best = step_time(shape, 3)
    assert 0 < best <= median


def test_workloads_are_seeded_and_shaped() -> None:
    assert build(WorkloadParams("burst", seed=3)) == build(WorkloadParams("burst", seed=3))
    assert build(WorkloadParams("burst", seed=3)) != build(WorkloadParams("burst", seed=4))
    assert len(synthetic_text(random.Random(0), 1000).split()) == round(1000 * WORDS_PER_TOKEN)

    shared = build(WorkloadParams("shared-prefix", num_requests=5))
    assert len({c.system for c in shared}) == 1 and len({c.turns[0] for c in shared}) == 5
    tenants = build(WorkloadParams("tenants", num_requests=48, system_prompts=6, prefix_len=100))
    assert len({c.system for c in tenants}) == 6 and len({c.turns[0] for c in tenants}) == 48
    assert all(len(str(c.system).split()) == round(100 * WORDS_PER_TOKEN) for c in tenants)
    long = build(WorkloadParams("long-prompt", num_requests=8, prompt_len=50, long_prompt_len=1000))
    assert sorted(len(c.turns[0].split()) > 500 for c in long) == [False] * 2 + [True] * 6
    assert all(len(c.turns) == 3 for c in build(WorkloadParams("multi-turn", num_requests=2, turns=3)))

    arrivals = [c.arrival for c in build(WorkloadParams("staggered", num_requests=400, request_rate=4.0))]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 0.2 < arrivals[-1] / 399 < 0.3  # mean gap 1 / rate
    assert {c.arrival for c in build(WorkloadParams("burst"))} == {0.0}
    repeated = [c.turns[0] for c in build(WorkloadParams("repeated", num_requests=8))]
    assert repeated[:2] == repeated[2:4] == repeated[4:6] == repeated[6:] and repeated[0] != repeated[1]
    rewrite = build(WorkloadParams("rewrite", num_requests=3, prompt_len=200))
    assert len({c.turns[0] for c in rewrite}) == 3
    assert all(c.turns[0].count("def ") == 15 and "renamed to" in c.turns[0] for c in rewrite)  # 14 tokens each


def test_burst_figures_json_plot_and_compare(server: ServerThread, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    path, png = tmp_path / "burst.json", tmp_path / "burst.png"
    assert bench("--url", server.base_url, "--workload", "burst", *SMALL, "--temperature", "0.7", "--top-p", "0.9",
                 "--json", str(path), "--plot", str(png)) == 0
    out = capsys.readouterr().out
    assert "model tiny" in out and "TTFT" in out and "6 completed, 0 failed" in out

    result = report.load(path)
    s = result["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["usage_from_chunks"] == 0
    assert s["completion_tokens"] == 48 and s["prompt_tokens"] > 6 * 16
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        stats = s[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] and stats["mean"] > 0, key
    for r in result["requests"]:
        assert r["error"] is None and r["completion_tokens"] == 8 and r["usage_from_server"]
        assert 0 < r["ttft"] <= r["e2e"] <= s["duration_s"] and r["tpot"] > 0
    assert result["config"]["model"] == "tiny" and result["config"]["concurrency"] == 6
    assert result["config"]["top_p"] == 0.9
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    assert bench("--compare", str(path), str(path)) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("output throughput"))
    assert row.split()[-1] == "1.00"


def test_multi_turn_sends_the_history(server: ServerThread) -> None:
    result = run(server.base_url, name="multi-turn", num_requests=2, turns=3, prompt_len=8, output_len=4)
    assert result["summary"]["completed"] == 6 and set(result["summary"]["ttft_ms_by_turn"]) == {"1", "2", "3"}
    for conversation in (0, 1):
        prompts = [r["prompt_tokens"] for r in result["requests"] if r["conversation"] == conversation]
        assert len(prompts) == 3 and prompts == sorted(set(prompts))  # each turn carries the ones before
    assert all(isinstance(r["cached_tokens"], int) for r in result["requests"])  # usage.prompt_tokens_details


def test_shared_prefix_on_completions(server: ServerThread) -> None:
    result = run(server.base_url, endpoint="completions", name="shared-prefix", num_requests=3, prompt_len=8,
                 prefix_len=24, output_len=4)
    assert result["summary"]["completed"] == 3 and result["summary"]["completion_tokens"] == 12


def test_a_failing_server_is_counted_not_raised(server: ServerThread, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "down.json"
    assert bench("--url", f"http://127.0.0.1:{port}", "--workload", "burst", *SMALL, "--json", str(path)) == 1
    assert "0 completed, 6 failed" in capsys.readouterr().out
    down = report.load(path)["summary"]
    assert down["failed"] == 6 and "ConnectError" in next(iter(down["errors"]))
    assert down["ttft_ms"]["mean"] is None

    unknown = run(server.base_url, model="nope", name="baseline", num_requests=2, output_len=4)["summary"]
    assert unknown["failed"] == 2 and next(iter(unknown["errors"])).startswith("HTTP 404")


def test_a_server_with_an_api_key_is_benched_with_it(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """`tokenmill bench` had no --api-key: a server started with one refused every request."""
    loaded = load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu"))
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    with ServerThread(loaded, "tiny", ServerConfig(api_key=("sesame",))) as srv:
        assert bench("--url", srv.base_url, "--model", "tiny", "--workload", "burst", *SMALL) == 1
        assert "0 completed, 6 failed" in capsys.readouterr().out
        assert bench("--url", srv.base_url, "--workload", "burst", *SMALL, "--api-key", "sesame") == 0
        assert "model tiny" in (out := capsys.readouterr().out) and "6 completed, 0 failed" in out
        monkeypatch.setenv("TOKENMILL_API_KEY", "sesame,other")  # as the server and the chat command read it
        assert bench("--url", srv.base_url, "--workload", "burst", *SMALL) == 0


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _one_request(handler, timeout: float = 600.0) -> client.RequestRecord:
    """One request through the client against a fake server (an httpx transport calling handler)."""
    async def one() -> client.RequestRecord:
        cfg = client.ClientConfig(url="http://server", timeout=timeout)
        record = client.RequestRecord(0, 1, 0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=cfg.base_url) as http:
            await client._request(http, cfg, {}, record, 0.0)
        return record

    return asyncio.run(one())


HI = '{"choices":[{"delta":{"content":"hi"}}]}'


@pytest.mark.parametrize(("body", "error"), [
    (_sse(HI, '{"error":{"message":"boom"}}'), "error event: boom"),
    (_sse(HI), "the stream ended without data: [DONE]"),
    (None, "timeout after 0.2 s"),
])
def test_stream_failures_become_records(body: bytes | None, error: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if body is None:
            await asyncio.sleep(5)
        return httpx.Response(200, content=body)

    assert _one_request(handler, timeout=0.2).error == error


def test_chunks_are_counted_when_the_server_sends_no_usage() -> None:
    record = _one_request(lambda request: httpx.Response(200, content=_sse(HI, HI, HI, "[DONE]")))
    assert record.ok and record.completion_tokens == 3 and not record.usage_from_server and len(record.itl) == 2


def test_long_prompt_delay_and_the_prefill_stall_figures(server: ServerThread) -> None:
    # the tiny model reads a byte per token: 60 "tokens" of words are about 300 of its tokens. The long prompt comes
    # a second in, so that the short ones have streamed some tokens before it on a loaded machine (at 0.2 s, a run
    # beside the rest of the suite on two cores had none: no figure before it).
    params = dict(name="long-prompt", num_requests=4, long_fraction=0.25, prompt_len=4, long_prompt_len=60,
                  output_len=48, long_prompt_delay=1.0)
    arrivals = {c.long: c.arrival for c in build(WorkloadParams(**params))}
    assert arrivals == {True: 1.0, False: 0.0}
    summary = run(server.base_url, **params)["summary"]
    assert summary["failed"] == 0
    before, during = summary["itl_ms_before_long_prefill"], summary["itl_ms_during_long_prefill"]
    assert before["p50"] is not None and before["p50"] > 0
    assert set(during) == {"mean", "p50", "p90", "p99"}


def test_agree_reports_where_two_servers_answers_part(server: ServerThread, tiny_gguf: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert agree.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agree.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agree.first_difference([1, 2], [1, 2, 3]) == 2
    monkeypatch.setattr(sys, "argv", ["agree", str(tiny_gguf), "--url", server.base_url, "--url", server.base_url,
                                      "--max-tokens", "8"])
    agree.main()
    out = capsys.readouterr().out
    assert "same answers: 8 of 8" in out and out.count(" same\n") == 8


def test_stream_lines_split_where_sse_splits_them_only() -> None:
    """A server may send U+2028 raw inside its JSON (SSE allows it); the bench reads the line whole."""
    body = 'data: {"a":"x\u2028y\u0085z"}\r\ndata: [DONE]\n\ntail'.encode()

    async def lines() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as http, http.stream("GET", "http://x/") as response:
            return [line async for line in client.sse_lines(response)]

    assert asyncio.run(lines()) == ['data: {"a":"x\u2028y\u0085z"}', "data: [DONE]", "", "tail"]


def test_the_decode_profile_lists_a_cpu_steps_ops(tiny_gguf: Path) -> None:
    """bench.decode --profile on a CPU: the parts of each step, then the torch ops a profiled step calls on the
    engine's thread with their own time (the profiler records per thread: the engine's, not the caller's)."""
    engine = start_engine(load_model(str(tiny_gguf), WeightPlan(dtype="float32", device="cpu")))
    try:
        lines = _profile(engine, [1, 2, 3], 1, timed_steps=4, profiled_steps=2).splitlines()
    finally:
        engine.stop()
    assert lines[0].startswith("  4 decode steps of 1 streams")
    assert lines[1].startswith("  profiled 2 steps: ops a step")
    ops = [line.split() for line in lines[3:]]
    assert ops and all(float(own) >= 0 and float(calls) > 0 for own, calls, _ in ops)
    assert any(name.startswith(("aten::", "tokenmill::")) for _, _, name in ops)
