"""Radix tree over token ids whose nodes own KV blocks of the paged pool: shared prefixes are computed once.

Sharing is block-granular: an edge holds a whole number of blocks' tokens and the blocks that store them, and only
full blocks enter the tree, so a cached block is never written again. The tree holds one reference on each block
it owns (BlockPool ref counts); a request using a cached prefix holds another, so "pinned" is simply "referenced by
someone besides the tree". Unpinned leaves are evicted least recently used, only when the pool needs room.

Sliding-window layers with a pool of their own (kv_cache.py): each node also holds, per block, the sliding layers'
block of the same tokens, or 0 (the null block, never allocated) where it has none: a sequence lets go of the
blocks its window has passed, and the tree's are evicted on their own when the sliding pool needs room. A prefix is
usable up to where the sliding blocks of the last `window` keys before it are all held.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenmill.cache.block_pool import BlockPool


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()  # the edge from the parent: len(blocks) * block_size token ids
    blocks: list[int] = field(default_factory=list)
    sliding: list[int] = field(default_factory=list)  # with a sliding pool: one a block, 0 where none is held
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # keyed by the child's first block
    last_access: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int, sliding_pool: BlockPool | None = None,
                 window: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_pool = sliding_pool
        self.window = window
        self.root = Node()
        self._clock = itertools.count(1)
        self.num_blocks = 0  # blocks the tree owns

    def _key(self, tokens: tuple[int, ...] | list[int], at: int = 0) -> tuple[int, ...]:
        return tuple(tokens[at:at + self.block_size])

    def match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Blocks holding the longest usable cached prefix of tokens (whole blocks only), marked as just used, and
        with a sliding pool the sliding blocks of its last window (0 before it; else [])."""
        node, at, blocks, sliding = self.root, 0, [], []
        now = next(self._clock)
        # A key shorter than a block (the tokens' partial tail) matches no child: only full blocks are cached.
        while (child := node.children.get(self._key(tokens, at))) is not None:
            shared = self._shared_blocks(child, tokens, at)
            blocks += child.blocks[:shared]
            sliding += child.sliding[:shared]
            child.last_access = now
            if shared < len(child.blocks):
                break
            node, at = child, at + len(child.tokens)
        if self.sliding_pool is None:
            return blocks, []
        usable = self._usable(sliding)
        first = self._first_in_window(usable)
        return blocks[:usable], [0] * first + sliding[first:usable]

    def _first_in_window(self, num_blocks: int) -> int:
        """The first block the token after num_blocks blocks sees through a sliding window."""
        return max(0, num_blocks * self.block_size - self.window + 1) // self.block_size

    def _usable(self, sliding: list[int]) -> int:
        """The most leading blocks whose window's sliding blocks are all held."""
        for usable in range(len(sliding), 0, -1):
            if all(sliding[self._first_in_window(usable):usable]):
                return usable
        return 0

    def _shared_blocks(self, node: Node, tokens: list[int], at: int) -> int:
        """How many of node's blocks tokens[at:] matches in full (a partial block of tokens matches none)."""
        bs = self.block_size
        for i in range(len(node.blocks)):
            if tuple(tokens[at + i * bs:at + (i + 1) * bs]) != node.tokens[i * bs:(i + 1) * bs]:
                return i
        return len(node.blocks)

    def _split(self, node: Node, num_blocks: int) -> Node:
        """Cut node's edge after num_blocks blocks; returns the new upper node (node becomes its child). The caller
        marks the upper node used: it is on the path being inserted."""
        cut = num_blocks * self.block_size
        parent = node.parent
        assert parent is not None  # the root holds no blocks: it is never split
        upper = Node(tokens=node.tokens[:cut], blocks=node.blocks[:num_blocks], sliding=node.sliding[:num_blocks],
                     parent=parent)
        parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[num_blocks:], upper
        node.sliding = node.sliding[num_blocks:]
        upper.children[self._key(node.tokens)] = node
        return upper

    def insert(self, tokens: list[int], blocks: list[int], sliding: list[int] | None = None) -> None:
        """Cache the full blocks of a computed sequence: blocks[i] stores tokens[i*bs:(i+1)*bs], and with a
        sliding pool sliding[i] their sliding layers' KV (0 where the sequence holds none).

        Parts already cached keep their blocks (the caller's copies stay the caller's), except that a sliding block
        the tree lacks is taken from the caller; new parts take a tree reference on the caller's blocks.
        """
        usable = min(len(blocks), len(tokens) // self.block_size)
        tokens = tokens[: usable * self.block_size]
        sliding = sliding or []
        node, at, index = self.root, 0, 0
        now = next(self._clock)
        while index < usable:
            child = node.children.get(self._key(tokens, at))
            if child is None:
                new = Node(tokens=tuple(tokens[at:]), blocks=list(blocks[index:usable]),
                           sliding=[0] * (usable - index) if sliding else [], parent=node, last_access=now)
                node.children[self._key(new.tokens)] = new
                for block in new.blocks:
                    self.pool.ref(block)
                self.num_blocks += len(new.blocks)
                self._adopt_sliding(new, sliding[index:usable])
                return
            shared = self._shared_blocks(child, tokens, at)
            if shared < len(child.blocks):
                child = self._split(child, shared)
            child.last_access = now
            self._adopt_sliding(child, sliding[index:index + shared])
            node, at, index = child, at + len(child.tokens), index + shared

    def _adopt_sliding(self, node: Node, theirs: list[int]) -> None:
        """Take a reference on each of the caller's sliding blocks where node holds none."""
        assert self.sliding_pool is not None or not theirs
        for i, block in enumerate(theirs):
            if block and not node.sliding[i]:
                self.sliding_pool.ref(block)  # type: ignore[union-attr]
                node.sliding[i] = block

    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks blocks from the unpinned tails of leaves, least recently used first.

        A request pins a prefix of a path, so a leaf's unpinned blocks are a suffix of its edge: trimming the tail
        keeps the edge a valid (shorter) prefix. Returns how many blocks were freed.
        """
        # One walk fills a heap of the candidates; nothing but this loop changes the tree meanwhile. A leaf it trims
        # in part either ends the call or keeps only pinned blocks, and the only new candidate it can make is the
        # parent of a leaf it removes whole: pushed then, the heap stays exactly the set of candidates.
        heap: list[tuple[int, int, int, Node]] = []
        order = itertools.count()  # breaks ties in last_access so that Nodes are never compared
        for node in self.nodes():
            if tail := self._evictable_tail(node):
                heap.append((node.last_access, next(order), tail, node))
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, tail, leaf = heapq.heappop(heap)
            count = min(tail, num_blocks - freed)
            keep = len(leaf.blocks) - count
            for block in leaf.blocks[keep:]:
                self.pool.free(block)
            # A sequence holding one of these sliding blocks would hold the full block too: only the tree holds them.
            self._free_sliding(leaf, range(keep, len(leaf.sliding)))
            if keep == 0:
                parent = leaf.parent
                assert parent is not None  # the root holds no blocks: it is never a candidate
                del parent.children[self._key(leaf.tokens)]
                if tail := self._evictable_tail(parent):
                    heapq.heappush(heap, (parent.last_access, next(order), tail, parent))
            leaf.blocks, leaf.tokens = leaf.blocks[:keep], leaf.tokens[: keep * self.block_size]
            leaf.sliding = leaf.sliding[:keep]
            self.num_blocks -= count
            freed += count
        return freed

    def evict_sliding(self, num_blocks: int) -> int:
        """Free up to num_blocks sliding blocks only the tree holds, the least recently used nodes' first, each
        node's from its start (a hit ending at or after the node's end needs its last ones); returns how many."""
        assert self.sliding_pool is not None
        pool = self.sliding_pool
        freed = 0
        for node in sorted(self.nodes(), key=lambda n: n.last_access):
            held = [i for i, block in enumerate(node.sliding) if block and pool.refs(block) == 1]
            chosen = held[:num_blocks - freed]
            self._free_sliding(node, chosen)
            freed += len(chosen)
            if freed == num_blocks:
                break
        return freed

    def nodes(self) -> Iterator[Node]:
        """Every node, the root included (depth first)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _free_sliding(self, node: Node, indices: range | list[int]) -> None:
        for i in indices:
            if node.sliding[i]:
                self.sliding_pool.free(node.sliding[i])  # type: ignore[union-attr]
                node.sliding[i] = 0

    def _evictable_tail(self, node: Node) -> int:
        """How many blocks at the end of a leaf's edge only the tree holds; 0 for an inner node, and for the root,
        which holds no blocks."""
        if node.children:
            return 0
        count = 0
        for block in reversed(node.blocks):
            if self.pool.refs(block) != 1:
                break
            count += 1
        return count
