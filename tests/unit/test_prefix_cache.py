"""The radix prefix cache as pure logic over a BlockPool: match, insert, split, references, LRU eviction."""

from __future__ import annotations

from tokenmill.cache.block_pool import BlockPool
from tokenmill.cache.prefix_cache import RadixCache

BS = 4


def blocks_for(pool: BlockPool, tokens: list[int]) -> list[int]:
    """What a request does: blocks for its tokens (the last one may be partial)."""
    return pool.allocate(-(-len(tokens) // BS))


def cache(num_blocks: int = 64) -> tuple[RadixCache, BlockPool]:
    pool = BlockPool(num_blocks)
    return RadixCache(pool, BS), pool


def test_match_takes_whole_blocks_of_the_longest_prefix() -> None:
    tree, pool = cache()
    a = list(range(100, 114))  # 3 full blocks + 2 tokens
    blocks = blocks_for(pool, a)
    tree.insert(a, blocks)
    assert tree.num_blocks == 3  # the partial last block is not shared
    assert tree.match(a) == blocks[:3]
    assert tree.match(a[:11]) == blocks[:2]  # ends inside the third block
    assert tree.match(a[:8] + [0, 0, 0, 0]) == blocks[:2]  # diverges in the third block
    assert tree.match([1, 2, 3, 4, 5]) == []
    assert tree.match(a[:3]) == []


def test_insert_splits_an_edge_where_sequences_diverge() -> None:
    tree, pool = cache()
    a = list(range(12))
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57]
    blocks_a, blocks_b = blocks_for(pool, a), blocks_for(pool, b)
    tree.insert(a, blocks_a)
    tree.insert(b, blocks_b)
    assert len(tree.root.children) == 1
    upper = next(iter(tree.root.children.values()))
    assert upper.tokens == tuple(a[:4]) and upper.blocks == blocks_a[:1] and len(upper.children) == 2
    assert tree.match(b) == blocks_a[:1] + blocks_b[1:]  # the shared first block is a's, cached once
    assert tree.match(a) == blocks_a
    assert pool.refs(blocks_b[0]) == 1  # b's own copy of the shared block stays b's, not the tree's
    assert tree.num_blocks == 5


def test_references_follow_requests_and_never_go_negative() -> None:
    tree, pool = cache(num_blocks=8)
    a = list(range(8))
    blocks = blocks_for(pool, a)
    tree.insert(a, blocks)
    assert [pool.refs(b) for b in blocks] == [2, 2]  # the request and the tree
    for b in blocks:  # the request finishes
        pool.free(b)
    assert [pool.refs(b) for b in blocks] == [1, 1] and pool.num_free == 6
    reused = tree.match(a)
    for b in reused:  # a new request takes references on the hit
        pool.ref(b)
    assert tree.evict(8) == 0  # pinned: nothing can go
    for b in reused:
        pool.free(b)
    assert tree.evict(8) == 2 and pool.num_free == 8 and tree.num_blocks == 0
    assert tree.match(a) == []


def test_eviction_is_least_recently_used_and_spares_pinned_blocks() -> None:
    tree, pool = cache(num_blocks=16)
    seqs = [[i * 100 + t for t in range(8)] for i in range(3)]
    owned = []
    for s in seqs:
        blocks = blocks_for(pool, s)
        tree.insert(s, blocks)
        owned.append(blocks)
        for b in blocks:
            pool.free(b)
    tree.match(seqs[0])  # seq 0 is now the most recently used
    pinned = tree.match(seqs[2])[:1]
    pool.ref(pinned[0])  # a live request uses seq 2's first block
    assert tree.evict(2) == 2
    assert tree.match(seqs[1]) == []  # least recently used went first
    assert tree.evict(3) == 3  # seq 0's two blocks and seq 2's tail: never the pinned block
    assert tree.match(seqs[2]) == pinned and tree.match(seqs[0]) == []
    assert pool.refs(pinned[0]) == 2


def test_insert_of_a_known_prefix_changes_nothing() -> None:
    tree, pool = cache()
    a = list(range(16))
    blocks = blocks_for(pool, a)
    tree.insert(a, blocks)
    other = blocks_for(pool, a)
    tree.insert(a[:8], other)
    assert tree.match(a) == blocks and all(pool.refs(b) == 1 for b in other)


def release(pool: BlockPool, blocks: list[int]) -> None:
    """The request that held blocks finishes: only the tree's references remain."""
    for b in blocks:
        pool.free(b)


def test_prompts_of_whole_blocks_match_to_their_end() -> None:
    tree, pool = cache()
    for n in (1, 2, 8):
        a = [1000 * n + t for t in range(n * BS)]
        blocks = blocks_for(pool, a)
        tree.insert(a, blocks)
        assert tree.match(a) == blocks
        assert tree.match(a[:-1]) == blocks[:-1]


def test_a_three_way_split_keeps_every_branch() -> None:
    tree, pool = cache()
    a = list(range(16))
    b = a[:4] + [50] * 12  # leaves a after one block
    c = a[:12] + [60] * 4  # leaves a after three blocks, below the first split
    held = [blocks_for(pool, s) for s in (a, b, c)]
    for s, blocks in zip((a, b, c), held, strict=True):
        tree.insert(s, blocks)
    assert tree.match(a) == held[0]
    assert tree.match(b) == held[0][:1] + held[1][1:]
    assert tree.match(c) == held[0][:3] + held[2][3:]
    assert tree.num_blocks == 4 + 3 + 1


def test_everything_unpinned_can_be_evicted_after_splits_and_repeats() -> None:
    tree, pool = cache(num_blocks=16)
    a = list(range(16))
    b = a[:8] + [50] * 8
    held = [blocks_for(pool, s) for s in (a, b)]
    tree.insert(a, held[0])
    tree.insert(b, held[1])
    tree.insert(a, held[0])  # a repeat, and a known prefix: neither adds a node
    tree.insert(a[:8], held[0][:2])
    for blocks in held:
        release(pool, blocks)
    assert tree.num_blocks == 6 and pool.num_free == 10
    assert tree.evict(100) == 6  # the two leaves, then the shared part once it is a leaf
    assert tree.num_blocks == 0 and pool.num_free == 16 and not tree.root.children


def test_eviction_frees_exactly_what_is_asked_oldest_leaf_first() -> None:
    tree, pool = cache(num_blocks=16)
    seqs = [[i * 100 + t for t in range(n * BS)] for i, n in enumerate((2, 3, 2))]
    for s in seqs:  # inserted in this order, never matched since
        blocks = blocks_for(pool, s)
        tree.insert(s, blocks)
        release(pool, blocks)
    assert tree.evict(3) == 3 and pool.num_free == 16 - 7 + 3
    assert tree.match(seqs[0]) == []  # the oldest went whole, then one block of the next
    assert len(tree.match(seqs[1])) == 2 and len(tree.match(seqs[2])) == 2


def test_eviction_takes_leaves_never_a_shared_inner_block() -> None:
    tree, pool = cache(num_blocks=16)
    a = list(range(8))
    b = a[:4] + [50] * 4
    held = [blocks_for(pool, s) for s in (a, b)]
    for s, blocks in zip((a, b), held, strict=True):
        tree.insert(s, blocks)  # b's insert splits a's edge: the shared block is as recent as b's tail
        release(pool, blocks)
    assert tree.evict(1) == 1  # a's tail, the oldest
    assert tree.evict(1) == 1  # b's tail: the shared block is not a leaf until then
    assert tree.match(a) == tree.match(b) == held[0][:1]
    assert tree.evict(2) == 1 and tree.num_blocks == 0 and pool.num_free == 16


def test_a_parent_left_a_leaf_is_the_next_candidate_in_the_same_call() -> None:
    tree, pool = cache(num_blocks=16)
    a = list(range(12))
    b = a[:8] + [50] * 4  # shares a's first two blocks: they become the parent of both tails
    c = [60 + t for t in range(8)]  # used after both
    held = [blocks_for(pool, s) for s in (a, b, c)]
    for s, blocks in zip((a, b, c), held, strict=True):
        tree.insert(s, blocks)
        release(pool, blocks)
    pool.ref(held[0][0])  # a live request uses the shared first block
    # a's tail, b's tail, then the parent's unpinned block (as recent as b's tail, older than c), one block of c
    assert tree.evict(4) == 4
    assert tree.match(a) == tree.match(b) == held[0][:1]
    assert tree.match(c) == held[2][:1]
    assert tree.num_blocks == 2 and pool.refs(held[0][0]) == 2
