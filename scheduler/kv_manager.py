"""KVManager: the truth about KV memory. Which rows and slots are free, which the radix tree holds,
which each running request owns. The scheduler decides policy; it never touches slots itself.

    row of a running request:  [ tree's slots : prefix_len | own slots : num_computed_tokens ]

Caching inserts tokens [0, num_computed) into the tree. Of the request's own slots, those the tree
already had (someone else computed the same tokens) are duplicates and are freed; the others now
belong to the tree. Without the radix cache, a request's slots go straight back to the allocator.
"""

from __future__ import annotations

import torch

from radixserve.scheduler.memory_pool import ReqToTokenPool, TokenSlotAllocator
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.req import Req


class KVManager:
    def __init__(
        self,
        max_total_tokens: int,
        max_running_requests: int,
        context_len: int,
        enable_radix_cache: bool,
        page_size: int,
    ):
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len)
        self.allocator = TokenSlotAllocator(max_total_tokens)
        self.tree_cache = RadixCache(self.allocator, page_size) if enable_radix_cache else None
        self.num_evicted_tokens = 0

    @property
    def available(self) -> int:
        """Slots an allocation can get: free ones, plus those eviction can take from the tree."""
        evictable = self.tree_cache.evictable_size if self.tree_cache else 0
        return self.allocator.num_free + evictable

    @property
    def used(self) -> int:
        """Slots held by running requests; the prefix cache's evictable part counts as free."""
        return self.max_total_tokens - self.available

    def alloc(self, n: int) -> torch.Tensor | None:
        if self.tree_cache is not None and self.allocator.num_free < n:
            self.num_evicted_tokens += self.tree_cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    # ---- a request's lifetime ------------------------------------------------------------------

    def attach_prefix(self, req: Req) -> torch.Tensor:
        """Start a waiting request from its longest cached prefix, locked in the tree; returns
        the prefix's KV slots (to write into its row once admitted)."""
        if self.tree_cache is None:
            return torch.empty(0, dtype=torch.int64)
        match = self.tree_cache.match_prefix(req.token_slice(0, req.num_tokens))
        self.tree_cache.inc_lock_ref(match.last_node)
        req.last_node, req.prefix_len = match.last_node, len(match.slots)
        req.num_computed_tokens = req.prefix_len
        return match.slots

    def detach_prefix(self, req: Req) -> None:
        """Undo attach_prefix for a request that was not admitted after all."""
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len, req.num_computed_tokens = None, 0, 0

    def assign_row(self, req: Req, prefix_slots: torch.Tensor) -> None:
        req.req_pool_idx = row = self.req_to_token_pool.alloc()
        self.req_to_token_pool.req_to_token[row, : req.prefix_len] = prefix_slots
        req.new_row = True

    def cache_unfinished(self, req: Req) -> None:
        """Insert a running request's computed tokens, and point its row at the tree's slots."""
        tree = self.tree_cache
        if tree is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        n = req.num_computed_tokens
        self._insert_and_free_duplicates(req, row, n)
        # match_prefix leaves one token uncomputed: give it one token more than is cached.
        match = tree.match_prefix(req.token_slice(0, n + 1))
        row[: len(match.slots)] = match.slots
        tree.inc_lock_ref(match.last_node)
        tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = match.last_node, len(match.slots)

    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, aborted or retracted): its computed tokens go
        to the prefix cache, or back to the allocator without one."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        n = req.num_computed_tokens
        kept = 0
        if self.tree_cache is not None:
            kept = self._insert_and_free_duplicates(req, row, n)
            self.tree_cache.dec_lock_ref(req.last_node)
        self.allocator.free(row[kept:n].clone())  # what the tree did not take
        self.req_to_token_pool.free(req.req_pool_idx, n)
        req.req_pool_idx, req.last_node, req.prefix_len, req.num_computed_tokens = None, None, 0, 0

    def _insert_and_free_duplicates(self, req: Req, row: torch.Tensor, n: int) -> int:
        """Insert tokens [0, n); returns how many the tree now holds (whole pages)."""
        slots = row[:n].clone()
        already = self.tree_cache.insert(req.token_slice(0, n), slots).num_cached
        self.allocator.free(slots[req.prefix_len : already])
        return n // self.page_size * self.page_size

    def flush(self) -> None:
        """Empty the prefix cache. Only when nothing runs: running requests lock it."""
        if self.tree_cache is not None:
            self.tree_cache.reset()
