"""KV memory. This is the contiguous layout: each sequence owns one buffer sized for its whole life.

The paged layout (fixed-size blocks in one pool) replaces it behind the same calls: allocate, free, write, read.
"""

from __future__ import annotations

import torch

from tokenmill.models.config import ModelConfig


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}  # seq id -> [layers, 2, capacity, kv heads, head dim]

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, seq_id: int, capacity: int) -> None:
        shape = (self.num_layers, 2, capacity, self.num_kv_heads, self.head_dim)
        self._buffers[seq_id] = torch.empty(shape, dtype=self.dtype, device=self.device)

    def free(self, seq_id: int) -> None:
        self._buffers.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._buffers)

    def write_and_read(self, layer: int, seq_id: int, start: int, k: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([new tokens, kv heads, head dim]) at positions start.. and return all keys and values so far."""
        buf = self._buffers[seq_id][layer]
        end = start + k.shape[0]
        buf[0, start:end] = k
        buf[1, start:end] = v
        return buf[0, :end], buf[1, :end]
