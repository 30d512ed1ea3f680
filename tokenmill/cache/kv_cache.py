"""KV memory in two layouts behind one interface, so they can be measured A/B (`--kv paged|contiguous`).

- paged: one preallocated pool of fixed-size blocks per layer; a sequence owns a block table and grows block by
  block, so memory follows what is actually used.
- contiguous: one buffer per sequence, reserved for its whole possible length (prompt + max_tokens) when admitted.

Both answer the scheduler (reserve, free, capacity, usage) and keep their bookkeeping (block tables, buffers);
cache/metadata.py turns it into a step's attention metadata for the kernels that run it.
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from dataclasses import dataclass, field

import torch

from tokenmill.cache.block_pool import BlockPool
from tokenmill.cache.prefix_cache import RadixCache
from tokenmill.layers import kv_quant
from tokenmill.layers.memory import anonymous_bytes


@dataclass(frozen=True)
class KVSpec:
    """What one token's KV is made of: the numbers a cache is built from."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the pool's: the compute dtype's, or a quantized one (layers/kv_quant.py)
    # True where layer i attends to its last `window` keys only (Gemma 3's sliding layers); () where all are global.
    sliding_layers: tuple[bool, ...] = ()
    window: int = 0

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def row_width(self) -> int:
        """Elements of one KV head's row of a token (a quantized pool's numbers and their scale)."""
        return kv_quant.row_width(self.dtype, self.head_dim)

    @property
    def num_sliding(self) -> int:
        return sum(self.sliding_layers) if self.window else 0


@dataclass
class Pool:
    """A pool of blocks and the KV of the layers stored in it, [layers, blocks + 2, block size, kv heads, dim]. Block
    0 is the null block: never allocated, always zero, the padding of block tables (and a sliding table's entry for
    a block its window has passed). Masked keys get zero attention weight, but 0 * NaN is NaN, so padding must never
    hold a stray NaN. The last block is scratch: where the padding rows of a CUDA graph's batch write their K/V
    (engine/graphs.py)."""

    blocks: BlockPool
    k: torch.Tensor
    v: torch.Tensor
    tables: dict[int, list[int]] = field(default_factory=dict)  # sequence -> its blocks, in order
    live: Counter[int] = field(default_factory=Counter)  # block -> how many live sequences' tables hold it
    # Each layer's [blocks + 2, block size, kv heads, dim] of k and v, made once: a step's 2 x layers views were
    # that many tensor selects from Python (~3 us each).
    k_layers: tuple[torch.Tensor, ...] = field(init=False)
    v_layers: tuple[torch.Tensor, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @staticmethod
    def build(spec: KVSpec, num_layers: int, num_blocks: int, block_size: int, device: torch.device) -> Pool:
        shape = (num_layers, num_blocks + 2, block_size, spec.num_kv_heads, spec.row_width)
        return Pool(BlockPool(num_blocks, first_block=1), lazy_zeros(shape, spec.dtype, device),
                     lazy_zeros(shape, spec.dtype, device))

    @property
    def scratch_slot(self) -> int:
        return (self.blocks.num_blocks + 1) * self.k.shape[2]

    def hold(self, seq_id: int, blocks: list[int]) -> None:
        """Append blocks (allocated or referenced for seq_id; 0: none) to its table."""
        self.tables[seq_id] = self.tables.get(seq_id, []) + blocks
        self.live.update(b for b in blocks if b)

    def release(self, block: int) -> None:
        self.blocks.free(block)
        self.live[block] -= 1
        if not self.live[block]:
            del self.live[block]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on a CPU (where the OS has private mappings: POSIX), anonymous memory, which the OS hands out zeroed
    a page at a time as it is first written: a pool sized at a tenth of RAM is not zero-filled at start (seconds) nor
    resident before its blocks are used. Page-aligned; unmapped when the tensor goes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or getattr(mmap, "MAP_PRIVATE", None) is None:  # POSIX's
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_bytes(nbytes).view(dtype).view(shape)


@dataclass(frozen=True)
class AttentionPaths:
    """How the steps over a pool attend (cache/metadata.py hands it to the layers)."""

    # Deterministic mode: every query row, prefill or decode, attends as a decode does.
    per_row: bool = False
    # Prompt chunks attend through the CPU's prefill kernel where it runs (off: torch's SDPA) ...
    prefill_kernel: bool = True
    # ... which multiplies a bf16 pool's keys and values on "fp32", bf16 "pairs" or AMX "tiles"
    # (backend.bf16_prefill_attention).
    prefill_on: str = "fp32"


class PagedKVCache:
    def __init__(self, spec: KVSpec, device: torch.device, num_blocks: int, block_size: int,
                 prefix_caching: bool = False, sliding_blocks: int = 0,
                 paths: AttentionPaths = AttentionPaths()) -> None:
        """sliding_blocks: the spec's sliding layers get a pool of their own, of this many blocks, and keep only the
        blocks their window sees (0: they keep every token, as the others do)."""
        self.block_size = block_size
        self.paths = paths
        sliding = spec.sliding_layers if sliding_blocks and spec.num_sliding else (False,) * spec.num_layers
        self.window = spec.window if any(sliding) else 0
        self.full = Pool.build(spec, sliding.count(False), num_blocks, block_size, device)
        self.sliding = Pool.build(spec, sliding.count(True), sliding_blocks, block_size, device) \
            if self.window else None
        # Each layer's pool (True: the sliding one) and its index among that pool's layers.
        self.layer_pools = tuple((slides, sliding[:i].count(slides)) for i, slides in enumerate(sliding))
        self.device = device
        sliding_pool = None if self.sliding is None else self.sliding.blocks
        self.prefix_cache = RadixCache(self.pool, block_size, sliding_pool, self.window) if prefix_caching else None

    @property
    def pool(self) -> BlockPool:
        return self.full.blocks

    @property
    def k(self) -> torch.Tensor:
        return self.full.k

    @property
    def v(self) -> torch.Tensor:
        return self.full.v

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.full.tables

    @property
    def scratch_slot(self) -> int:
        return self.full.scratch_slot

    @property
    def pools(self) -> list[Pool]:
        return [self.full] if self.sliding is None else [self.full, self.sliding]

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        return sum(pool.k.nbytes + pool.v.nbytes for pool in self.pools)

    @property
    def num_sequences(self) -> int:
        return len(self.tables)

    def usage(self) -> float:
        """Share of blocks held by live requests (blocks only the prefix cache holds are free to evict), of the
        fuller pool."""
        return max(len(p.live) / p.blocks.num_blocks for p in self.pools)

    def occupancy(self) -> dict[str, float | int]:
        """For the dashboard: blocks live sequences hold, blocks only the prefix cache holds (free to evict), all
        (read from another thread while the loop runs: a glance, each count of its own moment)."""
        live = len(self.full.live)
        counts: dict[str, float | int] = {
            "usage": self.usage(), "block_size": self.block_size, "blocks_used": live,
            "blocks_cached": max(0, self.pool.num_used - live), "blocks_total": self.pool.num_blocks}
        if self.sliding is not None:
            counts |= {"sliding_blocks_used": len(self.sliding.live),
                       "sliding_blocks_total": self.sliding.blocks.num_blocks}
        return counts

    def blocks_of(self, seq_id: int) -> int:
        return len(self.tables.get(seq_id, ()))

    def reserve(self, seq_id: int, num_tokens: int, final_len: int, computed: int = 0) -> bool:
        """Make room for the sequence's first num_tokens tokens, of which `computed` are in the cache already (the
        sliding pool first lets go of the blocks no query from there on sees); False (and nothing taken) if a
        pool is short."""
        if self.sliding is not None:
            self._pass_window(seq_id, computed)
        need = -(-num_tokens // self.block_size) - len(self.tables.get(seq_id, ()))
        if need <= 0:
            return True
        for pool in self.pools:
            short = need - pool.blocks.num_free
            if short > 0 and self.prefix_cache is not None:
                # Evicting full blocks frees their sliding blocks as well.
                evict = self.prefix_cache.evict if pool is self.full else self.prefix_cache.evict_sliding
                evict(short)
            if need > pool.blocks.num_free:
                return False
        for pool in self.pools:
            pool.hold(seq_id, pool.blocks.allocate(need))
        return True

    def _pass_window(self, seq_id: int, computed: int) -> None:
        """Free the sequence's sliding blocks wholly before the window of its next token (position `computed`)."""
        assert self.sliding is not None
        table = self.sliding.tables.get(seq_id, [])
        i = min(max(0, computed - self.window + 1) // self.block_size, len(table)) - 1
        while i >= 0 and table[i]:  # the blocks before the last one freed are all freed
            self.sliding.release(table[i])
            table[i] = 0
            i -= 1

    def match_prefix(self, seq_id: int, tokens: list[int], salt: int = 0) -> int:
        """On admission: share the longest cached prefix (whole blocks, never the last token, whose logits are
        needed); returns how many tokens it covers. salt: the namespace of the sequence's KV (its LoRA adapter's):
        only KV cached under the same salt is shared."""
        if self.prefix_cache is None or self.tables.get(seq_id):
            return 0
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        blocks, sliding = self.prefix_cache.match(_salted(tokens[:usable], salt))
        for pool, held in zip(self.pools, (blocks, sliding), strict=False):
            for block in held:
                if block:
                    pool.blocks.ref(block)
            pool.hold(seq_id, held)
        return len(blocks) * self.block_size

    def cache(self, seq_id: int, tokens: list[int], salt: int = 0) -> None:
        """Offer a sequence's computed tokens to the prefix cache (their full blocks become shareable by
        sequences of the same salt)."""
        if self.prefix_cache is not None and seq_id in self.tables:
            self.prefix_cache.insert(_salted(tokens, salt), self.tables[seq_id],
                                     None if self.sliding is None else self.sliding.tables[seq_id])

    def free(self, seq_id: int) -> None:
        for pool in self.pools:
            for block in pool.tables.pop(seq_id, []):
                if block:
                    pool.release(block)


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

    @property
    def memory_bytes(self) -> int:
        """The most its buffers take: its whole capacity reserved."""
        return self.capacity_tokens * self.spec.bytes_per_token

    def usage(self) -> float:
        return self._reserved / self.capacity_tokens

    def occupancy(self) -> dict[str, float | int]:
        return {"usage": self.usage(), "tokens_reserved": self._reserved, "tokens_total": self.capacity_tokens}

    def blocks_of(self, seq_id: int) -> int:
        return 0  # one buffer a sequence, no blocks

    def match_prefix(self, seq_id: int, tokens: list[int], salt: int = 0) -> int:
        return 0  # no sharing in this layout

    def cache(self, seq_id: int, tokens: list[int], salt: int = 0) -> None:
        pass

    def reserve(self, seq_id: int, num_tokens: int, final_len: int, computed: int = 0) -> bool:
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


KVCache = PagedKVCache | ContiguousKVCache


def _salted(tokens: list[int], salt: int) -> list[int]:
    """Token ids moved into the salt's own range (above every vocabulary), so that the radix tree keeps each salt's
    prefixes apart."""
    if not salt:
        return tokens
    offset = salt << 32
    return [token + offset for token in tokens]
