"""The C++ kernels' matmuls of a model alone (a GGUF's quantized matrices; a bf16 model's, in the kernels' 16-bit
layout), at the row counts of decode, speculative verify and prefill steps, and a decode step's whole forward.

    python -m tokenmill.bench.matmul [MODEL] [--rows 1 5 8 32 512] [--runs 9] [--threads 2] [--context 256] \
        [--dtype float32] [--kv-cache-dtype int8] [--bf16-pair-matmul on|off] [--decode-fetch-ahead on|off|both]

Three measures, each a median (and the fastest) over --runs:

**Each matrix.** Every distinct matrix of the first layer, and the output head, called on random bf16 rows of each
count: milliseconds a call and GOP/s (2 x rows x in x out integer or float operations over the time). The matrix
stays in the caches from call to call (the head, where it is larger than them, excepted): this is the kernel's
arithmetic.

**A step's matrices.** Every layer's matrices in turn at each row count, as a decode step reads them: their bytes
from memory once a pass. Milliseconds a pass, its GB/s, and its time over the one-row pass: what a step of that many
rows costs against a step of one, in the matmuls (the step's target for a 5-row speculative verify is 1.3x).

**A decode step's forward.** The model's forward at each row count up to 64 (a decode step's), each row a
sequence of --context keys in a paged KV pool (every layer as the engine runs it, fused where it can, then the
head), alternated with a one-row forward --runs times: milliseconds a step, and the median over the alternations of
each one's time over the one-row step beside it (the machine's drift between them cancels). --decode-fetch-ahead
both times each step with decode attention's fetching ahead off and on, taking turns in this one process. The
engine's step adds the scheduler, the sampler and the output around it (python -m tokenmill.bench.decode).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill import kernels
from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import PagedKVCache
from tokenmill.config import EngineConfig, WeightPlan
from tokenmill.engine.tensor_parallel import kv_spec
from tokenmill.layers.attention import SequenceSlice
from tokenmill.layers.kv_quant import KV_CACHE_DTYPES
from tokenmill.layers.quantized import QuantizedLinear
from tokenmill.loader import LoadedModel, load_model


def call_times(call: Callable[[], object], runs: int, repeat: int = 1) -> list[float]:
    call()  # warm-up: the caches, and the kernels' first-call set-up
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        times.append((time.perf_counter() - started) / repeat)
    return times


def _rows(count: int, features: int) -> torch.Tensor:
    return torch.randn(count, features, generator=torch.Generator().manual_seed(count)).to(torch.bfloat16)


def _forward_steps(loaded: LoadedModel, counts: list[int], runs: int, context: int, kv_cache_dtype: str,
                   fetch_ahead: list[bool]) -> None:
    """A decode step's forward at each row count, alternated with a one-row step, for each setting of decode
    attention's fetching ahead in turn (the module's docstring)."""
    block = 16
    counts = [count for count in counts if count <= 64]
    rows = max(counts, default=1)
    spec = kv_spec(loaded, kv_cache_dtype)
    cache = PagedKVCache(spec, loaded.device, num_blocks=rows * (context // block + 1) + 1, block_size=block)
    for seq in range(rows):
        assert cache.reserve(seq, context + 1, context + 1)
    # Written once, so that the steps read the pool from memory: its pages untouched, every read would find Linux's
    # one shared zero page, always in the caches.
    for pool in cache.pools:
        for layer in (*pool.k_layers, *pool.v_layers):
            layer.zero_()

    def step(count: int) -> Callable[[], object]:
        slices = [SequenceSlice(seq, context, 1) for seq in range(count)]
        ids, positions = torch.full((count,), 100), torch.full((count,), context)

        def call() -> object:
            with torch.inference_mode():
                return loaded.model.compute_logits(loaded.model(ids, positions, metadata.prepare(cache, slices)))
        return call

    calls = {count: step(count) for count in sorted({1, *counts})}
    for call in calls.values():
        call()  # warm-up
    times: dict[tuple[bool, int], list[float]] = {(on, count): [] for on in fetch_ahead for count in calls}
    try:
        for _ in range(runs):
            for on in fetch_ahead:
                kernels.use_decode_fetch_ahead(on)
                for count, call in calls.items():
                    times[on, count] += call_times(call, 1, repeat=5)
    finally:
        kernels.use_decode_fetch_ahead(True)
    print(f"\na decode step's forward, each row a sequence of {context} keys, alternated with one row's")
    print(f"{'rows':>5s} {'ms a step':>18s} {'x 1 row':>8s} {'fetch ahead':>11s}")
    for on in fetch_ahead:
        for count in counts:
            mine, ones = times[on, count], times[on, 1]
            ratio = statistics.median(t / one for t, one in zip(mine, ones, strict=True))
            print(f"{count:5d} {statistics.median(mine) * 1e3:9.3f} ({min(mine) * 1e3:.3f}) {ratio:8.2f} "
                  f"{'on' if on else 'off':>11s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=EngineConfig.model)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 32, 512])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=256, help="keys each row of a decode step sees")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the pool's dtype in the decode steps' table")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the rows' dtype (and the KV pool's, where --kv-cache-dtype is auto)")
    parser.add_argument("--decode-fetch-ahead", default="on", choices=["on", "off", "both"],
                        help="decode attention fetches the next chunk ahead in the forward steps (both: off and on "
                             "taking turns in this process)")
    parser.add_argument("--bf16-pair-matmul", default="auto", choices=["auto", "on", "off"],
                        help="a bf16 model's bf16 weights multiply its rows as bf16 pairs or widened to fp32")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, WeightPlan(dtype=args.dtype, device="cpu", bf16_pair_matmul=args.bf16_pair_matmul))
    net = loaded.model
    assert isinstance(net, torch.nn.Module)
    linears = {name: m for name, m in net.named_modules() if isinstance(m, QuantizedLinear)}
    if not linears:
        raise SystemExit(f"{args.model}: no matrix runs on the C++ kernels here (TOKENMILL_NO_KERNELS, or no CPU "
                         "kernels built)")
    first = min(name.split(".layers.")[1].split(".")[0] for name in linears if ".layers." in name)
    shown = {name: m for name, m in linears.items() if f".layers.{first}." in name or ".layers." not in name}
    print(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, medians (fastest) of "
          f"{args.runs} runs")
    print(f"{'matrix':40s} {'bits':>4s} {'in':>6s} {'out':>7s} {'rows':>5s} {'ms a call':>18s} {'GOP/s':>14s}")
    for name, m in shown.items():
        out_features, in_features = m.weight.shape
        for count in args.rows:
            x = _rows(count, in_features)
            ops = 2 * count * in_features * out_features
            repeat = max(1, int(2e8 // ops))  # calls of a few ms or more, so the clock's and Python's cost is small
            times = call_times(lambda: m(x), args.runs, repeat)  # noqa: B023 (called here, in this iteration)
            median, best = statistics.median(times), min(times)
            print(f"{name:40s} {m.weight.bits:4d} {in_features:6d} {out_features:7d} {count:5d} "
                  f"{median * 1e3:9.3f} ({best * 1e3:.3f}) {ops / median / 1e9:6.0f} ({ops / best / 1e9:.0f})")
    layered = [m for name, m in linears.items() if ".layers." in name]
    nbytes = sum(m.weight.nbytes for m in layered)
    print(f"\nevery layer's matrices in turn ({len(layered)} matrices, {nbytes / 1e6:.1f} MB a pass)")
    print(f"{'rows':>5s} {'ms a pass':>18s} {'GB/s':>6s} {'x 1 row':>8s}")
    one_row: float | None = None
    for count in args.rows:
        inputs = {f: _rows(count, f) for f in {m.weight.shape[1] for m in layered}}

        def step(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for m in layered:
                m(inputs[m.weight.shape[1]])

        times = call_times(step, args.runs)
        median = statistics.median(times)
        if count == 1:
            one_row = median
        ratio = f"{median / one_row:8.2f}" if one_row else ""
        print(f"{count:5d} {median * 1e3:9.3f} ({min(times) * 1e3:.3f}) {nbytes / median / 1e9:6.1f} {ratio}")
    _forward_steps(loaded, args.rows, args.runs, args.context, args.kv_cache_dtype,
                   {"on": [True], "off": [False], "both": [False, True]}[args.decode_fetch_ahead])

if __name__ == "__main__":
    main()
