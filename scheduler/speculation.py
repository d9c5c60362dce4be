"""Speculative decoding on the scheduler side: when to draft, what, and what came of it.

NGRAM (prompt lookup): a decoding request's next tokens are guessed from its own prompt and
outputs (ngram.py), and its step computes [last token + drafts] as extend rows; the model worker
scores every row and accepts the longest run the target model agrees with (spec_verify.py), plus
the target's own token after it. Verification keeps the target's outputs exactly, so speculation
only changes how many forwards they take.

STANDALONE (a draft model): the scheduler decides which requests draft and how many tokens (K,
--speculative-num-steps, fewer where max_new_tokens or the KV left say so) exactly as for NGRAM,
and allocates their slots; the draft model in the model worker writes its drafts over
placeholders (model_worker/draft_model.py), and verification is NGRAM's.

When it pays. Checking k extra rows costs about one row's weight reads at a small batch on the
CPU, but real compute once the batch is large: a step speculates only while at most
--speculative-disable-by-batch-size requests run (vLLM's flag). A request whose drafts keep
being rejected (recent acceptance below MIN_ACCEPT_RATE) stops drafting for COOLDOWN_STEPS, then
tries again. Requests with penalties never draft: a draft row's penalty counts would have to see
the drafts before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.scheduler.config import SpecConfig
from radixserve.scheduler.ngram import NgramIndex, SpecState
from radixserve.scheduler.req import Req

# Recent acceptance: an exponential average of accepted / drafted per verify, this much new.
ACCEPT_RATE_WEIGHT = 0.5
MIN_ACCEPT_RATE = 0.2
COOLDOWN_STEPS = 16
# The token a STANDALONE draft stands in as until the model worker's draft model writes its own
# over it: the scheduler only needs how many drafts a request verifies, never which.
STANDALONE_PLACEHOLDER = 0


@dataclass(slots=True)
class SpecStats:
    """What verification achieved, in total and since the last decode log line."""

    verifies: int = 0  # requests' steps that verified drafts
    drafts: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    verifies_since_log: int = 0
    accepted_since_log: int = 0
    accept_length: float = 0.0  # tokens per verify over the last log interval (SGLang's)

    def count(self, num_drafts: int, num_accepted: int) -> None:
        self.verifies += 1
        self.drafts += num_drafts
        self.accepted += num_accepted
        self.verifies_since_log += 1
        self.accepted_since_log += num_accepted

    def close_interval(self) -> float:
        """The interval's accept length (1 + accepted drafts per verify), and a new interval."""
        if self.verifies_since_log:
            self.accept_length = 1 + self.accepted_since_log / self.verifies_since_log
        self.verifies_since_log = self.accepted_since_log = 0
        return self.accept_length


@dataclass(slots=True)
class Drafter:
    config: SpecConfig
    stats: SpecStats = field(default_factory=SpecStats)

    def step_speculates(self, num_running: int) -> bool:
        return 0 < num_running <= self.config.disable_by_batch_size

    def propose(self, req: Req, limit: int) -> list[int]:
        """Drafts for a decoding request's next step, at most `limit` (what its max_new_tokens,
        the context and the step's KV leave); none when it should not speculate now."""
        params = req.sampling_params
        # Penalties and biases are per row of one sequence, and a grammar's mask needs the
        # tokens before it: such requests decode one token at a time.
        plain = req.seen is None and req.grammar is None
        if not plain or params.logit_bias or params.min_new_tokens or req.future_ids or limit <= 0:
            return []
        cfg = self.config
        state = req.spec
        if state is None:
            index = NgramIndex(cfg.ngram_min, cfg.ngram_max) if cfg.algorithm == "NGRAM" else None
            state = req.spec = SpecState(index)
        if state.cooldown > 0:
            state.cooldown -= 1
            if state.cooldown == 0:
                state.accept_rate = 1.0
            return []
        index = state.index
        if index is None:  # STANDALONE: the draft model fills these in (draft_model.py)
            return [STANDALONE_PLACEHOLDER] * min(limit, cfg.max_drafts)
        n_prompt = len(req.origin_input_ids)
        if len(index) < n_prompt:
            index.extend(req.origin_input_ids)
        index.extend(req.output_ids[len(index) - n_prompt :])
        return index.propose(min(limit, cfg.max_drafts))

    def record(self, req: Req, num_drafts: int, num_accepted: int) -> None:
        """A verify's outcome: the stats, and the request's recent acceptance."""
        self.stats.count(num_drafts, num_accepted)
        state = req.spec
        assert state is not None
        w = ACCEPT_RATE_WEIGHT
        state.accept_rate = (1 - w) * state.accept_rate + w * num_accepted / num_drafts
        if state.accept_rate < MIN_ACCEPT_RATE:
            state.cooldown = COOLDOWN_STEPS
