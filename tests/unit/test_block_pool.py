"""The block pool: a free list and reference counts."""

from __future__ import annotations

import random

import pytest

from tokenmill.cache.block_pool import BlockPool


def test_blocks_are_numbered_from_the_first_the_owner_gives_it() -> None:
    assert BlockPool(3).allocate(3) == [0, 1, 2]
    pool = BlockPool(3, first_block=1)  # block 0 stays the owner's (the paged cache's null block)
    assert pool.allocate(3) == [1, 2, 3] and pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(MemoryError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)


def test_references_and_their_misuse() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    assert pool.refs(block) == 1 and pool.refs(1) == 0
    with pytest.raises(ValueError, match="block 1 is free; it cannot gain a reference"):
        pool.ref(1)
    pool.ref(block)
    pool.free(block)
    assert pool.refs(block) == 1 and pool.num_free == 1  # still held once
    pool.free(block)
    assert pool.num_free == 2 and pool.allocate(2) == [1, 0]  # freed blocks go to the back of the list
    pool.free(0)
    with pytest.raises(ValueError, match="block 0 freed twice"):
        pool.free(0)


@pytest.mark.parametrize("seed", range(3))
def test_block_pool_has_no_leak_or_double_free_under_random_cycles(seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(64)
    held: dict[int, list[int]] = {}
    for step in range(1000):
        action = rng.random()
        if action < 0.45 and pool.num_free:
            held[step] = pool.allocate(rng.randint(1, min(4, pool.num_free)))
        elif action < 0.75 and held:  # append: grow a holder by a block
            key = rng.choice(list(held))
            if pool.num_free:
                held[key] += pool.allocate(1)
        elif held:
            for b in held.pop(rng.choice(list(held))):
                pool.free(b)
        owned = [b for blocks in held.values() for b in blocks]
        assert len(owned) == len(set(owned)) == pool.num_used
    for blocks in held.values():
        for b in blocks:
            pool.free(b)
    assert pool.num_free == 64
    with pytest.raises(ValueError):
        pool.free(0)


