"""KV memory in two layouts behind one interface, so they can be measured A/B (`--kv paged|contiguous`).

- paged: one preallocated pool of fixed-size blocks per layer; a sequence owns a block table and grows block by
  block, so memory follows what is actually used.
- contiguous: one buffer per sequence, reserved for its whole possible length (prompt + max_tokens) when admitted.

Both answer the scheduler (reserve, free, capacity, usage) and the runner (prepare: a step's attention metadata).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.cache.block_pool import BlockPool
from tokenmill.cache.prefix_cache import RadixCache
from tokenmill.kernels import gpu
from tokenmill.layers.attention import ContiguousMetadata, PagedMetadata, PrefillBatch, SequenceSlice


@dataclass(frozen=True)
class KVSpec:
    """What one token's KV is made of: the numbers a cache is built from."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class PagedKVCache:
    def __init__(self, spec: KVSpec, device: torch.device, num_blocks: int, block_size: int,
                 prefix_caching: bool = False, per_row_attention: bool = False) -> None:
        """per_row_attention (deterministic mode): every query row, prefill or decode, attends as a decode does."""
        self.block_size = block_size
        self.per_row_attention = per_row_attention
        # Block 0 is the null block: never allocated, always zero, the padding of decode block tables. Masked
        # keys get zero attention weight, but 0 * NaN is NaN, so padding must never hold a stray NaN.
        # The last block is scratch: where the padding rows of a CUDA graph's batch write their K/V (engine/graphs.py).
        self.pool = BlockPool(num_blocks, first_block=1)
        self.scratch_slot = (num_blocks + 1) * block_size
        shape = (spec.num_layers, num_blocks + 2, block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.device = device
        self.tables: dict[int, list[int]] = {}
        self._live: Counter[int] = Counter()  # block -> how many live sequences' tables hold it
        self.prefix_cache = RadixCache(self.pool, block_size) if prefix_caching else None

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_sequences(self) -> int:
        return len(self.tables)

    def usage(self) -> float:
        """Share of blocks held by live requests (blocks only the prefix cache holds are free to evict)."""
        return len(self._live) / self.pool.num_blocks

    def occupancy(self) -> dict[str, float | int]:
        """For the dashboard: blocks live sequences hold, blocks only the prefix cache holds (free to evict), all
        (read from another thread while the loop runs: a glance, each count of its own moment)."""
        live = len(self._live)
        return {"usage": live / self.pool.num_blocks, "block_size": self.block_size, "blocks_used": live,
                "blocks_cached": max(0, self.pool.num_used - live), "blocks_total": self.pool.num_blocks}

    def blocks_of(self, seq_id: int) -> int:
        return len(self.tables.get(seq_id, ()))

    def reserve(self, seq_id: int, num_tokens: int, final_len: int) -> bool:
        """Make room for the sequence's first num_tokens tokens; False (and nothing taken) if the pool is short."""
        table = self.tables.get(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        blocks = self.pool.allocate(need)
        self._live.update(blocks)
        self.tables[seq_id] = table + blocks
        return True

    def match_prefix(self, seq_id: int, tokens: list[int]) -> int:
        """On admission: share the longest cached prefix (whole blocks, never the last token, whose logits are
        needed); returns how many tokens it covers."""
        if self.prefix_cache is None or self.tables.get(seq_id):
            return 0
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        blocks = self.prefix_cache.match(tokens[:usable])
        for block in blocks:
            self.pool.ref(block)
        self._live.update(blocks)
        self.tables[seq_id] = blocks
        return len(blocks) * self.block_size

    def cache(self, seq_id: int, tokens: list[int]) -> None:
        """Offer a sequence's computed tokens to the prefix cache (their full blocks become shareable)."""
        if self.prefix_cache is not None and seq_id in self.tables:
            self.prefix_cache.insert(tokens, self.tables[seq_id])

    def free(self, seq_id: int) -> None:
        blocks = self.tables.pop(seq_id, [])
        self._live.subtract(blocks)
        for block in blocks:
            self.pool.free(block)
            if not self._live[block]:
                del self._live[block]

    def prepare(self, slices: list[SequenceSlice]) -> PagedMetadata:
        bs = self.block_size
        slots: list[int] = []
        for s in slices:
            table = self.tables[s.seq_id]
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_tokens)]
        decodes = [s for s in slices if s.num_tokens == 1 or s.as_decodes]
        assert all(s.num_tokens == 1 or s.as_decodes for s in slices[:len(decodes)]), "decodes must lead the batch"
        rows = [s.num_tokens for s in decodes]
        tables = self._padded_tables(decodes).repeat_interleave(torch.tensor(rows, dtype=torch.long), dim=0)
        lengths = [p + 1 for s in decodes for p in range(s.start, s.start + s.num_tokens)]
        chunks = slices[len(decodes):]
        batch = self._prefill_batch(chunks) if chunks and gpu.serves(self.device) else None  # one kernel launch
        prefills = [] if batch else [(s, torch.tensor(self.tables[s.seq_id], device=self.device)) for s in chunks]
        row_tables = row_lengths = None
        if self.per_row_attention:  # each row: its sequence's table, and the keys up to its own position
            rows_of = torch.tensor([s.num_tokens for s in slices])
            row_tables = self._padded_tables(slices).repeat_interleave(rows_of, dim=0).to(self.device)
            row_lengths = torch.tensor([p + 1 for s in slices for p in range(s.start, s.start + s.num_tokens)],
                                       dtype=torch.long, device=self.device)
        return PagedMetadata(
            k_cache=self.k, v_cache=self.v, slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=sum(rows), decode_tables=tables.flatten().to(self.device),
            decode_lengths=torch.tensor(lengths, dtype=torch.long, device=self.device), prefills=prefills,
            row_tables=row_tables, row_lengths=row_lengths, prefill_batch=batch,
        )

    def _prefill_batch(self, chunks: list[SequenceSlice]) -> PrefillBatch:
        """The step's prefill chunks as one batch for the GPU kernel."""
        block_seq, block_row = gpu.prefill_blocks([s.num_tokens for s in chunks])
        rows = [0, *itertools.accumulate(s.num_tokens for s in chunks)]
        small = torch.tensor([s.start for s in chunks] + rows + block_seq + block_row, dtype=torch.long)
        small = small.to(self.device, non_blocking=True).split([len(chunks), len(rows), len(block_seq), len(block_row)])
        return PrefillBatch(self._padded_tables(chunks).to(self.device, non_blocking=True), *small)

    def decode_rows(self, seq_ids: list[int], positions: list[int], tables: np.ndarray) -> list[int]:
        """A decode step's rows for a CUDA graph's inputs (engine/graphs.py): each sequence's block table written
        into tables [>= rows, width] (null-padded); returns the slot of each row's new token."""
        bs = self.block_size
        own = [self.tables[seq_id] for seq_id in seq_ids]
        tables[:len(own)] = 0
        _fill_rows(tables, own)
        return [table[p // bs] * bs + p % bs for table, p in zip(own, positions, strict=True)]

    def _padded_tables(self, slices: list[SequenceSlice]) -> torch.Tensor:
        """[slices, longest table] block ids, padded with the null block."""
        own = [self.tables[s.seq_id] for s in slices]
        tables = torch.zeros(len(own), max(map(len, own), default=1), dtype=torch.long)
        _fill_rows(tables.numpy(), own)
        return tables


def _fill_rows(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every i: a numpy row write from a list is ~0.4 us (a step's tables, a row
    a sequence; one scatter over all rows measured 9 us for one row and no faster at 256, a torch write 5 us a row)."""
    for row, ids in zip(out, rows, strict=False):  # out may have more rows (a graph's, padded)
        row[:len(ids)] = ids


class ContiguousKVCache:
    def __init__(self, spec: KVSpec, device: torch.device, capacity_tokens: int) -> None:
        self.spec = spec
        self.device = device
        self.capacity_tokens = capacity_tokens
        self._reserved = 0
        self.buffers: dict[int, torch.Tensor] = {}  # seq id -> [layers, 2, capacity, kv heads, head dim]

    @property
    def num_sequences(self) -> int:
        return len(self.buffers)

    def usage(self) -> float:
        return self._reserved / self.capacity_tokens

    def occupancy(self) -> dict[str, float | int]:
        return {"usage": self.usage(), "tokens_reserved": self._reserved, "tokens_total": self.capacity_tokens}

    def blocks_of(self, seq_id: int) -> int:
        return 0  # one buffer a sequence, no blocks

    def match_prefix(self, seq_id: int, tokens: list[int]) -> int:
        return 0  # no sharing in this layout

    def cache(self, seq_id: int, tokens: list[int]) -> None:
        pass

    def reserve(self, seq_id: int, num_tokens: int, final_len: int) -> bool:
        """The first call reserves the sequence's whole final length; later calls only check."""
        if seq_id in self.buffers:
            return num_tokens <= self.buffers[seq_id].shape[2]
        if self._reserved + final_len > self.capacity_tokens:
            return False
        spec = self.spec
        shape = (spec.num_layers, 2, final_len, spec.num_kv_heads, spec.head_dim)
        self.buffers[seq_id] = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self._reserved += final_len
        return True

    def free(self, seq_id: int) -> None:
        buffer = self.buffers.pop(seq_id, None)
        if buffer is not None:
            self._reserved -= buffer.shape[2]

    def prepare(self, slices: list[SequenceSlice]) -> ContiguousMetadata:
        return ContiguousMetadata(slices, [self.buffers[s.seq_id] for s in slices])


KVCache = PagedKVCache | ContiguousKVCache
