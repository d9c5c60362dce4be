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

from dataclasses import dataclass

from radixserve.scheduler.req import Req

# Remaining-output estimates are capped so one request asking for 100k tokens cannot block all.
CLIP_MAX_NEW_TOKENS = 4096


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


@dataclass(slots=True)
class PrefillAdder:
    token_budget: int  # prompt tokens left in this step after the running requests' share
    free_kv: int  # free slots after the running requests' reserve
    running_slots: int  # requests that may still start running
    ratio: float
    stopped: bool = False

    def try_add(self, req: Req) -> int:
        """Tokens of `req` to compute in this step, 0 if it does not fit now. FCFS: after a 0 the
        caller stops, so a later request never jumps one that does not fit. A request that gets
        only a chunk of its prompt ends admission for this step (`stopped`)."""
        need = reserved_tokens(req, self.ratio)
        extend = min(req.num_uncomputed_tokens, self.token_budget)
        if self.stopped or self.running_slots <= 0 or need > self.free_kv or extend <= 0:
            return 0
        self.free_kv -= need
        self.token_budget -= extend
        self.running_slots -= 1
        self.stopped = extend < req.num_uncomputed_tokens
        return extend
