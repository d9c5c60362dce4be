"""Radix cache: unit tests, plus random insert / match / lock / unlock / evict sequences checked
against a naive reference (a dict from every cached page-aligned prefix to its slots) with the
real slot allocator, for page sizes 1 and 16."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.scheduler.memory_pool import TokenSlotAllocator
from radixserve.scheduler.radix_cache import RadixCache, TreeNode, common_prefix_len

Prefix = tuple[int, ...]


def path_of(node: TreeNode) -> list[int]:
    """The tokens from the root to the end of node."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for key in reversed(parts) for t in key]


def nodes_by_path(cache: RadixCache) -> dict[tuple[int, ...], TreeNode]:
    """Every node but the root, by the tokens from the root to its end."""
    nodes, stack = {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + tuple(child.key)
            nodes[child_path] = child
            stack.append((child, child_path))
    return nodes


def alloc(allocator: TokenSlotAllocator, n: int) -> torch.Tensor:
    slots = allocator.alloc(n)
    assert slots is not None
    return slots


def test_common_prefix_len_is_page_aligned() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 3], 1) == 3
    assert common_prefix_len([1, 2, 3], [1, 2], 1) == 2
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3, 5], 2) == 2
    assert common_prefix_len([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], 2) == 4
    assert common_prefix_len([7], [8], 1) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 1), max_size=40),
    st.lists(st.integers(0, 1), max_size=40),
    st.sampled_from([1, 2, 4, 16]),
)
def test_common_prefix_len_matches_a_token_loop(a: list[int], b: list[int], page: int) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(a, b, page) == n // page * page


def test_match_splits_a_node_on_partial_match() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    slots = alloc(cache.allocator, 5)
    assert cache.insert([1, 2, 3, 4, 5], slots).num_cached == 0
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == slots[:3].tolist()
    assert m.last_node.key == [1, 2, 3]
    assert [c.key for c in m.last_node.children.values()] == [[4, 5]]
    assert cache.total_size == 5
    # The split is invisible to later lookups.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()


def test_one_token_is_always_left_to_compute() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    slots = alloc(cache.allocator, 3)
    cache.insert([1, 2, 3], slots)
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == slots[:2].tolist()
    m = cache.match_prefix([1])
    assert m.slots.numel() == 0 and m.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root


def test_insert_reports_duplicates_and_copies_the_slots() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    first = alloc(cache.allocator, 3)
    assert cache.insert([1, 2, 3], first).num_cached == 0
    second = alloc(cache.allocator, 5)
    assert cache.insert([1, 2, 3, 4, 5], second).num_cached == 3
    cache.allocator.free(second[:3])
    second[3:] = 0  # the caller may reuse its buffer: the tree kept a copy
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist()[3:] != [0, 0]
    assert cache.total_size == 5


def test_eviction_is_least_recently_used_first() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    seqs = [[1, 1], [2, 2], [3, 3]]
    owned = {}
    for seq in seqs:
        owned[seq[0]] = alloc(cache.allocator, 2)
        cache.insert(seq, owned[seq[0]])
    cache.match_prefix([1, 1, 0])  # touch [1, 1]: [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2, 0]).slots.numel() == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3, 0]).slots.numel() == 0
    assert cache.match_prefix([1, 1, 0]).slots.tolist() == owned[1].tolist()


def test_a_parent_whose_last_child_goes_is_evicted_too() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    cache.insert([1, 2], alloc(cache.allocator, 2))
    slots = alloc(cache.allocator, 4)
    assert cache.insert([1, 2, 3, 4], slots).num_cached == 2
    cache.allocator.free(slots[:2])
    assert cache.evict(4) == 4
    assert cache.total_size == 0 and cache.allocator.num_free == 16


def test_locked_nodes_are_never_evicted() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    a, b = alloc(cache.allocator, 4), alloc(cache.allocator, 3)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([5, 6, 7], b)
    m = cache.match_prefix([1, 2, 3, 9])
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size, cache.evictable_size) == (3, 4)
    assert cache.evict(100) == 4  # [4] and [5, 6, 7]; [1, 2, 3] is locked
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == a[:3].tolist()
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size, cache.evictable_size) == (0, 3)
    assert cache.evict(100) == 3
    assert cache.allocator.num_free == 16


def test_reset_frees_every_slot() -> None:
    cache = RadixCache(TokenSlotAllocator(16))
    cache.insert([1, 2, 3], alloc(cache.allocator, 3))
    slots = alloc(cache.allocator, 2)
    assert cache.insert([1, 5], slots).num_cached == 1
    cache.allocator.free(slots[:1])
    cache.reset()
    assert cache.total_size == 0 and cache.all_slots().numel() == 0
    assert torch.equal(cache.allocator.free_slots().sort().values, torch.arange(1, 17))
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0


def test_page_size_16_never_returns_a_partial_page() -> None:
    cache = RadixCache(TokenSlotAllocator(128), page_size=16)
    seq = list(range(40))
    slots = alloc(cache.allocator, 40)
    assert cache.insert(seq, slots).num_cached == 0
    assert cache.total_size == 32  # the last 8 tokens are not a whole page
    cache.allocator.free(slots[32:])
    assert cache.match_prefix(seq).slots.tolist() == slots[:32].tolist()
    assert cache.match_prefix(seq[:33]).slots.numel() == 32
    assert cache.match_prefix(seq[:32]).slots.numel() == 16  # one token is left to compute
    m = cache.match_prefix(seq[:20] + [99] * 20)  # diverges inside the second page
    assert m.slots.tolist() == slots[:16].tolist() and m.last_node.key == seq[:16]
    assert all(len(c.key) % 16 == 0 for c in m.last_node.children.values())
    assert cache.evict(1) == 16


@dataclass
class Request:
    """A running request: slots[:prefix_len] came from the tree (locked at node), the rest are
    its own."""

    seq: list[int]
    prefix_len: int
    slots: torch.Tensor
    node: TreeNode


def radix_machine(page_size: int, num_slots: int, max_pages: int) -> type[RuleBasedStateMachine]:
    # Sequences are built from a few whole pages so that prefixes collide and nodes split; with
    # page_size 16 two of the pages share their first half, which must never count as a match.
    if page_size == 1:
        pages = [[0], [1], [2], [3]]
    else:
        half = page_size // 2
        pages = [[0] * page_size, [0] * half + [1] * half, [1, 2, 3, 0] * (page_size // 4)]
    seqs = st.builds(
        lambda ps, tail: [t for p in ps for t in p] + tail,
        st.lists(st.sampled_from(pages), max_size=max_pages),
        st.lists(st.integers(0, 3), max_size=page_size + 1),
    ).filter(bool)

    class RadixMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.allocator = TokenSlotAllocator(num_slots)
            self.cache = RadixCache(self.allocator, page_size)
            self.ref: dict[Prefix, Prefix] = {}
            self.requests: list[Request] = []

        def longest_cached(self, seq: list[int], limit: int) -> int:
            n = limit // page_size * page_size
            while n and tuple(seq[:n]) not in self.ref:
                n -= page_size
            return n

        def check_match(self, seq: list[int], slots: torch.Tensor, node: TreeNode) -> None:
            n = self.longest_cached(seq, len(seq) - 1)
            assert slots.numel() == n
            assert path_of(node) == seq[:n]
            if n:
                assert tuple(slots.tolist()) == self.ref[tuple(seq[:n])]

        def alloc_or_evict(self, n: int) -> torch.Tensor | None:
            if self.allocator.num_free < n:
                self.evict_and_check(n - self.allocator.num_free)
            return self.allocator.alloc(n)

        def insert_and_check(self, seq: list[int], slots: torch.Tensor) -> int:
            n = len(seq) // page_size * page_size
            cached = self.longest_cached(seq, len(seq))
            result = self.cache.insert(seq, slots)
            assert result.num_cached == cached
            assert path_of(result.last_node) == seq[:n]  # what a request caching seq locks
            # The cached part keeps the tree's slots; only the new part takes the caller's.
            head = self.ref[tuple(seq[:cached])] if cached else ()
            for end in range(cached + page_size, n + 1, page_size):
                self.ref[tuple(seq[:end])] = head + tuple(slots[cached:end].tolist())
            return cached

        def evict_and_check(self, k: int) -> None:
            before = set(self.allocator.free_slots().tolist())
            access_times = {p: n.last_access_time for p, n in nodes_by_path(self.cache).items()}
            freed = self.cache.evict(k)
            # Least recently used first: nothing evicted was used after a leaf that stays evictable.
            remaining = nodes_by_path(self.cache)
            evicted = [t for p, t in access_times.items() if p not in remaining]
            kept = [
                n.last_access_time for n in remaining.values() if not n.children and n.lock_ref == 0
            ]
            if evicted and kept:
                assert max(evicted) <= min(kept)
            newly = set(self.allocator.free_slots().tolist()) - before
            assert freed == len(newly)
            assert freed >= k or self.cache.evictable_size == 0
            # Eviction frees whole nodes, so a prefix is gone exactly when its last page is.
            gone = [p for p, s in self.ref.items() if s[-1] in newly]
            assert {t for p in gone for t in self.ref[p][-page_size:]} == newly
            for p in gone:
                del self.ref[p]

        @rule(seq=seqs)
        def start_request(self, seq: list[int]) -> None:
            m = self.cache.match_prefix(seq)
            self.check_match(seq, m.slots, m.last_node)
            self.cache.inc_lock_ref(m.last_node)
            own = self.alloc_or_evict(len(seq) - m.slots.numel())
            if own is None:
                self.cache.dec_lock_ref(m.last_node)
                return
            slots = torch.cat([m.slots, own])
            self.requests.append(Request(seq, m.slots.numel(), slots, m.last_node))

        @precondition(lambda self: self.requests)
        @rule(data=st.data())
        def finish_request(self, data: st.DataObject) -> None:
            i = data.draw(st.integers(0, len(self.requests) - 1))
            req = self.requests.pop(i)
            cached = self.insert_and_check(req.seq, req.slots)
            assert cached >= req.prefix_len  # the locked prefix is still there
            n = len(req.seq) // page_size * page_size
            self.allocator.free(req.slots[req.prefix_len : cached])
            self.allocator.free(req.slots[n:])
            self.cache.dec_lock_ref(req.node)

        @rule(seq=seqs)
        def insert_without_prefix(self, seq: list[int]) -> None:
            slots = self.alloc_or_evict(len(seq))
            if slots is None:
                return
            cached = self.insert_and_check(seq, slots)
            self.allocator.free(slots[:cached])
            self.allocator.free(slots[len(seq) // page_size * page_size :])

        @rule(seq=seqs)
        def match(self, seq: list[int]) -> None:
            m = self.cache.match_prefix(seq)
            self.check_match(seq, m.slots, m.last_node)

        @rule(seq=seqs)
        def peek(self, seq: list[int]) -> None:
            before = {p: n.last_access_time for p, n in nodes_by_path(self.cache).items()}
            assert self.cache.cached_prefix_len(seq) == self.longest_cached(seq, len(seq) - 1)
            after = {p: n.last_access_time for p, n in nodes_by_path(self.cache).items()}
            assert after == before, "measuring a match split a node or touched one"

        @rule(k=st.integers(0, num_slots // 2))
        def evict(self, k: int) -> None:
            self.evict_and_check(k)

        @invariant()
        def tree_matches_the_reference(self) -> None:
            seen: dict[Prefix, Prefix] = {}
            lock_refs: dict[Prefix, int] = {}
            stack: list[tuple[TreeNode, Prefix, Prefix]] = [(self.cache.root, (), ())]
            while stack:
                node, path, slots = stack.pop()
                for key, child in node.children.items():
                    assert child.parent is node and child.key and len(child.key) % page_size == 0
                    assert key == (child.key[0] if page_size == 1 else tuple(child.key[:page_size]))
                    assert child.value.numel() == len(child.key)
                    values = child.value.tolist()
                    for end in range(page_size, len(child.key) + 1, page_size):
                        seen[path + tuple(child.key[:end])] = slots + tuple(values[:end])
                    child_path = path + tuple(child.key)
                    lock_refs[child_path] = child.lock_ref
                    stack.append((child, child_path, slots + tuple(values)))
            assert seen == self.ref

            locked: set[Prefix] = set()
            for r in self.requests:
                assert path_of(r.node) == r.seq[: r.prefix_len]
                if r.prefix_len:
                    assert lock_refs[tuple(r.seq[: r.prefix_len])] > 0
                    assert seen[tuple(r.seq[: r.prefix_len])] == tuple(
                        r.slots[: r.prefix_len].tolist()
                    )
                locked.update(
                    tuple(r.seq[:end]) for end in range(page_size, r.prefix_len + 1, page_size)
                )
            for path, lock_ref in lock_refs.items():
                assert lock_ref == sum(
                    len(path) <= r.prefix_len and tuple(r.seq[: len(path)]) == path
                    for r in self.requests
                )
            assert self.cache.protected_size == page_size * len(locked)
            assert self.cache.total_size == page_size * len(self.ref)
            assert self.cache.evictable_size + self.cache.protected_size == self.cache.total_size

        @invariant()
        def every_slot_is_free_cached_or_held(self) -> None:
            held = [r.slots[r.prefix_len :] for r in self.requests]
            every = torch.cat([self.allocator.free_slots(), self.cache.all_slots(), *held])
            assert torch.equal(every.sort().values, torch.arange(1, num_slots + 1))

        def teardown(self) -> None:
            for r in self.requests:
                self.cache.dec_lock_ref(r.node)
                self.allocator.free(r.slots[r.prefix_len :])
            self.cache.reset()
            assert self.allocator.num_free == num_slots

    return RadixMachine


STATEFUL = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRadixPage1 = radix_machine(page_size=1, num_slots=40, max_pages=8).TestCase
TestRadixPage1.settings = STATEFUL
TestRadixPage16 = radix_machine(page_size=16, num_slots=320, max_pages=4).TestCase
TestRadixPage16.settings = STATEFUL


@pytest.mark.parametrize("page_size", [1, 16])
def test_reset_requires_nothing_locked(page_size: int) -> None:
    cache = RadixCache(TokenSlotAllocator(64), page_size)
    cache.insert(list(range(33)), alloc(cache.allocator, 33))
    m = cache.match_prefix(list(range(33)))
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(AssertionError):
        cache.reset()
