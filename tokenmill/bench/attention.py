"""Decode attention over the paged KV pool alone, against the machine's own read bandwidth.

    python -m tokenmill.bench.attention [--shape 32x256 1x2560 8x512] [--layers 30] [--heads 9] [--kv-heads 3] \
        [--dim 64] [--dtype bfloat16] [--runs 9] [--threads 2]

Each shape SEQSxKEYS is one decode step's attention: SEQS sequences of KEYS keys each, in --layers pools (one a
layer, as the model keeps them) whose blocks lie scattered as a serving pool's do, so a step reads every key and
value once from memory (the pools are larger than the caches). Prints milliseconds a step and the KV bytes read over
that time (GB/s), beside the machine's read bandwidth measured in the same run (a sum over 256 MiB on the same
threads): how near the kernel is to reading the pool at memory speed. Medians (and the fastest) over --runs.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill import backend
from tokenmill.bench.matmul import call_times


@dataclass
class AttentionShape:
    seqs: int
    keys: int
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16

    def kv_bytes(self) -> int:
        """The keys' and values' bytes a step reads."""
        return 2 * self.seqs * self.keys * self.kv_heads * self.dim * self.dtype.itemsize * self.layers


def _median_and_best(call: Callable[[], object], runs: int) -> tuple[float, float]:
    times = call_times(call, runs)
    return statistics.median(times), min(times)


def step_time(shape: AttentionShape, runs: int) -> tuple[float, float]:
    """Seconds (median, fastest) of one step's attention over every layer's pool."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-shape.keys // shape.block_size)
    blocks = shape.seqs * per_seq

    def pool() -> torch.Tensor:
        return torch.randn(blocks, shape.block_size, shape.kv_heads, shape.dim, generator=g).to(shape.dtype)

    pools = [(pool(), pool()) for _ in range(shape.layers)]
    tables = torch.randperm(blocks, generator=g).view(shape.seqs, per_seq)
    lengths = torch.full((shape.seqs,), shape.keys)
    q = torch.randn(shape.seqs, shape.heads, shape.dim, generator=g).to(shape.dtype)
    scale = shape.dim**-0.5

    def step() -> None:
        for k, v in pools:
            torch.ops.tokenmill.paged_decode_attention(q, k, v, tables, lengths, scale, 0)

    return _median_and_best(step, runs)


def read_bandwidth(runs: int) -> float:
    """Bytes a second that a sum over 256 MiB reads, on torch's threads: the machine's read bandwidth."""
    x = torch.ones(64 << 20)
    median, _ = _median_and_best(x.sum, runs)
    return x.numel() * x.itemsize / median


def _shape(text: str) -> tuple[int, int]:
    seqs, keys = text.lower().split("x")
    return int(seqs), int(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", type=_shape, default=[(32, 256), (1, 2560), (8, 512)],
                        metavar="SEQSxKEYS", help="sequences x keys each, one step's attention per shape")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not backend.cpu_kernels(torch.device("cpu")):
        raise SystemExit("the C++ kernels do not build here: no paged decode attention to time")
    bandwidth = read_bandwidth(args.runs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; the machine reads {bandwidth / 1e9:.1f} "
          f"GB/s (a sum over 256 MiB)")
    print(f"{'seqs':>5s} {'keys':>6s} {'KV MB a step':>12s} {'ms a step':>18s} {'GB/s':>6s} {'of the read':>11s}")
    for seqs, keys in args.shape:
        shape = AttentionShape(seqs, keys, args.layers, args.heads, args.kv_heads, args.dim,
                               getattr(torch, args.dtype))
        median, best = step_time(shape, args.runs)
        rate = shape.kv_bytes() / median
        print(f"{seqs:5d} {keys:6d} {shape.kv_bytes() / 1e6:12.1f} {median * 1e3:9.2f} ({best * 1e3:.2f}) "
              f"{rate / 1e9:6.1f} {rate / bandwidth:10.0%}")


if __name__ == "__main__":
    main()
