"""Decode steps replayed from CUDA graphs: a small model's step on a GPU is hundreds of kernel launches of a few
microseconds each, and launching them one by one from Python costs more than running them.

One graph per padded batch size (1, 2, 4, 8, then multiples of 8 up to --max-num-seqs), captured at start-up over
static input buffers: a step copies its token ids, positions, KV slots, block tables and key counts into them, pads
the batch to the next size (padding rows read the null block and write their K/V into the pool's scratch block) and
replays the graph, which runs the model and the output head; the logits of its real rows come back. Only the
kernels that read the block tables themselves run in a graph (kernels/gpu.py: no gather sized by the step's
longest table), so every table is as wide as the longest context served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.cache import metadata
from tokenmill.cache.kv_cache import PagedKVCache
from tokenmill.layers.attention import PagedMetadata
from tokenmill.models.registry import CausalLM

log = logging.getLogger(__name__)


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 24, ... up to max_batch (and max_batch itself)."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, max_batch: int, max_model_len: int,
                 capture: bool = True) -> None:
        """capture: record CUDA graphs (the KV pool is on a CUDA device); False runs the same static-buffer step
        eagerly, which is how the CPU tests check what feeds the graphs."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = graph_sizes(max_batch)
        device = kv_cache.k.device
        width = -(-max_model_len // kv_cache.block_size)
        largest = self.sizes[-1]
        pools = len(kv_cache.pools)  # a sliding-window model's sliding layers have a pool (slots, tables) of their own
        # Rows: token ids, positions, key counts, then each pool's slots; tables [pools, rows, width]. Staged on the
        # host (pinned where there is a GPU), copied to the device in two copies a step.
        self.inputs = torch.zeros(3 + pools, largest, dtype=torch.long, device=device)
        self.tables = torch.zeros(pools, largest, width, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self.host_inputs = torch.zeros(3 + pools, largest, dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.zeros(pools, largest, width, dtype=torch.long, pin_memory=pin)
        # Written through numpy views of the same memory: a numpy write from a list costs ~1 us, torch's ~5-10.
        self._staged, self._staged_tables = self.host_inputs.numpy(), self.host_tables.numpy()
        self._pad(0)
        self.inputs.copy_(self.host_inputs)
        self._memory_pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        started, free = time.perf_counter(), _free_memory(device)
        for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory pool
            self.replays[size] = self._capture(size) if capture else self._eager(size)
        if capture:
            log.info("captured CUDA graphs of decode steps for batches of %s in %.1fs, %d MiB",
                     ", ".join(map(str, self.sizes)), time.perf_counter() - started,
                     (free - _free_memory(device)) >> 20)

    def size_for(self, rows: int) -> int | None:
        """The captured size a batch of rows pads to; None past the largest."""
        return next((size for size in self.sizes if size >= rows), None)

    def run(self, input_ids: list[int], positions: list[int], seq_ids: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step: one new token per sequence, each one sampled."""
        rows = len(input_ids)
        size = self.size_for(rows)
        assert size is not None, f"a decode step of {rows} rows has no graph"
        staged = self._staged
        staged[3:, :rows] = metadata.decode_rows(self.kv_cache, seq_ids, positions, self._staged_tables)
        staged[0, :rows] = input_ids
        staged[1, :rows] = positions
        np.add(staged[1, :rows], 1, out=staged[2, :rows])  # key counts
        self._pad(rows)
        self._staged_tables[:, rows:size] = 0
        self.inputs.copy_(self.host_inputs, non_blocking=True)  # whole (a few rows of largest): a contiguous copy
        self.tables[:, :size].copy_(self.host_tables[:, :size], non_blocking=True)
        return self.replays[size]()[:rows]

    def _pad(self, rows: int) -> None:
        """Padding rows from rows on: token 0 at position 0, its K/V into the scratch slot, one key (the null
        block's zeros) to attend."""
        staged = self._staged
        staged[0:2, rows:] = 0
        staged[2, rows:] = 1
        for i, pool in enumerate(self.kv_cache.pools):
            staged[3 + i, rows:] = pool.scratch_slot

    def _forward(self, size: int) -> torch.Tensor:
        kv = self.kv_cache
        meta = metadata.joined(kv, [PagedMetadata(
            k_layers=pool.k_layers, v_layers=pool.v_layers, slot_mapping=self.inputs[3 + i, :size], num_decodes=size,
            decode_tables=self.tables[i, :size].view(-1), decode_lengths=self.inputs[2, :size], prefills=[])
            for i, pool in enumerate(kv.pools)])
        hidden = self.model(self.inputs[0, :size], self.inputs[1, :size], meta)
        return self.model.compute_logits(hidden)

    def _eager(self, size: int) -> Callable[[], torch.Tensor]:
        return lambda: self._forward(size)

    def _capture(self, size: int) -> Callable[[], torch.Tensor]:
        with torch.inference_mode():
            side = torch.cuda.Stream()  # warm-up off the default stream: Triton compiles, cuBLAS sets up
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool):
                logits = self._forward(size)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
