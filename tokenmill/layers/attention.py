"""Attention over the KV cache for a flat batch of tokens from several sequences (ragged lengths).

Paged: all decoding sequences attend in one call, each prefill chunk on its own, causal within the chunk, seeing
every earlier token; on CPU through tokenmill's kernels straight from the pool (kernels/attention.cpp and
attention_prefill.cpp), on CUDA through Triton's, else torch's SDPA over blocks gathered from the pool (a key mask
hides the padding). A quantized pool (--kv-cache-dtype int8|fp8_e4m3, layers/kv_quant.py) is read as it lies by the
CPU kernels and dequantized where torch's path gathers it.
Contiguous: every sequence attends on its own over its buffer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill import backend
from tokenmill.kernels import gpu
from tokenmill.layers import kv_quant


@dataclass
class SequenceSlice:
    seq_id: int
    start: int  # tokens of this sequence already in the cache (its first new token's position)
    num_tokens: int  # new tokens of this sequence in the flat batch
    # Each token attends as a decode row of its own, over the keys up to its position (a speculative step's decode
    # token and proposals: a few tokens, which the decode kernels and the fused decode layer then run).
    as_decodes: bool = False


@dataclass
class PrefillBatch:
    """A step's prefill chunks for one launch of the GPU kernel (kernels/gpu.py): their block tables [chunks, width],
    the position of each chunk's first row, where each chunk's rows begin among the prefill rows (and where the last
    ends), and the map of the kernel's programs (gpu.prefill_blocks)."""

    tables: torch.Tensor
    starts: torch.Tensor
    rows: torch.Tensor
    block_seq: torch.Tensor
    block_row: torch.Tensor


@dataclass
class PagedMetadata:
    """A step over a paged pool. Decode rows (one new token of a sequence each, or the tokens of an as_decodes
    slice, one row each) come first in the flat batch."""

    # Each layer's [blocks, block size, kv heads, dim] of the pool's k and v, as the pool keeps them (Pool.k_layers)
    k_layers: tuple[torch.Tensor, ...]
    v_layers: tuple[torch.Tensor, ...]
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V goes in the flattened pool
    num_decodes: int
    decode_tables: torch.Tensor  # [decodes * max blocks]: each row's block table, flat, padded with the null block
    decode_lengths: torch.Tensor  # [decodes]: keys each row sees, its own token's included
    # The rest, each (slice, its block table); on CUDA with the GPU kernels, all of them as one batch instead.
    prefills: list[tuple[SequenceSlice, torch.Tensor]]
    # Deterministic mode: every row's block table [tokens, width] and key count (its position + 1), so that a
    # prompt's rows attend through the decode kernel, whatever the chunking, and a row's result is the same bits
    # whether it was prefilled or decoded.
    row_tables: torch.Tensor | None = None
    row_lengths: torch.Tensor | None = None
    prefill_batch: PrefillBatch | None = None
    # The prefills (a table each) attend through the CPU's flash-attention kernel (kernels/attention_prefill.cpp),
    # a bf16 pool's on what prefill_on says ("fp32", "pairs" or "tiles": backend.bf16_prefill_attention).
    prefill_kernel: bool = False
    prefill_on: str = "fp32"
    # Sliding-window layers in a pool of their own (cache/kv_cache.py): the step over that pool (its tensors, slots
    # and tables; the same rows), and each layer's pool (True: the sliding one) and index among its layers.
    sliding: PagedMetadata | None = None
    layer_pools: tuple[tuple[bool, int], ...] = ()

    def kv_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's [blocks, block size, kv heads, dim] of k and v in this pool (layer: its index here)."""
        return self.k_layers[layer], self.v_layers[layer]

    def of_layer(self, layer: int) -> tuple[PagedMetadata, int]:
        """The step over the pool that holds layer's KV, and the layer's index in that pool's tensors."""
        if self.sliding is None:
            return self, layer
        slides, index = self.layer_pools[layer]
        return (self.sliding if slides else self), index


@dataclass
class ContiguousMetadata:
    """A step over per-sequence buffers: each slice's [layers, 2 (k, v), capacity, kv heads, dim]."""

    slices: list[SequenceSlice]
    buffers: list[torch.Tensor]


AttentionMetadata = PagedMetadata | ContiguousMetadata


def _causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                 window: int = 0) -> torch.Tensor:
    """q: [n, heads, dim] at positions start..start+n-1; keys/values: [start + n, kv heads, dim]. window > 0: query
    i sees key j where 0 <= i - j < window (a sliding layer), else every j <= i."""
    n = q.shape[0]
    first = max(start - window + 1, 0) if window else 0  # no query of the chunk sees a key before it
    keys, values = keys[first:], values[first:]
    mask = None
    if n > 1:  # one query sees every key from first on
        query_pos = torch.arange(start, start + n, device=q.device)[:, None]
        key_pos = torch.arange(first, start + n, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if window:
            mask &= key_pos > query_pos - window
        mask = mask[None, None]
    # Batched 4-D inputs: with them CPU SDPA takes its flash kernel for a masked GQA call (the 3-D form falls back
    # to the math path, several times slower).
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=True,
    )[0].transpose(0, 1)


@functools.lru_cache(maxsize=16)
def _head_blocks(kv_heads: int, group: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For _decode_attention, built once per shape rather than in every layer of every step: [heads, kv heads] with
    the scale where a query head reads a KV head and 0 elsewhere, and the query heads' indices."""
    own = torch.eye(kv_heads, dtype=dtype, device=device).repeat_interleave(group, dim=0) * scale
    return own, torch.arange(kv_heads * group, device=device)


def _key_mask(lengths: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """_decode_attention's key mask [b, 1, 1, keys] over the gathered tables: True where a sequence has the key and,
    with a sliding window, it is one of the sequence's last `window` keys."""
    position = torch.arange(keys, device=lengths.device)[None, :]
    mask = position < lengths[:, None]
    if window:
        mask &= position >= (lengths - window)[:, None]
    return mask[:, None, None, :]


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """One query per sequence. q: [b, heads, dim]; keys/values: [b, length, kv heads, dim], as gathered from the
    pool; mask: [b, 1, 1, length], True where a key exists, or None when every key does."""
    if q.dtype == torch.float32 or q.device.type != "cpu":  # SDPA: the fastest in fp32 on CPU
        return F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, scale=scale, enable_gqa=True).squeeze(2)
    # In bf16/fp16 SDPA's CPU kernel is slower than matmuls, and matmuls per KV head (3-row queries, keys
    # transposed into a copy) run erratically. So every query head takes one matmul over all KV heads' keys at
    # once, [length, kv heads * dim], with a block-diagonal query matrix that zeroes the other groups' products: 3x
    # the FLOPs of the grouped form (tiny here), no copy of the keys, and a shape the CPU kernels do well
    # (docs/performance/tuning.md).
    b, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    own, head = _head_blocks(kv_heads, group, scale, q.dtype, q.device)
    q_blocks = (q[:, :, None, :] * own[None, :, :, None]).reshape(b, heads, kv_heads * dim)
    scores = torch.bmm(q_blocks, keys.reshape(b, -1, kv_heads * dim).transpose(1, 2))  # [b, heads, length]
    if mask is not None:
        scores.masked_fill_(~mask.view(b, 1, -1), float("-inf"))
    # Softmax in the compute dtype: it accumulates in fp32 inside, and the scores are already rounded to it.
    probs = scores.softmax(dim=-1)
    # Each head's weights over every KV head's values; keep the values of its own KV head.
    mixed = torch.bmm(probs, values.reshape(b, -1, kv_heads * dim)).view(b, heads, kv_heads, dim)
    return mixed[:, head, head // group]


def _attend_paged(layer: int, q: torch.Tensor, meta: PagedMetadata, scale: float, window: int) -> torch.Tensor:
    """Attention over the pool, this step's K/V already written to it (meta: the step over the layer's pool, layer:
    its index there)."""
    k_cache, v_cache = meta.kv_of(layer)  # [blocks, block size, kv heads, dim (+ a quantized pool's scale)]
    kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    b = meta.num_decodes
    if meta.row_tables is not None:  # deterministic: one kernel for every row (checked at load: it is built)
        return torch.ops.tokenmill.paged_decode_attention(q, k_cache, v_cache, meta.row_tables, meta.row_lengths,
                                                          scale, window)
    if b == q.shape[0] and backend.gpu_runs(q):  # decodes only: the kernel's output is all
        return gpu.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables.view(b, -1), meta.decode_lengths,
                                          scale, window)
    if b == q.shape[0] and backend.cpu_kernels(q.device):
        return torch.ops.tokenmill.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables.view(b, -1),
                                                          meta.decode_lengths, scale, window)
    out = torch.empty_like(q)
    if b and backend.gpu_runs(q):
        out[:b] = gpu.paged_decode_attention(q[:b], k_cache, v_cache, meta.decode_tables.view(b, -1),
                                             meta.decode_lengths, scale, window)
    elif b and backend.cpu_kernels(q.device):  # read from the pool through the tables (kernels/)
        tables = meta.decode_tables.view(b, -1)
        out[:b] = torch.ops.tokenmill.paged_decode_attention(q[:b], k_cache, v_cache, tables, meta.decode_lengths,
                                                             scale, window)
    elif b:
        # index_select, not advanced indexing: the faster gather on CPU
        keys = kv_quant.readable(k_cache.index_select(0, meta.decode_tables).view(b, -1, kv_heads, width), q.dtype)
        values = kv_quant.readable(v_cache.index_select(0, meta.decode_tables).view(b, -1, kv_heads, width),
                                   q.dtype)
        mask = _key_mask(meta.decode_lengths, keys.shape[1], window)
        out[:b] = _decode_attention(q[:b], keys, values, mask, scale)
    batch = meta.prefill_batch
    if batch is not None:
        out[b:] = gpu.paged_prefill_attention(q[b:], k_cache, v_cache, batch.tables, batch.starts, batch.rows,
                                              batch.block_seq, batch.block_row, scale, window)
        return out
    row = b
    for s, table in meta.prefills:
        if meta.prefill_kernel:
            out[row:row + s.num_tokens] = torch.ops.tokenmill.paged_prefill_attention(
                q[row:row + s.num_tokens], k_cache, v_cache, table, s.start, scale, window,
                meta.prefill_on == "pairs", meta.prefill_on == "tiles")
            row += s.num_tokens
            continue
        end = s.start + s.num_tokens
        keys = kv_quant.readable(k_cache.index_select(0, table).view(-1, kv_heads, width)[:end], q.dtype)
        values = kv_quant.readable(v_cache.index_select(0, table).view(-1, kv_heads, width)[:end], q.dtype)
        out[row:row + s.num_tokens] = _causal_sdpa(q[row:row + s.num_tokens], keys, values, s.start, scale, window)
        row += s.num_tokens
    return out


def _contiguous(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContiguousMetadata,
                scale: float, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    row = 0
    for s, buffer in zip(meta.slices, meta.buffers, strict=True):
        rows = slice(row, row + s.num_tokens)
        buf = buffer[layer]
        end = s.start + s.num_tokens
        buf[0, s.start:end] = k[rows]
        buf[1, s.start:end] = v[rows]
        if s.num_tokens == 1:  # the decode kernel the paged layout uses, so an A/B compares layouts, not kernels
            first = max(end - window, 0) if window else 0
            out[rows] = _decode_attention(q[rows], buf[0, first:end][None], buf[1, first:end][None], None, scale)
        else:
            out[rows] = _causal_sdpa(q[rows], buf[0, :end], buf[1, :end], s.start, scale, window)
        row += s.num_tokens
    return out


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float, window: int = 0) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv heads, dim] (this step's new tokens) -> [tokens, heads, dim].
    window > 0: a sliding layer's, each query sees the `window` keys up to its own (masked out of a full KV cache)."""
    if isinstance(meta, PagedMetadata):
        meta, layer = meta.of_layer(layer)
        k_cache, v_cache = meta.kv_of(layer)
        kv_quant.store(k_cache, meta.slot_mapping, k)
        kv_quant.store(v_cache, meta.slot_mapping, v)
        return _attend_paged(layer, q, meta, scale, window)
    return _contiguous(layer, q, k, v, meta, scale, window)


def fused_rotary_attention(layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                           meta: AttentionMetadata, heads: int, kv_heads: int, scale: float,
                           window: int = 0) -> torch.Tensor | None:
    """attention() from the fused q|k|v projection [tokens, (heads + 2 kv heads) * dim], RoPE applied: one op
    rotates q and k and writes k and v to the pool (kernels/rope.cpp on CPU, kernels/gpu.py on CUDA). None where it
    does not run (no kernels, not a paged pool): the caller takes the torch path."""
    if not isinstance(meta, PagedMetadata):
        return None
    meta, layer = meta.of_layer(layer)
    cos, sin = rope
    if backend.gpu_runs(qkv):
        k_cache, v_cache = meta.kv_of(layer)
        q = gpu.rope_store_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, heads, kv_heads,
                              kv_quant.largest(k_cache.dtype))
    elif backend.cpu_kernels(qkv.device):
        q = torch.ops.tokenmill.rope_store_kv(qkv, cos, sin, *meta.kv_of(layer), meta.slot_mapping, heads,
                                              kv_heads)
    else:
        return None
    return _attend_paged(layer, q, meta, scale, window)
