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
    assert tree.match(a)[0] == blocks[:3]
    assert tree.match(a[:11])[0] == blocks[:2]  # ends inside the third block
    assert tree.match(a[:8] + [0, 0, 0, 0])[0] == blocks[:2]  # diverges in the third block
    assert tree.match([1, 2, 3, 4, 5])[0] == []
    assert tree.match(a[:3])[0] == []


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
    assert tree.match(b)[0] == blocks_a[:1] + blocks_b[1:]  # the shared first block is a's, cached once
    assert tree.match(a)[0] == blocks_a
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
    reused = tree.match(a)[0]
    for b in reused:  # a new request takes references on the hit
        pool.ref(b)
    assert tree.evict(8) == 0  # pinned: nothing can go
    for b in reused:
        pool.free(b)
    assert tree.evict(8) == 2 and pool.num_free == 8 and tree.num_blocks == 0
    assert tree.match(a)[0] == []


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
    pinned = tree.match(seqs[2])[0][:1]
    pool.ref(pinned[0])  # a live request uses seq 2's first block
    assert tree.evict(2) == 2
    assert tree.match(seqs[1])[0] == []  # least recently used went first
    assert tree.evict(3) == 3  # seq 0's two blocks and seq 2's tail: never the pinned block
    assert tree.match(seqs[2])[0] == pinned and tree.match(seqs[0])[0] == []
    assert pool.refs(pinned[0]) == 2


def test_insert_of_a_known_prefix_changes_nothing() -> None:
    tree, pool = cache()
    a = list(range(16))
    blocks = blocks_for(pool, a)
    tree.insert(a, blocks)
    other = blocks_for(pool, a)
    tree.insert(a[:8], other)
    assert tree.match(a)[0] == blocks and all(pool.refs(b) == 1 for b in other)


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
        assert tree.match(a)[0] == blocks
        assert tree.match(a[:-1])[0] == blocks[:-1]


def test_a_three_way_split_keeps_every_branch() -> None:
    tree, pool = cache()
    a = list(range(16))
    b = a[:4] + [50] * 12  # leaves a after one block
    c = a[:12] + [60] * 4  # leaves a after three blocks, below the first split
    held = [blocks_for(pool, s) for s in (a, b, c)]
    for s, blocks in zip((a, b, c), held, strict=True):
        tree.insert(s, blocks)
    assert tree.match(a)[0] == held[0]
    assert tree.match(b)[0] == held[0][:1] + held[1][1:]
    assert tree.match(c)[0] == held[0][:3] + held[2][3:]
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
    assert tree.match(seqs[0])[0] == []  # the oldest went whole, then one block of the next
    assert len(tree.match(seqs[1])[0]) == 2 and len(tree.match(seqs[2])[0]) == 2


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
    assert tree.match(a)[0] == tree.match(b)[0] == held[0][:1]
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
    assert tree.match(a)[0] == tree.match(b)[0] == held[0][:1]
    assert tree.match(c)[0] == held[2][:1]
    assert tree.num_blocks == 2 and pool.refs(held[0][0]) == 2


def sliding_cache(window: int) -> tuple[RadixCache, BlockPool, BlockPool]:
    """A tree over a pool and a sliding layers' pool, of 32 blocks each (block 0 is the null block, as in the KV
    cache: a sliding table's 0 is no block)."""
    pool, sliding = BlockPool(32), BlockPool(32, first_block=1)
    return RadixCache(pool, BS, sliding, window), pool, sliding


def passed(sliding: BlockPool, blocks: list[int], count: int) -> list[int]:
    """A sequence's sliding table once its window has passed its first `count` blocks: freed, 0 in the table."""
    release(sliding, blocks[:count])
    return [0] * count + blocks[count:]


def test_a_prefix_is_usable_as_far_as_the_sliding_blocks_of_its_window_are_held() -> None:
    """Window 6, blocks of 4: the token after j blocks sees the keys from 4j - 5 on, so the blocks from
    (4j - 5) // 4 on must be held; a hit returns 0 for the sliding blocks before its window."""
    tree, pool, sliding = sliding_cache(window=6)
    a = list(range(100, 120))  # 5 blocks
    blocks, table = pool.allocate(5), passed(sliding, sliding.allocate(5), 2)
    tree.insert(a, blocks, table)
    assert tree.match(a) == (blocks, [0, 0, 0, table[3], table[4]])  # blocks 3 and 4: the window after 5 blocks
    assert tree.match(a[:16]) == (blocks[:4], [0, 0, table[2], table[3]])  # after 4: (16 - 5) // 4 = 2 on
    # After 3 blocks the window reaches back into block 1, which is gone; after 1 or 2, into block 0: no hit.
    assert tree.match(a[:12] + [7] * 8) == ([], [])
    # Another sequence with the same first 3 blocks gives the tree the sliding blocks it lacks.
    other, others = pool.allocate(5), sliding.allocate(5)
    tree.insert(a[:12] + [7] * 8, other, others)
    assert tree.match(a[:12] + [7] * 4) == (blocks[:3] + other[3:4], [0, 0, table[2], others[3]])
    assert tree.match(a[:12] + [7] * 8) == (blocks[:3] + other[3:5], [0, 0, 0, others[3], others[4]])
    assert tree.match(a[:8] + [9] * 8) == (blocks[:2], [others[0], others[1]])
    assert [sliding.refs(b) for b in others] == [2, 2, 1, 2, 2]  # its block 2 is not taken: the tree has one
    assert sliding.refs(table[2]) == 2


def test_evicting_frees_the_sliding_blocks_of_evicted_blocks_and_sliding_blocks_alone() -> None:
    tree, pool, sliding = sliding_cache(window=6)
    a, b = list(range(100, 116)), list(range(200, 216))  # 4 blocks each; a used first
    held = [(pool.allocate(4), sliding.allocate(4)) for _ in range(2)]
    for tokens, (blocks, table) in zip((a, b), held, strict=True):
        tree.insert(tokens, blocks, table)
        release(pool, blocks)
        release(sliding, table)
    sliding.ref(held[1][1][0])  # a live sequence holds b's first sliding block (and so its first block)
    pool.ref(held[1][0][0])
    # Sliding blocks alone: a's (the least recently used) from its start, then b's unpinned ones.
    assert tree.evict_sliding(5) == 5
    b_blocks, b_sliding = held[1]
    assert tree.match(a) == ([], [])
    assert tree.match(b) == (b_blocks, [0, 0, b_sliding[2], b_sliding[3]])  # the window after 4 blocks: 2 on
    assert tree.match(b[:8] + [0] * 8) == (b_blocks[:1], b_sliding[:1])  # after 2, block 1 is gone
    assert tree.num_blocks == 8 and sliding.num_free == 32 - 3
    assert tree.evict(8) == 7  # the full blocks take their sliding blocks along, but the ones a sequence holds
    assert pool.num_free == 31 and sliding.num_free == 31 and sliding.refs(b_sliding[0]) == 2
