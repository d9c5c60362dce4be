"""PrefillAdder: which waiting requests join this step, and how many prompt tokens each computes.

Three budgets, as SGLang: the step's prompt tokens (the lesser of what --max-prefill-tokens leaves
after the running requests and of --chunked-prefill-size: a long prompt, or a long queue, is
prefilled over several steps while decodes go on), the free running slots, and the KV slots that
are free after a reserve for what the running requests will still generate. That reserve is an
estimate: each running request is expected to generate `new_token_ratio` of its remaining
max_new_tokens. When the estimate proves too low, decode retracts requests (scheduler.py) and the
ratio is raised.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.radix_cache import common_prefix_len
from radixserve.scheduler.req import Req

# One request's share of a step: (request, tokens it computes, whether it then emits a token).
Planned = tuple[Req, int, bool]

# Remaining-output estimates are capped so one request asking for 100k tokens cannot block all.
CLIP_MAX_NEW_TOKENS = 4096
# Past this many waiting requests, lpm's prefix matching costs more than it saves (SGLang).
LPM_MAX_QUEUE = 128
# A waiting request that shares this many uncached tokens (or all of them) with one admitted in
# the same step waits a step: then it finds them in the tree instead of computing them again.
IN_BATCH_SHARED_PREFIX = 32


@dataclass(slots=True)
class NewTokenRatio:
    """SGLang's decaying estimate of how much of max_new_tokens requests really use."""

    init: float = 0.7
    min: float = 0.1
    decay_steps: int = 600
    value: float = 0.7

    def decay(self) -> None:
        self.value = max(self.min, self.value - (self.init - self.min) / self.decay_steps)

    def raise_to(self, estimate: float) -> None:
        self.value = min(1.0, max(self.value, estimate))


def reserved_tokens(req: Req, ratio: float) -> int:
    """KV a request is expected to need beyond what it holds: its uncomputed tokens in full, its
    future outputs scaled by the ratio."""
    future = min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
    return req.num_uncomputed_tokens + int(future * ratio)


def sort_by_prefix_match(waiting: deque[Req], kv: KVManager) -> deque[Req]:
    """lpm: the waiting queue, longest cached prefix first (stable). Only measures the matches:
    the tree is left as it was. A long queue keeps its order."""
    if kv.tree_cache is None or len(waiting) > LPM_MAX_QUEUE:
        return waiting
    matched = {id(r): kv.cached_prefix_len(r) for r in waiting}
    return deque(sorted(waiting, key=lambda r: -matched[id(r)]))


@dataclass(slots=True)
class PrefillAdder:
    token_budget: int  # prompt tokens left in this step after the running requests' share
    free_kv: int  # free slots after the running requests' reserve
    running_slots: int  # requests that may still start running
    ratio: float
    stopped: bool = False

    @property
    def can_add(self) -> bool:
        return not self.stopped and self.running_slots > 0 and self.token_budget > 0

    def admit(self, waiting: deque[Req], kv: KVManager) -> list[Planned]:
        """Takes requests off the front of the queue while they fit, each starting from its
        cached prefix (KVManager.admit); FCFS: the first that does not fit ends admission, so
        a later request never jumps it."""
        admitted: list[Planned] = []
        while waiting and self.can_add:
            req = waiting[0]
            available = kv.available
            kv.admit(req)
            assert req.kv is not None
            req.num_computed_tokens = req.kv.cached_len
            # The matched prefix is locked now: it no longer counts as evictable.
            self.free_kv -= available - kv.available
            n = 0 if _shares_uncached_prefix(req, admitted, kv) else self.try_add(req)
            if n == 0:
                kv.release(req)
                req.num_computed_tokens = 0
                break
            waiting.popleft()
            admitted.append((req, n, n == req.num_uncomputed_tokens))
        return admitted

    def try_add(self, req: Req) -> int:
        """Tokens of `req` to compute in this step, 0 if it does not fit now. A request that gets
        only a chunk of its prompt ends admission for this step (`stopped`)."""
        need = reserved_tokens(req, self.ratio)
        extend = min(req.num_uncomputed_tokens, self.token_budget)
        if not self.can_add or need > self.free_kv or extend <= 0:
            return 0
        self.free_kv -= need
        self.token_budget -= extend
        self.running_slots -= 1
        self.stopped = extend < req.num_uncomputed_tokens
        return extend


def _shares_uncached_prefix(req: Req, admitted: list[Planned], kv: KVManager) -> bool:
    assert req.kv is not None
    if kv.tree_cache is None or not admitted:
        return False
    # Worth a step of waiting: a long shared span, or all it would compute but the one token it
    # always computes (n > 1 completions of one prompt, say).
    threshold = min(IN_BATCH_SHARED_PREFIX, req.num_uncomputed_tokens - 1)
    if threshold <= 0:
        return False
    tokens = req.token_slice(0, req.num_tokens)
    return any(
        common_prefix_len(tokens, other.token_slice(0, other.num_tokens), 1)
        >= req.kv.cached_len + threshold
        for other, _, _ in admitted
    )
