"""Attention over the KV cache for a flat batch of tokens from several sequences (ragged lengths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.cache.kv_cache import ContiguousKVCache


@dataclass
class SequenceSlice:
    seq_id: int
    start: int  # tokens of this sequence already in the cache (its first new token's position)
    num_tokens: int  # new tokens of this sequence in the flat batch


@dataclass
class AttentionMetadata:
    slices: list[SequenceSlice]
    kv_cache: ContiguousKVCache


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              scale: float) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv heads, dim] -> [tokens, heads, dim]."""
    out = torch.empty_like(q)
    offset = 0
    for s in meta.slices:
        rows = slice(offset, offset + s.num_tokens)
        keys, values = meta.kv_cache.write_and_read(layer, s.seq_id, s.start, k[rows], v[rows])
        mask = None
        if s.num_tokens > 1:
            # Causal within the new tokens; every earlier token of the sequence is visible.
            query_pos = torch.arange(s.start, s.start + s.num_tokens, device=q.device)
            mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= query_pos[:, None]
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        ).transpose(0, 1)
        offset += s.num_tokens
    return out
