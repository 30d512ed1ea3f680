"""Fixed-size KV blocks: a free list and reference counts. Pure bookkeeping, no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, first_block: int = 0) -> None:
        """Blocks first_block .. first_block + num_blocks - 1 (ids below first_block are the owner's)."""
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(first_block, first_block + num_blocks))
        self._refs = [0] * (first_block + num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take count free blocks (each with one reference); the caller checks num_free first."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def ref(self, block: int) -> None:
        """One more holder of an allocated block (prefix sharing)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; it cannot gain a reference")
        self._refs[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list with its last one."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} freed twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refs(self, block: int) -> int:
        return self._refs[block]
