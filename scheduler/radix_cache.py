"""Radix prefix cache: a tree keyed by token ids whose values are the KV slots of those tokens.

Requests that share a prefix (a system prompt, earlier turns of a chat) reuse its KV slots
instead of computing them again. Slots in the tree belong to the tree: `evict` returns them to
the allocator, least recently used leaves first, skipping every node a running request has
locked with `inc_lock_ref`. The candidates wait in an LRUQueue kept between evictions, so a
pool full of cached prefixes costs an eviction O(1) per leaf, not a pass over every leaf.

With `page_size` > 1 everything happens in whole pages: every node's key is a multiple of
`page_size` tokens long, and children are keyed by the tuple of their first page's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.scheduler.lru_queue import LRUQueue
from radixserve.scheduler.memory_pool import TokenSlotAllocator

# The first token of a child's key (page_size 1), or its first page as a tuple.
ChildKey = int | tuple[int, ...]


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor  # int64 KV slots, one per token of key
    parent: TreeNode | None
    children: dict[ChildKey, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0


@dataclass(slots=True)
class MatchResult:
    slots: torch.Tensor  # int64 [n], n a multiple of page_size
    last_node: TreeNode  # the node ending exactly at n tokens (the root when n == 0)


@dataclass(slots=True)
class InsertResult:
    num_cached: int  # leading tokens that were in the tree already
    last_node: TreeNode  # the node ending exactly at the inserted length (whole pages)


def common_prefix_len(a: list[int], b: list[int], page_size: int) -> int:
    """How many leading tokens a and b share, rounded down to whole pages.

    Compares list slices (a C loop) and bisects on the first mismatching page, so a key of n
    tokens costs O(n) C comparisons and O(log n) Python steps instead of n Python steps.
    """
    n = min(len(a), len(b)) // page_size * page_size
    if a[:n] == b[:n]:
        return n
    # Pages [0, lo) match; the first mismatching page is in [lo, hi).
    lo, hi = 0, n // page_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start, stop = lo * page_size, mid * page_size
        if a[start:stop] == b[start:stop]:
            lo = mid
        else:
            hi = mid
    return lo * page_size


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size
        self._clock = 0
        self._clear()

    def _clear(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None)
        self._evictable_size = 0
        self._protected_size = 0
        # Unlocked childless nodes, at their last access: exactly what evict may free now, kept
        # current so that evict never walks the whole tree.
        self._evictable_leaves: LRUQueue[TreeNode] = LRUQueue()

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached prefix of token_ids, in whole pages and at most len - 1 tokens:
        the forward needs at least one token to compute, whose logits it samples from.

        Splits a node the match ends inside, so last_node ends exactly at the match, and marks
        the path used. Lock last_node before using the slots: until then evict may free them.
        """
        limit = (len(token_ids) - 1) // self.page_size * self.page_size
        key = token_ids[:limit]
        now = self._tick()
        node, pos, values = self.root, 0, []
        while pos < limit:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            self._touch(child, now)
            n = common_prefix_len(child.key, key[pos : pos + len(child.key)], self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            pos += n
            node = child
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots=slots, last_node=node)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """How many tokens match_prefix would match, without its side effects: no node is split
        and no access time changes (for ordering a queue by its matches)."""
        limit = (len(token_ids) - 1) // self.page_size * self.page_size
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            end = min(pos + len(child.key), limit)
            n = common_prefix_len(child.key, token_ids[pos:end], self.page_size)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def prefix_slots(self, node: TreeNode) -> torch.Tensor:
        """The slots of every token from the root to the end of node."""
        values = []
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else torch.empty(0, dtype=torch.int64)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> InsertResult:
        """Cache token_ids[:n] -> slots[:n], n being len(token_ids) in whole pages. Returns how
        many leading tokens were already cached, and the node ending at n (to lock, with no
        second walk). Frees nothing itself:

          0                num_cached              n                  len(token_ids)
          ├─ already cached ─┼──────── new ────────┼── partial page ──┤
          │ caller's copies  │ tree owns a copy    │ caller's         │

        The caller frees what it allocated in [0, num_cached) (not a prefix it got from
        match_prefix: those slots are the tree's) and everything in [n, len).
        """
        n = len(token_ids) // self.page_size * self.page_size
        assert slots.numel() >= n, f"{slots.numel()} slots for {n} tokens"
        key = token_ids[:n]
        now = self._tick()
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                # Clone: the caller's slots are often a view of a req_to_token row that the
                # next request in that row overwrites.
                leaf = self._add_leaf(node, key[pos:], slots[pos:n].clone(), now)
                return InsertResult(pos, leaf)
            self._touch(child, now)
            m = common_prefix_len(child.key, key[pos : pos + len(child.key)], self.page_size)
            if m < len(child.key):
                child = self._split(child, m)
            pos += m
            node = child
        return InsertResult(pos, node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and every ancestor from eviction; pair with dec_lock_ref."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "dec_lock_ref without a matching inc_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable_leaf(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots, or every evictable one, least recently used leaves
        first. A parent whose last child goes becomes a leaf and a candidate itself.
        Returns how many slots went back to the allocator."""
        values = []
        freed = 0
        while freed < num_tokens:
            leaf = self._evictable_leaves.pop_oldest()
            if leaf is None:
                break
            values.append(leaf.value)
            freed += len(leaf.key)
            self._remove_leaf(leaf)  # queues its parent if that becomes an evictable leaf
        if values:
            self.allocator.free(torch.cat(values))
        return freed

    def reset(self) -> None:
        """Free every slot of the tree and empty it (flush_cache). Nothing may be locked."""
        assert self._protected_size == 0, "reset while a request holds a locked prefix"
        self.allocator.free(self.all_slots())
        self._clear()

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for invariant checks; walks the whole tree)."""
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values)

    def _tick(self) -> int:
        # A counter, not wall time: deterministic, and distinct for every operation.
        self._clock += 1
        return self._clock

    def _child_key(self, key: list[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int
    ) -> TreeNode:
        leaf = TreeNode(key, value, parent)
        leaf.last_access_time = now
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable_size += len(key)
        self._evictable_leaves.discard(parent)
        self._add_evictable_leaf(leaf)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> None:
        """Take an evicted leaf (popped from the queue already) out of the tree."""
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, 0)]
        self._evictable_size -= len(leaf.key)
        if not parent.children and parent.lock_ref == 0 and parent is not self.root:
            self._add_evictable_leaf(parent)

    def _add_evictable_leaf(self, node: TreeNode) -> None:
        self._evictable_leaves.add(node, node.last_access_time)

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access_time = now
        if node in self._evictable_leaves:  # queued at its old time: queue it at the new one
            self._add_evictable_leaf(node)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut node after its first n tokens; return the new upper part, which ends there.

        ┌──────────── node.key ────────────┐        ┌─ upper ─┐   ┌──── node ────┐
        │ key[:n]         │ key[n:]        │   ->   │ key[:n] │ → │ key[n:]      │
        └─────────────────┴────────────────┘        └─────────┘   └──────────────┘
        The upper part inherits lock_ref (every lock through node passes through it) and the
        access time; sizes and node's leaf status do not change.
        """
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:n], node.value[:n], parent)
        upper.lock_ref = node.lock_ref
        upper.last_access_time = node.last_access_time
        parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper
