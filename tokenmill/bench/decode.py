"""Single-stream decode speed of a model inside the engine (no HTTP), per dtype.

    python -m tokenmill.bench.decode [MODEL] --dtype float32 bfloat16 --tokens 128 --runs 5 [--no-quantized-weights]

Each run generates --tokens tokens greedily with ignore_eos; decode speed is (tokens - 1) / (time from the first
token to the last), so prefill is not in it. Prints the median and range over the runs.
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
from tokenmill.sampling import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


async def _one_run(engine: Engine, prompt_ids: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    [stream] = EngineClient(engine).submit([prompt_ids], params)
    first = last = None
    count = 0
    async for out in stream:
        if out.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(out.token_ids)
    assert count == tokens and first is not None and last is not None
    return (tokens - 1) / (last - first)


def measure(model: str, dtype: str, device: str, tokens: int, runs: int, threads: int | None,
            quantized: bool = True) -> list[float]:
    if threads:
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, quantized_weights=quantized))
    engine.start()  # loads the model on the engine thread
    try:
        prompt_ids = engine.tokenizer.encode(PROMPT)
        asyncio.run(_one_run(engine, prompt_ids, 8))  # warm-up
        return [asyncio.run(_one_run(engine, prompt_ids, tokens)) for _ in range(runs)]
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
    parser.add_argument("--no-quantized-weights", dest="quantized", action="store_false",
                        help="dequantize GGUF weights at load (the A/B of the quantized kernels)")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"model {args.model}, {args.tokens} tokens greedy, {args.runs} runs, torch {torch.__version__}, "
          f"{threads} threads, quantized weights {'on' if args.quantized else 'off'}")
    print(f"{'dtype':<10} {'median tok/s':>12} {'min':>8} {'max':>8}")
    spawn = multiprocessing.get_context("spawn")
    for dtype in args.dtype:
        # A fresh process per dtype, so neither inherits the other's memory or thread pools.
        with spawn.Pool(1) as pool:
            speeds = pool.apply(measure, (args.model, dtype, args.device, args.tokens, args.runs, args.threads,
                                          args.quantized))
        print(f"{dtype:<10} {statistics.median(speeds):>12.1f} {min(speeds):>8.1f} {max(speeds):>8.1f}")


if __name__ == "__main__":
    main()
