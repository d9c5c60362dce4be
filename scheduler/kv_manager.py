"""KVManager: the truth about KV memory. Which rows and slots are free, which the prefix cache
holds, which each running request owns. The scheduler decides policy; it never touches slots.

A running request holds a KVHandle (kv_handle.py, with its contract), which only KVManager makes:

    row of a running request:  [ the cache's slots : kv.cached_len | own slots : num_computed ]

Caching inserts tokens [0, num_computed) into the tree. Of the request's own slots, those the tree
already had (someone else computed the same tokens) are duplicates and are freed; the others now
belong to the tree. Without the radix cache, a request's slots go straight back to the allocator.
"""

from __future__ import annotations

import torch

from radixserve.scheduler.kv_handle import KVHandle
from radixserve.scheduler.memory_pool import ReqToTokenPool, TokenSlotAllocator
from radixserve.scheduler.radix_cache import InsertResult, RadixCache, TreeNode
from radixserve.scheduler.req import Req


class InvariantError(AssertionError):
    pass


def require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)


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
        # Per row, the tree node that ends its holder's cached prefix, locked while it runs.
        self._locked: list[TreeNode | None] = [None] * max_running_requests
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

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token_pool.num_free

    def cached_prefix_len(self, req: Req) -> int:
        """What `admit` would find cached, changing nothing (for lpm's ordering)."""
        if self.tree_cache is None or req.needs_prompt_logprobs:
            return 0
        return self.tree_cache.cached_prefix_len(req.token_slice(0, req.num_tokens))

    def alloc_extend(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots for a step's new tokens, written into their requests' rows: token i lands at
        position positions[i] of row token_rows[i]. Evicts cached prefixes when it must; the
        planner made sure enough are available."""
        n = positions.numel()
        if self.tree_cache is not None and self.allocator.num_free < n:
            self.num_evicted_tokens += self.tree_cache.evict(n - self.allocator.num_free)
        slots = self.allocator.alloc(n)
        assert slots is not None, "planning left too few free KV slots"
        self.req_to_token_pool.req_to_token[token_rows, positions] = slots
        return slots

    # ---- a request's hold ------------------------------------------------------------------------

    def admit(self, req: Req) -> None:
        """Give a waiting request a row, starting from its longest cached prefix, locked."""
        row = self.req_to_token_pool.alloc()
        cached = 0
        if self.tree_cache is not None:
            # A request that needs its prompt's logprobs matches nothing: it computes it all.
            tokens = [] if req.needs_prompt_logprobs else req.token_slice(0, req.num_tokens)
            match = self.tree_cache.match_prefix(tokens)
            self.tree_cache.inc_lock_ref(match.last_node)
            self._locked[row] = match.last_node
            cached = match.slots.numel()
            self.req_to_token_pool.req_to_token[row, :cached] = match.slots
        req.kv = KVHandle(row, cached)

    def cache_unfinished(self, req: Req) -> None:
        """Insert a running request's computed tokens, and point its row at the tree's slots."""
        tree, hold = self.tree_cache, req.kv
        if tree is None:
            return
        assert hold is not None
        row = self.req_to_token_pool.req_to_token[hold.row]
        result = self._insert_and_free_duplicates(tree, req, row)
        if result.num_cached > hold.cached_len:  # the duplicates' places take the tree's slots
            tree_slots = tree.prefix_slots(result.last_node)
            row[hold.cached_len : result.num_cached] = tree_slots[
                hold.cached_len : result.num_cached
            ]
        tree.inc_lock_ref(result.last_node)
        self._unlock(tree, hold.row)
        self._locked[hold.row] = result.last_node
        cached = req.num_computed_tokens // self.page_size * self.page_size
        req.kv = KVHandle(hold.row, cached)

    def drop_tail(self, req: Req, keep: int) -> None:
        """Free a running request's slots past its first `keep` computed tokens: the KV of
        speculative drafts the target rejected. Only its own slots: keep is past its cached
        part."""
        hold = req.kv
        assert hold is not None and hold.cached_len <= keep <= req.num_computed_tokens
        row = self.req_to_token_pool.req_to_token[hold.row]
        self.allocator.free(row[keep : req.num_computed_tokens].clone())
        row[keep : req.num_computed_tokens] = 0
        req.num_computed_tokens = keep

    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, aborted, retracted, or not admitted after
        all): its computed tokens go to the prefix cache, or back to the allocator without one."""
        hold = req.kv
        if hold is None:
            return
        row = self.req_to_token_pool.req_to_token[hold.row]
        n = req.num_computed_tokens
        kept = 0  # leading slots that now belong to the tree
        if self.tree_cache is not None:
            kept = hold.cached_len
            if n > hold.cached_len:
                self._insert_and_free_duplicates(self.tree_cache, req, row)
                kept = n // self.page_size * self.page_size
            self._unlock(self.tree_cache, hold.row)
        self.allocator.free(row[kept:n].clone())  # what the tree did not take
        self.req_to_token_pool.free(hold.row, n)
        req.kv = None

    def flush(self) -> None:
        """Empty the prefix cache. Only when nothing runs: running requests lock it."""
        if self.tree_cache is not None:
            self.tree_cache.reset()

    def _insert_and_free_duplicates(
        self, tree: RadixCache, req: Req, row: torch.Tensor
    ) -> InsertResult:
        assert req.kv is not None
        n = req.num_computed_tokens
        result = tree.insert(req.token_slice(0, n), row[:n])
        self.allocator.free(row[req.kv.cached_len : result.num_cached].clone())
        return result

    def _unlock(self, tree: RadixCache, row: int) -> None:
        node = self._locked[row]
        assert node is not None
        tree.dec_lock_ref(node)
        self._locked[row] = None

    # ---- invariants ------------------------------------------------------------------------------

    def check(self, running: list[Req]) -> None:
        """Every KV slot is exactly one of: free, the prefix cache's, or one running request's
        own; every row is free or one running request's, and zero past its tokens; each running
        request's cached part is the tree's slots, locked. O(KV pool): for --check-invariants."""
        pool = self.req_to_token_pool.req_to_token
        holds = [(r, r.kv) for r in running if r.kv is not None]
        require(len(holds) == len(running), "a running request holds no KV")
        rows = [h.row for _, h in holds]
        require(len(set(rows)) == len(rows), "two running requests share a row")
        require(
            self.req_to_token_pool.num_free + len(rows) == len(self._locked), "a request row leaked"
        )
        owned = [pool[h.row, h.cached_len : r.num_computed_tokens] for r, h in holds]
        tree = self.tree_cache
        tree_slots = tree.all_slots() if tree is not None else torch.empty(0, dtype=torch.int64)
        every = torch.cat([self.allocator.free_slots(), tree_slots, *owned])
        require(
            every.numel() == self.max_total_tokens,
            f"{every.numel()} slots accounted for, {self.max_total_tokens} exist: a slot leaked "
            "or is owned twice",
        )
        require(
            torch.equal(torch.sort(every).values, torch.arange(1, self.max_total_tokens + 1)),
            "a KV slot is owned twice, or slot 0 was handed out",
        )
        # Past its computed tokens a row holds zeros: the batch's kv_slots rely on it for padding.
        written = torch.zeros_like(pool, dtype=torch.bool)
        for r, h in holds:
            written[h.row, : r.num_computed_tokens] = True
        require(not pool.masked_fill(written, 0).any(), "a row holds a slot past its tokens")
        held = set(rows)
        require(
            all(node is None for row, node in enumerate(self._locked) if row not in held),
            "a row that nobody holds still locks a prefix",
        )
        if not running:
            require(self.available == self.max_total_tokens, "idle, yet some KV is not reusable")
        if tree is None:
            return
        require(tree.total_size == tree_slots.numel(), "the tree's size is not what it holds")
        for r, h in holds:
            node = self._locked[h.row]
            if node is None or (node is not tree.root and node.lock_ref == 0):
                raise InvariantError(f"running request {r.rid} does not lock its prefix")
            require(
                torch.equal(pool[h.row, : h.cached_len], tree.prefix_slots(node)),
                f"running request {r.rid}'s cached part is not the tree's slots",
            )
