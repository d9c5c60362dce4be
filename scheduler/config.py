"""SchedulerConfig: the scheduler's settings, resolved from the server arguments once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding (speculation.py), SGLang's flags."""

    algorithm: str  # "NGRAM" | "STANDALONE"
    # Rows verified per request and step: its last token and the drafts (STANDALONE: the draft
    # model's steps + 1, a chain as SGLang's with topk 1)
    num_draft_tokens: int
    ngram_min: int  # shortest match of a request's last tokens that proposes drafts
    ngram_max: int  # longest
    disable_by_batch_size: int  # a step with more running requests does not speculate

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_total_tokens: int  # usable KV slots
    max_running_requests: int
    # Token budget of one step: prompt tokens plus one per decoding request, as SGLang counts it
    # when prefills and decodes share a step (--enable-mixed-chunk); ours always may.
    max_prefill_tokens: int
    # Prompt tokens computed in one step, over all its requests (SGLang's chunked_prefill_size):
    # a longer prompt, or a longer queue of them, is prefilled over several steps.
    chunked_prefill_size: int
    context_len: int
    eos_token_ids: frozenset[int]
    log_interval: int = 40
    check_invariants: bool = False
    enable_radix_cache: bool = True
    page_size: int = 1
    schedule_policy: str = "fcfs"  # or "lpm": longest prefix match first
    enable_overlap: bool = False  # launch each step on a worker thread, process it one step later
    speculative: SpecConfig | None = None  # None: no speculative decoding
    max_queued_requests: int = 1024  # waiting or compiling their grammar; past it: overloaded
