"""Decode and prefill speed of a model inside the engine (no HTTP), per dtype, and on CUDA with and without graphs.

    python -m tokenmill.bench.decode [MODEL] --dtype float32 bfloat16 --tokens 128 --runs 5 [--no-quantized-weights]
    python -m tokenmill.bench.decode MODEL --device cuda --dtype bfloat16 --streams 1 32 256 --graphs both \\
        --prefill --profile

Each run sends --streams requests at once, each generating --tokens tokens greedily with ignore_eos. Decode speed
is the tokens that arrive while every stream decodes, over that window (from the last stream's first token to the
first stream's last), so prefill is not in it; with one stream, (tokens - 1) / (first token to last). --prefill
also times 8 prompts of 1,000 tokens (one output token each). --profile records 16 one-stream decode steps with
torch.profiler and prints the kernels a step, their time and the step's wall time. Prints the median and range
over the runs, and the weights' bytes read per second (each step reads every weight once) where there are runs.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

import torch

from tokenmill.api.engine_client import EngineClient
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.loader import weight_bytes
from tokenmill.sampling import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


async def _streams(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Decode tok/s of len(prompts) streams sent at once (see the module's doc)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    streams = EngineClient(engine).submit(prompts, params)

    async def arrivals(stream) -> list[float]:
        times: list[float] = []
        async for out in stream:
            times += [time.perf_counter()] * len(out.token_ids)
        assert len(times) == tokens
        return times

    every = await asyncio.gather(*(arrivals(s) for s in streams))
    start, end = max(t[0] for t in every), min(t[-1] for t in every)
    inside = sum(1 for t in every for x in t if start < x <= end)
    return inside / (end - start)


async def _prefill(engine: Engine, vocab: int, seed: int) -> float:
    """Prompt tok/s of 8 prompts of 1,000 random tokens sent at once, one output token each (other prompts each
    run: no prefix-cache hits)."""
    prompts = torch.randint(1000, vocab, (8, 1000), generator=torch.Generator().manual_seed(seed)).tolist()
    streams = EngineClient(engine).submit(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    for stream in streams:
        async for _ in stream:
            pass
    return 8 * 1000 / (time.perf_counter() - started)


async def _profiled(engine: Engine, prompt_ids: list[int], steps: int):
    """One stream's decode steps under torch.profiler, from its second token on; returns the profile and the
    tokens that arrived inside it."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    outputs = aiter(EngineClient(engine).submit([prompt_ids], params)[0])
    await anext(outputs)
    await anext(outputs)
    count = 0
    gpu = engine.runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        while count < steps:
            count += len((await anext(outputs)).token_ids)
    async for _ in outputs:
        pass
    return prof, count


def _profile(engine: Engine, prompt_ids: list[int], steps: int = 16) -> str:
    """Kernels a decode step, their summed time, the runner's wall time a step (waiting for the GPU included), and
    the kernels that take the most time."""
    original = engine.runner.run
    walls: list[float] = []

    def timed(plan):
        started = time.perf_counter()
        out = original(plan)
        if out.is_cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - started)
        return out

    engine.runner.run = timed  # type: ignore[method-assign]
    try:
        prof, count = asyncio.run(_profiled(engine, prompt_ids, steps))
    finally:
        engine.runner.run = original  # type: ignore[method-assign]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    lines = [f"  kernels a step {len(kernels) / count:.0f}, their time a step "
             f"{sum(e.device_time for e in kernels) / count / 1000:.3f} ms, the runner's wall time a step "
             f"{statistics.median(walls) * 1000:.3f} ms (median of {len(walls)})", "  top kernels (ms a step, count):"]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(f"    {sum(times) / count / 1000:8.3f} {len(times) / count:5.0f}  {name[:90]}")
    return "\n".join(lines)


def measure(model: str, dtype: str, device: str, tokens: int, runs: int, threads: int | None, quantized: bool,
            streams: list[int], eager: bool, prefill: bool, profile: bool) -> dict:
    if threads:
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, quantized_weights=quantized,
                                 max_num_seqs=max(streams), enforce_eager=eager))
    engine.start()  # loads the model on the engine thread
    try:
        prompt_ids = engine.tokenizer.encode(PROMPT)
        asyncio.run(_streams(engine, [prompt_ids] * max(streams), 8))  # warm-up
        result: dict = {"weights": sum(weight_bytes(engine.runner.model)), "graphs": engine.runner.graphs is not None}
        for n in streams:
            result[n] = [asyncio.run(_streams(engine, [prompt_ids] * n, tokens)) for _ in range(runs)]
        if prefill:
            vocab = engine.tokenizer.vocab_size
            result["prefill"] = [asyncio.run(_prefill(engine, vocab, seed)) for seed in range(runs)]
        if profile:
            result["profile"] = _profile(engine, prompt_ids)
        return result
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=EngineConfig.model)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1])
    parser.add_argument("--graphs", choices=["on", "off", "both"], default="on",
                        help="CUDA graphs of decode steps (off: --enforce-eager; both: each, in its own process)")
    parser.add_argument("--prefill", action="store_true", help="also time 8 prompts of 1,000 tokens")
    parser.add_argument("--profile", action="store_true", help="profile one-stream decode steps (kernels: CUDA)")
    parser.add_argument("--no-quantized-weights", dest="quantized", action="store_false",
                        help="dequantize GGUF weights at load (the A/B of the quantized kernels)")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"model {args.model}, {args.tokens} tokens greedy, {args.runs} runs, torch {torch.__version__}, "
          f"{threads} threads, quantized weights {'on' if args.quantized else 'off'}")
    print(f"{'dtype':<10} {'graphs':<7} {'streams':>7} {'median tok/s':>12} {'min':>9} {'max':>9} {'weights GB/s':>12}")
    spawn = multiprocessing.get_context("spawn")
    modes = {"on": [False], "off": [True], "both": [True, False]}[args.graphs]
    for dtype in args.dtype:
        for eager in modes:
            # A fresh process each, so none inherits another's memory, thread pools or graphs.
            with spawn.Pool(1) as pool:
                result = pool.apply(measure, (args.model, dtype, args.device, args.tokens, args.runs, args.threads,
                                              args.quantized, args.streams, eager, args.prefill, args.profile))
            mode = "on" if result["graphs"] else "off"
            for n in args.streams:
                speeds = result[n]
                read = statistics.median(speeds) / n * result["weights"] / 1e9  # steps a second x bytes a step
                print(f"{dtype:<10} {mode:<7} {n:>7} {statistics.median(speeds):>12.1f} {min(speeds):>9.1f} "
                      f"{max(speeds):>9.1f} {read:>12.1f}")
            if "prefill" in result:
                speeds = result["prefill"]
                print(f"{dtype:<10} {mode:<7} {'prefill':>7} {statistics.median(speeds):>12.1f} {min(speeds):>9.1f} "
                      f"{max(speeds):>9.1f}")
            if "profile" in result:
                print(f"profile, {dtype}, graphs {mode}:\n{result['profile']}")


if __name__ == "__main__":
    main()
