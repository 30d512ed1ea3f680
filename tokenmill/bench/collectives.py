"""The tensor-parallel all-reduce on its own: microseconds per all-reduce of a step's rows, through shared memory
(kernels/collectives.cpp) and through torch.distributed's gloo, between ranks on this host.

    python -m tokenmill.bench.collectives --ranks 2 --hidden 576 --rows 1 8 64 2048

Each rank is a process of one thread; each size is reduced --repeat times after a warm-up, and the median of every
rank's mean is printed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import time
from typing import Any

import torch

from tokenmill.parallel.collectives import GroupSpec, join, new_spec


def _rank(spec: GroupSpec, rank: int, rows: list[int], hidden: int, repeat: int, dtype: str, results: Any) -> None:
    torch.set_num_threads(1)
    group = join(spec, rank, torch.device("cpu"))
    timings = {}
    for n in rows:
        x = torch.ones(n, hidden, dtype=getattr(torch, dtype))
        for _ in range(10):
            group.all_reduce(x)
        started = time.perf_counter()
        for _ in range(repeat):
            group.all_reduce(x)
        timings[n] = (time.perf_counter() - started) / repeat * 1e6
    results.put((rank, timings))
    group.close()


def measure(ranks: int, shm: bool, rows: list[int], hidden: int, repeat: int, dtype: str) -> dict[int, float]:
    spec = new_spec(ranks, shm)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(spec, r, rows, hidden, repeat, dtype, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    per_rank: list[dict[int, float]] = []
    while len(per_rank) < ranks:
        try:
            per_rank.append(results.get(timeout=1)[1])
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a rank failed (its error is above)") from None
    for p in procs:
        p.join()
    if spec.shm_path and os.path.exists(spec.shm_path):  # the ranks' close() removes it
        os.unlink(spec.shm_path)
    return {n: statistics.median(t[n] for t in per_rank) for n in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576, help="the residual stream's width (SmolLM2-135M: 576)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 2048])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    shm = measure(args.ranks, True, args.rows, args.hidden, args.repeat, args.dtype)
    gloo = measure(args.ranks, False, args.rows, args.hidden, args.repeat, args.dtype)
    print(f"{args.ranks} ranks, rows of {args.hidden} {args.dtype}, {args.repeat} all-reduces each")
    print(f"{'rows':>6} {'shared memory us':>17} {'gloo us':>10} {'ratio':>7}")
    for n in args.rows:
        print(f"{n:>6} {shm[n]:>17.1f} {gloo[n]:>10.1f} {gloo[n] / shm[n]:>7.1f}")


if __name__ == "__main__":
    main()
