"""Decode and prefill speed of a model inside the engine (no HTTP), per dtype, and on CUDA with and without graphs.

    python -m tokenmill.bench.decode [MODEL] --dtype float32 bfloat16 --tokens 128 --runs 5 [--quantized both]
    python -m tokenmill.bench.decode MODEL --quantized off --bf16-kernels both --streams 1 32 --prefill
    python -m tokenmill.bench.decode MODEL --device cuda --dtype bfloat16 --streams 1 32 256 --graphs both \\
        --row-matmul both --prefill --profile
    python -m tokenmill.bench.decode MODEL --tensor-parallel-size 1 2 --threads 2 --streams 1 8
    python -m tokenmill.bench.decode MODEL --dtype bfloat16 --kv-cache-dtype auto int8 fp8_e4m3 --long 2531

Each run sends --streams requests at once (the stream counts taking turns, run by run), each generating --tokens
tokens greedily with ignore_eos. Decode speed is the tokens that arrive while every stream decodes, over that window
(from the last stream's first token to the first stream's last), so prefill is not in it; with one stream,
(tokens - 1) / (first token to last). --prefill also times 8 prompts of 1,000 tokens (one output token each).
--profile times the parts of 64 decode steps at each --streams count (schedule, the runner, sampling, update, emit;
the GPU's time by CUDA events), then records 16 more with torch.profiler and prints the kernels a step and their
time. Prints the median and range over the runs, and the weights' bytes read per second (each step reads every
weight once: the quantized weights, or their dense copies where a step of many rows runs on them) where there are
runs. "x 1 row": a step of that many streams over a one-stream step, the median over the runs of each run against
the one-stream run beside it.
--tensor-parallel-size: each size in its own run, --threads split among its ranks (their weights: rank 0's share).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenmill.api.engine_client import EngineClient
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.kernels import gpu
from tokenmill.layers.kv_quant import KV_CACHE_DTYPES
from tokenmill.layers.quantized import DENSE_FROM_ROWS, GpuQuantizedLinear, QuantizedLinear
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


def random_prompts(vocab: int, count: int, length: int, probe: str, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids, drawn from a generator of this probe's and this seed's own: a
    probe's prompts never begin as another probe's do, so the prefix cache serves none of them from another (drawn
    from the same seed, --long's prompt began with --prefill's first one, 992 of its tokens a prefix hit)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{probe}/{seed}".encode()))
    return torch.randint(1000, vocab, (count, length), generator=generator).tolist()


async def _prefill(engine: Engine, vocab: int, seed: int) -> float:
    """Prompt tok/s of 8 prompts of 1,000 random tokens sent at once, one output token each (other prompts each
    run: no prefix-cache hits)."""
    prompts = random_prompts(vocab, 8, 1000, "prefill", seed)
    streams = EngineClient(engine).submit(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    for stream in streams:
        async for _ in stream:
            pass
    return 8 * 1000 / (time.perf_counter() - started)


async def _long(engine: Engine, length: int, tokens: int, seed: int) -> tuple[float, float]:
    """One stream after a prompt of `length` random tokens (no prefix-cache hit): seconds to its first token, and
    the median milliseconds between the tokens that follow (each step's attention reads the whole context)."""
    vocab = engine.tokenizer.vocab_size
    (prompt,) = random_prompts(vocab, 1, length, "long", seed)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    (stream,) = EngineClient(engine).submit([prompt], params)
    started = time.perf_counter()
    times: list[float] = []
    async for out in stream:
        times += [time.perf_counter()] * len(out.token_ids)
    gaps = [(b - a) * 1e3 for a, b in zip(times[1:], times[2:], strict=False)]  # the second token may share a step
    return times[0] - started, statistics.median(gaps)


class _StepProbe:
    """Wraps the engine's step and its parts, on the engine thread: the wall time of each part a step (schedule,
    the runner's launch, sampling, which waits for the GPU, update, emit), the GPU's time between the runner's
    start and end (CUDA events), then torch.profiler over later steps, started and stopped on the engine thread
    (its CPU ops are recorded per thread, and the kernels a step are counted from it)."""

    PARTS = (("schedule", "scheduler", "schedule"), ("run", "runner", "run"), ("sample", None, "sampler"),
             ("update", "scheduler", "update"), ("emit", "output", "emit"))

    def __init__(self, engine: Engine, streams: int, timed_steps: int, profiled_steps: int) -> None:
        self.streams, self.timed_steps, self.profiled_steps = streams, timed_steps, profiled_steps
        self.gpu = engine.runner.device.type == "cuda"
        self.steps = 0
        self.parts: dict[str, list[float]] = {name: [] for name, _, _ in self.PARTS}
        self.walls: list[float] = []
        self.cycles: list[float] = []  # step start to the next step's start: the loop's own work included
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.prof: Any = None  # torch.profiler.profile, imported when it starts
        self.last_start = 0.0
        self.originals: list[tuple[object, str, object]] = []
        for name, owner, attr in self.PARTS:
            self._wrap(name, engine if owner is None else getattr(engine, owner), attr)
        self._wrap("step", engine, "_step")

    def _wrap(self, name: str, owner: object, attr: str) -> None:
        original = getattr(owner, attr)
        self.originals.append((owner, attr, original))

        def timed(*args, **kwargs):
            if name == "step":
                return self._step(original)
            started = time.perf_counter()
            if name == "run" and self.gpu and self._timing():
                begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                out = original(*args, **kwargs)
                finish.record()
                self.events.append((begin, finish))
            else:
                out = original(*args, **kwargs)
            if self._timing():
                self.parts[name].append(time.perf_counter() - started)
            return out

        setattr(owner, attr, timed)

    def _timing(self) -> bool:
        return 0 < self.steps <= self.timed_steps  # the first step is the prompt's

    def _step(self, original) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.steps += 1
        if self.steps == self.timed_steps + 2:
            self.prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.gpu else [])])
            self.prof.start()
        started = time.perf_counter()
        if self._timing() and self.walls:
            self.cycles.append(started - self.last_start)
        self.last_start = started
        original()
        if self._timing():
            self.walls.append(time.perf_counter() - started)
        if self.prof is not None and self.steps == self.timed_steps + 1 + self.profiled_steps:
            self.prof.stop()

    def restore(self) -> None:
        for owner, attr, original in self.originals:
            setattr(owner, attr, original)

    def report(self) -> str:
        def ms(xs: list[float]) -> float:
            return statistics.median(xs) * 1000 if xs else float("nan")

        lines = [f"  {len(self.walls)} decode steps of {self.streams} streams, ms a step (medians): "
                 + ", ".join(f"{name} {ms(times):.3f}" for name, times in self.parts.items())
                 + f"; the step {ms(self.walls):.3f}, step to step {ms(self.cycles):.3f}"]
        if self.events:
            torch.cuda.synchronize()
            lines.append(f"  GPU time from the runner's start to its end: "
                         f"{statistics.median(b.elapsed_time(e) for b, e in self.events):.3f} ms (median)")
        if self.prof is None:
            return "\n".join(lines)
        if not self.gpu:
            return "\n".join(lines + self._cpu_ops())
        kernels = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.device_time)
        count = self.profiled_steps
        lines += [f"  profiled {count} steps: kernels a step {len(kernels) / count:.0f}, their time a step "
                  f"{sum(e.device_time for e in kernels) / count / 1000:.3f} ms", "  top kernels (ms a step, count):"]
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]:
            lines.append(f"    {sum(times) / count / 1000:8.3f} {len(times) / count:5.0f}  {name[:90]}")
        return "\n".join(lines)

    def _cpu_ops(self) -> list[str]:
        """The torch ops a profiled step calls on the engine's thread, and their own CPU time a step (what they spend
        outside the ops they call): where a CPU step's time goes below the model's Python."""
        count = self.profiled_steps
        ops = [e for e in self.prof.key_averages() if e.self_cpu_time_total > 0]
        calls = sum(e.count for e in ops)
        lines = [f"  profiled {count} steps: ops a step {calls / count:.0f}, their own CPU time a step "
                 f"{sum(e.self_cpu_time_total for e in ops) / count / 1000:.3f} ms (the profiler's cost included)",
                 "  top ops (own ms a step, calls a step):"]
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:14]:
            lines.append(f"    {e.self_cpu_time_total / count / 1000:8.3f} {e.count / count:5.0f}  {e.key[:90]}")
        return lines


def _profile(engine: Engine, prompt_ids: list[int], streams: int, timed_steps: int = 64,
             profiled_steps: int = 16) -> str:
    """Decode steps of `streams` streams: their parts' wall time and GPU time, then the kernels a step (_StepProbe)."""
    probe = _StepProbe(engine, streams, timed_steps, profiled_steps)
    try:
        asyncio.run(_streams(engine, [prompt_ids] * streams, timed_steps + profiled_steps + 8))
    finally:
        probe.restore()
    return probe.report()


@dataclass(frozen=True)
class Timing:
    """What one configuration's process measures: decode at each stream count (tokens a stream, runs of each),
    prompt speed, a profile of the decode steps at each stream count."""

    tokens: int
    runs: int
    streams: tuple[int, ...]
    prefill: bool = False
    profile: bool = False
    threads: int | None = None
    long: int = 0


def measure(config: EngineConfig, timing: Timing) -> dict:
    if timing.threads:
        torch.set_num_threads(timing.threads)
    streams, runs, tokens = timing.streams, timing.runs, timing.tokens
    engine = Engine(config)
    engine.start()  # loads the model on the engine thread
    try:
        prompt_ids = engine.tokenizer.encode(PROMPT)
        asyncio.run(_streams(engine, [prompt_ids] * max(streams), 8))  # warm-up
        model = getattr(engine.runner.model, "model", engine.runner.model)  # rank 0's shard, with tensor parallelism
        modules = list(model.modules())  # type: ignore[union-attr]
        linears = [m for m in modules if isinstance(m, QuantizedLinear | GpuQuantizedLinear)]
        kept = [m.weight.bits for m in linears]
        # The bytes a step reads: a step of few rows the quantized weights, one of many their dense copies, if any
        copies = [m.dense for m in linears if m.dense is not None]
        copied = sum(m.weight.nbytes for m in linears if m.dense is not None)
        total = sum(weight_bytes(model))
        copies_from = gpu.QUANTIZED_ROWS + 1 if engine.runner.device.type == "cuda" else DENSE_FROM_ROWS
        result: dict = {"weights": total - sum(sum(weight_bytes(c)) for c in copies),
                        "weights_many": total - copied, "copies_from": copies_from,
                        "quantized": any(bits < 16 for bits in kept),
                        "bf16_kernels": 16 in kept,
                        "graphs": engine.runner.graphs is not None,
                        "row_matmul": config.gpu_row_matmul and engine.runner.device.type == "cuda",
                        "pdl": config.gpu_pdl and gpu.pdl_ready(engine.runner.device)}
        # the stream counts take turns run by run, so that the machine's drift spreads over all of them (a step of
        # n rows against one of a row, the ratio the table prints, was drift-bound when every run of one came first)
        for n in streams:
            result[n] = []
        for _ in range(runs):
            for n in streams:
                result[n].append(asyncio.run(_streams(engine, [prompt_ids] * n, tokens)))
        if timing.prefill:
            vocab = engine.tokenizer.vocab_size
            asyncio.run(_prefill(engine, vocab, runs))  # warm-up: the prefill kernels compile for their shapes
            result["prefill"] = [asyncio.run(_prefill(engine, vocab, seed)) for seed in range(runs)]
        if timing.long:
            asyncio.run(_long(engine, timing.long, 8, runs))  # warm-up
            result["long"] = [asyncio.run(_long(engine, timing.long, tokens, seed)) for seed in range(runs)]
        if timing.profile:
            result["profile"] = "\n".join(_profile(engine, prompt_ids, n) for n in streams)
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
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="also time one stream after an N-token prompt: its first token (s) and ms a token")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps at each stream count (kernels: CUDA)")
    parser.add_argument("--row-matmul", choices=["on", "off", "both"], default="on",
                        help="CUDA: one-row projections through tokenmill's row_matmul kernel, the norms and SwiGLU "
                             "fused in (off: cuBLAS; both: each, in its own process)")
    parser.add_argument("--quantized", choices=["on", "off", "both"], default="on",
                        help="GGUF weights kept quantized (off: dequantized at load, --no-quantized-weights; both: "
                             "each, in its own process): the A/B of the quantized kernels")
    parser.add_argument("--pdl", choices=["on", "off", "both"], default="on",
                        help="CUDA, sm_90 and newer: the Triton kernels launch with programmatic dependent launch "
                             "(off: --no-gpu-pdl; both: each, in its own process)")
    parser.add_argument("--fused-decode", choices=["on", "off", "both"], default="on",
                        help="CPU: decode steps run each layer as one C++ op (off: --no-fused-decode-layers; both: "
                             "each, in its own process)")
    parser.add_argument("--stacked-decode", choices=["on", "off", "both"], default="on",
                        help="CPU: those fused layers run in one C++ call a step (off: --no-stacked-decode-layers, "
                             "one call a layer; both: each, in its own process)")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                        help="ranks, each size in its own run; --threads is split among them")
    parser.add_argument("--bf16-kernels", choices=["on", "off", "both"], default="on",
                        help="CPU: dense matrices of bf16 values run tokenmill's kernels (off: --no-bf16-kernels, "
                             "oneDNN's matmuls; both: each, in its own process)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                        help="the KV cache's dtypes, each in its own run")
    parser.add_argument("--amx-attention", choices=["on", "off", "both"], default="on",
                        help="CPU with AMX, bf16: prompt chunks' attention on AMX tiles (off: --no-amx-attention, as "
                             "--bf16-pair-attention picks; both: each, in its own process)")
    parser.add_argument("--bf16-pair-attention", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="CPU, bf16: prompt chunks' attention on bf16 pairs or fp32 tiles, each in its own run")
    parser.add_argument("--bf16-pair-matmul", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="CPU, bf16: bf16 weights' matmuls on bf16 pairs or fp32 multiply-adds, each in its own "
                             "run")
    parser.add_argument("--freeze-gc", choices=["on", "off", "both"], default="on",
                        help="the collector sets aside what is alive once the model is loaded (off: "
                             "--no-freeze-gc; both: each, in its own process)")
    parser.add_argument("--huge-pages", choices=["on", "off", "both"], default="on",
                        help="CPU: the weights the kernels read in memory advised for huge pages (off: "
                             "--no-huge-pages; both: each, in its own process)")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"model {args.model}, {args.tokens} tokens greedy, {args.runs} runs, torch {torch.__version__}, "
          f"{threads} threads")
    print(f"{'dtype':<10} {'kv':<8} {'amx':<4} {'pairs':<5} {'mm pairs':<8} {'tp':<3} {'fused':<6} {'stack':<6} "
          f"{'quant':<6} "
          f"{'bf16k':<6} "
          f"{'graphs':<7} "
          f"{'row mm':<8} {'pdl':<4} {'gc':<4} {'huge':<4} "
          f"{'streams':>7} "
          f"{'median tok/s':>12} "
          f"{'min':>9} {'max':>9} {'weights GB/s':>12} {'step ms':>8} {'x 1 row':>7}")
    spawn = multiprocessing.get_context("spawn")
    timing = Timing(args.tokens, args.runs, tuple(args.streams), args.prefill, args.profile, args.threads,
                    args.long)
    both = {"on": [True], "off": [False], "both": [False, True]}
    runs = [(d, q, g, r, p, k, tp, f, st, kv, amx, pairs, mm, z, hp) for d in args.dtype for q in both[args.quantized]
            for g in both[args.graphs] for r in both[args.row_matmul] for p in both[args.pdl]
            for k in both[args.bf16_kernels]
            for tp in args.tensor_parallel_size for f in both[args.fused_decode] for st in both[args.stacked_decode]
            for kv in args.kv_cache_dtype
            for amx in both[args.amx_attention] for pairs in args.bf16_pair_attention for mm in args.bf16_pair_matmul
            for z in both[args.freeze_gc] for hp in both[args.huge_pages]]
    for dtype, quantized, graphs, row, pdl, bf16_kernels, tp, fused, stacked, kv, amx, pairs, mm, freeze, huge in runs:
        config = EngineConfig(model=args.model, dtype=dtype, device=args.device, quantized_weights=quantized,
                              max_num_seqs=max(args.streams), enforce_eager=not graphs, gpu_row_matmul=row,
                              gpu_pdl=pdl, bf16_kernels=bf16_kernels, tensor_parallel_size=tp,
                              fused_decode_layers=fused, stacked_decode_layers=stacked, kv_cache_dtype=kv,
                              amx_attention=amx,
                              bf16_pair_attention=pairs,
                              bf16_pair_matmul=mm, freeze_gc=freeze, huge_pages=huge,
                              threads=max(1, threads // tp) if tp > 1 else args.threads)
        result = _in_fresh_process(spawn, config, replace(timing, threads=None) if tp > 1 else timing)
        mode = (f"{kv:<8} {'on' if amx else 'off':<4} {pairs:<5} {mm:<8} {tp:<3} {'on' if fused else 'off':<6} "
                f"{'on' if stacked else 'off':<6} "
                f"{'on' if result['quantized'] else 'off':<6} "
                f"{'on' if result['bf16_kernels'] else 'off':<6} "
                f"{'on' if result['graphs'] else 'off':<7} "
                f"{'on' if result['row_matmul'] else 'off':<8} {'on' if result['pdl'] else 'off':<4} "
                f"{'on' if freeze else 'off':<4} {'on' if huge else 'off':<4}")
        ones = result[1] if 1 in args.streams else None
        for n in args.streams:
            speeds = result[n]
            step_bytes = result["weights_many" if n >= result["copies_from"] else "weights"]
            read = statistics.median(speeds) / n * step_bytes / 1e9  # steps a second x bytes a step
            step = n / statistics.median(speeds)  # seconds a step: each stream's token a step
            # each run's step over the one-stream run's beside it (the runs take turns), the median of those: the
            # machine's drift between runs cancels, where a ratio of medians kept it
            paired = [n * one / speed for one, speed in zip(ones, speeds, strict=True)] if ones else None
            ratio = f"{statistics.median(paired):>7.2f}" if paired else f"{'':>7}"
            print(f"{dtype:<10} {mode} {n:>7} {statistics.median(speeds):>12.1f} {min(speeds):>9.1f} "
                  f"{max(speeds):>9.1f} {read:>12.1f} {step * 1e3:>8.2f} {ratio}")
        if "prefill" in result:
            speeds = result["prefill"]
            print(f"{dtype:<10} {mode} {'prefill':>7} {statistics.median(speeds):>12.1f} "
                  f"{min(speeds):>9.1f} {max(speeds):>9.1f}")
        if "long" in result:
            first, per_token = zip(*result["long"], strict=True)
            print(f"{dtype:<10} {mode} after a {args.long:,}-token prompt: first token "
                  f"{statistics.median(first):.2f} s ({min(first):.2f}-{max(first):.2f}), then "
                  f"{statistics.median(per_token):.2f} ms a token ({min(per_token):.2f}-{max(per_token):.2f})")
        if "profile" in result:
            print(f"profile, {dtype}, kv, amx, pairs, tp, fused, quantized, bf16 kernels, graphs, row matmul and PDL "
                  f"{' '.join(mode.split())}:\n"
                  f"{result['profile']}")

def _in_fresh_process(spawn: Any, config: EngineConfig, timing: Timing) -> dict:
    """measure() in a fresh process, so that no run inherits another's memory, thread pools or graphs (not a pool's
    daemon: tensor-parallel ranks are its children)."""
    results = spawn.Queue()
    process = spawn.Process(target=_measure_into, args=(config, timing, results))
    process.start()
    result = results.get()
    process.join()
    if isinstance(result, BaseException):
        raise result
    return result


def _measure_into(config: EngineConfig, timing: Timing, results: Any) -> None:
    try:
        results.put(measure(config, timing))
    except BaseException as exc:
        results.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
