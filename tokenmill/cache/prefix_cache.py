"""Radix tree over token ids whose nodes own KV blocks of the paged pool: shared prefixes are computed once.

Sharing is block-granular: an edge holds a whole number of blocks' tokens and the blocks that store them, and only
full blocks enter the tree, so a cached block is never written again. The tree holds one reference on each block
it owns (BlockPool ref counts); a request using a cached prefix holds another, so "pinned" is simply "referenced by
someone besides the tree". Unpinned leaves are evicted least recently used, only when the pool needs room.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tokenmill.cache.block_pool import BlockPool


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()  # the edge from the parent: len(blocks) * block_size token ids
    blocks: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # keyed by the child's first block
    last_access: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = Node()
        self._clock = itertools.count(1)
        self.num_blocks = 0  # blocks the tree owns

    def _key(self, tokens: tuple[int, ...] | list[int], at: int = 0) -> tuple[int, ...]:
        return tuple(tokens[at:at + self.block_size])

    def match(self, tokens: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of tokens (whole blocks only), marked as just used."""
        node, at, blocks = self.root, 0, []
        now = next(self._clock)
        # A key shorter than a block (the tokens' partial tail) matches no child: only full blocks are cached.
        while (child := node.children.get(self._key(tokens, at))) is not None:
            shared = self._shared_blocks(child, tokens, at)
            blocks += child.blocks[:shared]
            child.last_access = now
            if shared < len(child.blocks):
                break
            node, at = child, at + len(child.tokens)
        return blocks

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
        upper = Node(tokens=node.tokens[:cut], blocks=node.blocks[:num_blocks], parent=parent)
        parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[num_blocks:], upper
        upper.children[self._key(node.tokens)] = node
        return upper

    def insert(self, tokens: list[int], blocks: list[int]) -> None:
        """Cache the full blocks of a computed sequence: blocks[i] stores tokens[i*bs:(i+1)*bs].

        Parts already cached keep their blocks (the caller's copies stay the caller's); new parts take a tree
        reference on the caller's blocks.
        """
        usable = min(len(blocks), len(tokens) // self.block_size)
        tokens = tokens[: usable * self.block_size]
        node, at, index = self.root, 0, 0
        now = next(self._clock)
        while index < usable:
            child = node.children.get(self._key(tokens, at))
            if child is None:
                new = Node(tokens=tuple(tokens[at:]), blocks=list(blocks[index:usable]), parent=node, last_access=now)
                node.children[self._key(new.tokens)] = new
                for block in new.blocks:
                    self.pool.ref(block)
                self.num_blocks += len(new.blocks)
                return
            shared = self._shared_blocks(child, tokens, at)
            if shared < len(child.blocks):
                child = self._split(child, shared)
            child.last_access = now
            node, at, index = child, at + len(child.tokens), index + shared

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
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if tail := self._evictable_tail(node):
                heap.append((node.last_access, next(order), tail, node))
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, tail, leaf = heapq.heappop(heap)
            count = min(tail, num_blocks - freed)
            for block in leaf.blocks[len(leaf.blocks) - count:]:
                self.pool.free(block)
            keep = len(leaf.blocks) - count
            if keep == 0:
                parent = leaf.parent
                assert parent is not None  # the root holds no blocks: it is never a candidate
                del parent.children[self._key(leaf.tokens)]
                if tail := self._evictable_tail(parent):
                    heapq.heappush(heap, (parent.last_access, next(order), tail, parent))
            leaf.blocks, leaf.tokens = leaf.blocks[:keep], leaf.tokens[: keep * self.block_size]
            self.num_blocks -= count
            freed += count
        return freed

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
