"""What structured output costs inside the engine (no HTTP): decode throughput with and without a JSON schema, and
the compile time of a request's schema.

    python -m tokenmill.bench.structured [MODEL] --streams 1 8 --tokens 128 --rounds 5

Each round runs the same batch twice, unconstrained and constrained, in alternating order; every sequence makes
exactly --tokens tokens (ignore_eos; the schema's 30 string properties of at least 5 characters cannot end sooner),
so both sides do the same model work and the difference is the masks. Throughput is the batch's tokens over the
time from the first token to the last. The compile time is that of 30-property schemas never seen before (the
cache misses), as a request's first use pays it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from tokenmill.api.engine_client import EngineClient
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.sampling import SamplingParams
from tokenmill.structured import StructuredSpec
from tokenmill.structured.backend import CompiledGrammar

PROMPT = "Describe a customer of a bike shop as a JSON object."


def schema(tag: str = "") -> StructuredSpec:
    properties = {f"field_{tag}{i}": {"type": "string", "minLength": 5, "maxLength": 40} for i in range(30)}
    return StructuredSpec("json", json.dumps({"type": "object", "properties": properties,
                                              "required": list(properties), "additionalProperties": False}))


async def _batch(engine: Engine, prompt_ids: list[int], streams: int, tokens: int,
                 grammar: CompiledGrammar | None) -> float:
    """The batch's decode throughput, tok/s."""
    params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=0, ignore_eos=True)
    outs = EngineClient(engine).submit([prompt_ids], params, n=streams, grammar=grammar)
    times: list[float] = []
    count = 0

    async def drain(stream) -> None:
        nonlocal count
        async for out in stream:
            if out.token_ids:
                times.append(time.perf_counter())
                count += len(out.token_ids)

    await asyncio.gather(*(drain(s) for s in outs))
    assert count == streams * tokens, f"{count} tokens, expected {streams * tokens}"
    return (count - streams) / (max(times) - min(times))


def measure(model: str, streams_list: list[int], tokens: int, rounds: int) -> None:
    engine = Engine(EngineConfig(model=model, max_num_seqs=max(streams_list)))
    engine.start()
    try:
        compile_ms = []
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            engine.grammars.compile(schema(f"r{i}_"), "bench")
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"compile of a new 30-property schema: median {statistics.median(compile_ms[1:]):.2f} ms "
              f"(first ever {compile_ms[0]:.2f} ms)")
        grammar = engine.grammars.compile(schema(), "bench")
        prompt_ids = engine.tokenizer.encode(PROMPT)
        asyncio.run(_batch(engine, prompt_ids, 2, 8, grammar))  # warm-up
        print(f"{'streams':>7} {'free tok/s':>11} {'schema tok/s':>13} {'cost':>7}")
        for streams in streams_list:
            free: list[float] = []
            constrained: list[float] = []
            for r in range(rounds):
                order = [(free, None), (constrained, grammar)]
                for into, g in order if r % 2 == 0 else reversed(order):
                    into.append(asyncio.run(_batch(engine, prompt_ids, streams, tokens, g)))
            f, c = statistics.median(free), statistics.median(constrained)
            print(f"{streams:>7} {f:>11.1f} {c:>13.1f} {(1 - c / f) * 100:>6.1f}%")
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=EngineConfig.model)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"model {args.model}, {args.tokens} tokens a sequence, median of {args.rounds} alternating rounds, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    measure(args.model, args.streams, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
