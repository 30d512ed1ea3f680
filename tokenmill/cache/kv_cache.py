"""KV memory in two layouts behind one interface, so they can be measured A/B (`--kv paged|contiguous`).

- paged: one preallocated pool of fixed-size blocks per layer; a sequence owns a block table and grows block by
  block, so memory follows what is actually used.
- contiguous: one buffer per sequence, reserved for its whole possible length (prompt + max_tokens) when admitted.

Both answer the scheduler (reserve, free, capacity, usage) and the runner (prepare: a step's attention metadata).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from tokenmill.cache.block_pool import BlockPool
from tokenmill.cache.prefix_cache import RadixCache
from tokenmill.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class SequenceSlice:
    seq_id: int
    start: int  # tokens of this sequence already in the cache (its first new token's position)
    num_tokens: int  # new tokens of this sequence in the flat batch


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


@dataclass
class PagedMetadata:
    """A step over the paged pool. Decoding sequences (one new token each) come first in the flat batch."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V goes in the flattened pool
    num_decodes: int
    decode_tables: torch.Tensor  # [decodes * max blocks]: the block tables, flat, padded with the null block
    decode_mask: torch.Tensor  # [decodes, 1, 1, max blocks * block size]: True where a key exists
    prefills: list[tuple[SequenceSlice, torch.Tensor]]  # (slice, its block table), for the rest


class PagedKVCache:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 block_size: int, prefix_caching: bool = False) -> None:
        self.block_size = block_size
        # Block 0 is the null block: never allocated, always zero, the padding of decode block tables. Masked
        # keys get zero attention weight, but 0 * NaN is NaN, so padding must never hold a stray NaN.
        self.pool = BlockPool(num_blocks, first_block=1)
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.tables: dict[int, list[int]] = {}
        self.prefix_cache = RadixCache(self.pool, block_size) if prefix_caching else None

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_sequences(self) -> int:
        return len(self.tables)

    def usage(self) -> float:
        """Share of blocks held by live requests (blocks only the prefix cache holds are free to evict)."""
        live = {block for table in self.tables.values() for block in table}
        return len(live) / self.pool.num_blocks

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
        self.tables[seq_id] = table + self.pool.allocate(need)
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
        self.tables[seq_id] = blocks
        return len(blocks) * self.block_size

    def cache(self, seq_id: int, tokens: list[int]) -> None:
        """Offer a sequence's computed tokens to the prefix cache (their full blocks become shareable)."""
        if self.prefix_cache is not None and seq_id in self.tables:
            self.prefix_cache.insert(tokens, self.tables[seq_id])

    def free(self, seq_id: int) -> None:
        for block in self.tables.pop(seq_id, []):
            self.pool.free(block)

    def prepare(self, slices: list[SequenceSlice]) -> PagedMetadata:
        bs = self.block_size
        slots: list[int] = []
        for s in slices:
            table = self.tables[s.seq_id]
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_tokens)]
        decodes = [s for s in slices if s.num_tokens == 1]
        num_decodes = len(decodes)
        assert all(s.num_tokens == 1 for s in slices[:num_decodes]), "decodes must lead the batch"
        width = max((len(self.tables[s.seq_id]) for s in decodes), default=1)
        tables = torch.zeros(num_decodes, width, dtype=torch.long)
        lengths = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long)
        for i, s in enumerate(decodes):
            table = self.tables[s.seq_id]
            tables[i, : len(table)] = torch.tensor(table)
        mask = torch.arange(width * bs)[None, :] < lengths[:, None]
        prefills = [(s, torch.tensor(self.tables[s.seq_id], device=self.device)) for s in slices[num_decodes:]]
        return PagedMetadata(
            cache=self, slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_decodes, decode_tables=tables.flatten().to(self.device),
            decode_mask=mask[:, None, None, :].to(self.device), prefills=prefills,
        )


@dataclass
class ContiguousMetadata:
    cache: ContiguousKVCache
    slices: list[SequenceSlice]


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 capacity_tokens: int) -> None:
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = device
        self.capacity_tokens = capacity_tokens
        self._reserved = 0
        self.buffers: dict[int, torch.Tensor] = {}  # seq id -> [layers, 2, capacity, kv heads, head dim]

    @property
    def num_sequences(self) -> int:
        return len(self.buffers)

    def usage(self) -> float:
        return self._reserved / self.capacity_tokens

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
        shape = (self.num_layers, 2, final_len, self.num_kv_heads, self.head_dim)
        self.buffers[seq_id] = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._reserved += final_len
        return True

    def free(self, seq_id: int) -> None:
        buffer = self.buffers.pop(seq_id, None)
        if buffer is not None:
            self._reserved -= buffer.shape[2]

    def prepare(self, slices: list[SequenceSlice]) -> ContiguousMetadata:
        return ContiguousMetadata(self, slices)


KVCache = PagedKVCache | ContiguousKVCache
AttentionMetadata = PagedMetadata | ContiguousMetadata


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1.5GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.85)
    # On CPU the KV pool shares RAM with everything else: take a tenth of what is available.
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 10
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 10


def build_kv_cache(layout: str, memory: str | None, block_size: int, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, max_tokens_needed: int, prefix_caching: bool) -> KVCache:
    """Size KV memory from an explicit budget or the free memory, never beyond max_tokens_needed tokens."""
    per_token = bytes_per_token(config, dtype)
    budget = parse_bytes(memory) if memory else _available_memory(device)
    tokens = min(budget // per_token, max_tokens_needed)
    if layout == "paged":
        num_blocks = tokens // block_size
        if num_blocks < 1:
            raise ValueError(f"KV memory of {budget} bytes holds no block of {block_size} tokens")
        cache: KVCache = PagedKVCache(config, dtype, device, num_blocks, block_size, prefix_caching)
    elif layout == "contiguous":
        if prefix_caching:
            log.info("prefix caching needs the paged layout: off with --kv contiguous")
        cache = ContiguousKVCache(config, dtype, device, tokens)
    else:
        raise ValueError(f"unknown KV layout {layout!r}: choose paged or contiguous")
    log.info("KV cache: %s, %.2f GiB for %d tokens (%d bytes per token)", layout,
             cache.capacity_tokens * per_token / 2**30, cache.capacity_tokens, per_token)
    return cache
