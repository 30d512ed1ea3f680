"""A step's attention metadata, built from the KV cache's bookkeeping (its block tables or buffers) for the kernels
that run the step: each new token's slot, the tables and key counts decode rows read, and the step's prefill
chunks, one batch of them for the GPU's kernel (where backend.py says it runs) or a table each for the C++ and
torch paths. The caches keep the tables; this module makes the tensors."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tokenmill import backend
from tokenmill.cache.kv_cache import ContiguousKVCache, KVCache, PagedKVCache, Pool
from tokenmill.kernels import gpu
from tokenmill.layers.attention import AttentionMetadata, ContiguousMetadata, PagedMetadata, PrefillBatch, SequenceSlice


def prepare(cache: KVCache, slices: list[SequenceSlice]) -> AttentionMetadata:
    """The metadata of a step running `slices` (decodes first) over cache."""
    if isinstance(cache, ContiguousKVCache):
        return ContiguousMetadata(slices, [cache.buffers[s.seq_id] for s in slices])
    return paged(cache, slices)


def paged(cache: PagedKVCache, slices: list[SequenceSlice]) -> PagedMetadata:
    """A paged step's metadata: each pool's view, joined."""
    decodes = [s for s in slices if s.num_tokens == 1 or s.as_decodes]
    assert all(s.num_tokens == 1 or s.as_decodes for s in slices[:len(decodes)]), "decodes must lead the batch"
    device = cache.device
    lengths = torch.tensor([p + 1 for s in decodes for p in range(s.start, s.start + s.num_tokens)],
                           dtype=torch.long, device=device)
    row_lengths = None
    if cache.paths.per_row:  # each row: its sequence's table, and the keys up to its own position
        row_lengths = torch.tensor([p + 1 for s in slices for p in range(s.start, s.start + s.num_tokens)],
                                   dtype=torch.long, device=device)
    return joined(cache, [_view(cache, pool, slices, decodes, lengths, row_lengths) for pool in cache.pools])


def joined(cache: PagedKVCache, views: list[PagedMetadata]) -> PagedMetadata:
    """One step's views of each pool (in cache.pools' order) as the metadata the model takes."""
    meta, *sliding = views
    if sliding:
        meta.sliding, meta.layer_pools = sliding[0], cache.layer_pools
    return meta


def _view(cache: PagedKVCache, pool: Pool, slices: list[SequenceSlice], decodes: list[SequenceSlice],
          lengths: torch.Tensor, row_lengths: torch.Tensor | None) -> PagedMetadata:
    """The step over one pool; lengths and row_lengths: the keys each decode row, and each row, sees."""
    chunks = slices[len(decodes):]
    device = cache.device
    # On CUDA with the GPU kernels every prefill chunk of the step attends in one launch.
    batch = _prefill_batch(cache, pool, chunks) if chunks and backend.gpu_kernels(device) else None
    # On CPU with the C++ kernels, each chunk through the prefill kernel (where the A/B switch leaves it on).
    prefill_kernel = bool(chunks) and cache.paths.prefill_kernel and backend.cpu_kernels(device)
    return PagedMetadata(
        k_layers=pool.k_layers, v_layers=pool.v_layers, slot_mapping=_slots(cache, pool, slices),
        num_decodes=len(lengths), decode_tables=_row_tables(cache, pool, decodes).flatten(), decode_lengths=lengths,
        prefills=[] if batch else [(s, torch.tensor(pool.tables[s.seq_id], device=device)) for s in chunks],
        prefill_batch=batch, row_tables=None if row_lengths is None else _row_tables(cache, pool, slices),
        row_lengths=row_lengths, prefill_kernel=prefill_kernel,
        prefill_on=cache.paths.prefill_on)


def _slots(cache: PagedKVCache, pool: Pool, slices: list[SequenceSlice]) -> torch.Tensor:
    """Where each new token's K/V goes in the pool's flattened tensors."""
    bs = cache.block_size
    slots: list[int] = []
    for s in slices:
        table = pool.tables[s.seq_id]
        slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_tokens)]
    return torch.tensor(slots, dtype=torch.long, device=cache.device)


def _row_tables(cache: PagedKVCache, pool: Pool, slices: list[SequenceSlice]) -> torch.Tensor:
    """Each slice's table (padded) once for every one of its rows, on the device."""
    tables = _padded_tables(cache, pool, slices)
    if any(s.num_tokens != 1 for s in slices):  # a decode step's slices are a row each: nothing to repeat
        tables = tables.repeat_interleave(torch.tensor([s.num_tokens for s in slices], dtype=torch.long), dim=0)
    return tables.to(cache.device)


def _prefill_batch(cache: PagedKVCache, pool: Pool, chunks: list[SequenceSlice]) -> PrefillBatch:
    """The step's prefill chunks as one batch for the GPU kernel, over the pool."""
    block_seq, block_row = gpu.prefill_blocks([s.num_tokens for s in chunks])
    rows = [0, *itertools.accumulate(s.num_tokens for s in chunks)]
    small = torch.tensor([s.start for s in chunks] + rows + block_seq + block_row, dtype=torch.long)
    small = small.to(cache.device, non_blocking=True).split([len(chunks), len(rows), len(block_seq), len(block_row)])
    return PrefillBatch(_padded_tables(cache, pool, chunks).to(cache.device, non_blocking=True), *small)


def decode_rows(cache: PagedKVCache, seq_ids: list[int], positions: list[int], tables: np.ndarray) -> list[list[int]]:
    """A decode step's rows for a CUDA graph's inputs (engine/graphs.py): each sequence's block table of each pool
    written into tables [pools, >= rows, width] (null-padded); returns each pool's slots of the rows' new
    tokens."""
    bs = cache.block_size
    slots = []
    for pool, out in zip(cache.pools, tables, strict=False):
        own = [pool.tables[seq_id] for seq_id in seq_ids]
        out[:len(own)] = 0
        _fill_rows(out, own)
        slots.append([table[p // bs] * bs + p % bs for table, p in zip(own, positions, strict=True)])
    return slots


def _padded_tables(cache: PagedKVCache, pool: Pool, slices: list[SequenceSlice]) -> torch.Tensor:
    """[slices, longest table] block ids, padded with the null block."""
    own = [pool.tables[s.seq_id] for s in slices]
    tables = np.zeros((len(own), max(map(len, own), default=1)), dtype=np.int64)  # numpy's is the cheaper call
    _fill_rows(tables, own)
    return torch.from_numpy(tables)


def _fill_rows(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every i: a numpy row write from a list, the cheapest way found to fill a
    step's tables (docs/performance/tuning.md)."""
    for row, ids in zip(out, rows, strict=False):  # out may have more rows (a graph's, padded)
        row[:len(ids)] = ids


