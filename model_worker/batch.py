"""ModelWorkerBatch: what the scheduler hands the model worker for one forward.

Only what the forward needs, as CPU tensors, so it can be sent as raw bytes to other TP ranks.
A batch packs B sequences, each contributing `extend_lens[i]` new tokens (a whole prompt, a prefill
chunk, or 1 for a decode), in one flat token axis of length T = sum(extend_lens):

    sequence i:  [ prefix_lens[i] tokens already in the KV pool | extend_lens[i] new tokens ]
                   ^ kv_slots[i, 0]                                 written to out_cache_loc ^
    seq_lens[i] = prefix_lens[i] + extend_lens[i];  kv_slots[i, :seq_lens[i]] are its KV slots,
    kv_slots[i, seq_lens[i]:] are padding = slot 0, which no request ever owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyTokens:
    """The tokens the penalised sequences of a batch have seen (prompt and outputs), one entry
    per (sequence, distinct token), flat over those sequences: no padding to the longest."""

    batch_rows: torch.Tensor  # int64 [S]: the sequence of each entry
    token_ids: torch.Tensor  # int64 [S]: distinct within a sequence
    output_counts: torch.Tensor  # int32 [S]: occurrences in its outputs, 0 for prompt-only


@dataclass(slots=True)
class LogitBias:
    """Additions to some logits, one entry per (sequence, token), flat: the requests'
    `logit_bias`, and -inf on the stop tokens of those still short of `min_new_tokens`. A pair
    may come twice (a bias and a mask); the additions then sum."""

    batch_rows: torch.Tensor  # int64 [E]
    token_ids: torch.Tensor  # int64 [E]
    biases: torch.Tensor  # float32 [E]


@dataclass(slots=True)
class SamplingBatchInfo:
    """Per-sequence sampling parameters, one row per sequence of the batch (CPU tensors), and the
    tokens penalties read: everything sampling needs, so the worker keeps no per-request state."""

    temperatures: torch.Tensor  # float32 [B]; below GREEDY_TEMPERATURE (sampler.py) greedy
    top_ps: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]; -1 means off
    min_ps: torch.Tensor  # float32 [B]; 0 means off
    repetition_penalties: torch.Tensor  # float32 [B]; 1 means off (prompt and output tokens)
    frequency_penalties: torch.Tensor  # float32 [B]; 0 means off (output tokens)
    presence_penalties: torch.Tensor  # float32 [B]; 0 means off (output tokens)
    seeds: torch.Tensor  # int64 [B]; meaningful where `seeded`
    seeded: torch.Tensor  # bool [B]
    output_index: torch.Tensor  # int64 [B]: which output token of its request each row samples
    top_logprobs_nums: torch.Tensor  # int64 [B]; meaningful where `return_logprob`
    return_logprob: torch.Tensor  # bool [B]
    penalty_tokens: PenaltyTokens | None  # None: no sequence has a penalty
    is_all_greedy: bool  # no row samples: argmax, unless penalties change the logits
    any_logprob: bool
    logit_bias: LogitBias | None = None  # None: no sequence has a bias or a minimum length
    # The tokens each row may sample (constrained decoding): xgrammar's packed bitmask, int32
    # [B, ceil(V / 32)], bit j of word w allowing token 32 * w + j; a row without a grammar is
    # all ones (-1). None: no row of the batch is constrained.
    vocab_mask: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.penalty_tokens is not None


@dataclass(slots=True)
class SampleOutput:
    """What the worker returns for a batch (CPU tensors). N = B, one token per sequence, unless
    the batch speculated: then sequence i gets a run of accept_lens[i] tokens, back to back."""

    next_token_ids: torch.Tensor  # int64 [N]
    # With any_logprob: log_softmax of the raw logits (before temperature and penalties).
    token_logprobs: torch.Tensor | None = None  # float32 [N]: of the chosen token
    top_logprobs: torch.Tensor | None = None  # float32 [N, K], K = max(top_logprobs_nums)
    top_logprob_ids: torch.Tensor | None = None  # int64 [N, K]
    # With the batch's prompt_logprob_rows: each row's logprob of its target, and its top K.
    prompt_logprobs: torch.Tensor | None = None  # float32 [R]
    prompt_top_logprobs: torch.Tensor | None = None  # float32 [R, K], K = prompt_top_logprobs_num
    prompt_top_logprob_ids: torch.Tensor | None = None  # int64 [R, K]
    accept_lens: torch.Tensor | None = None  # int64 [B]: accepted drafts + 1; None: all 1

    @property
    def last_token_ids(self) -> torch.Tensor:
        """Each sequence's last new token [B]: what its next step's input placeholder means."""
        if self.accept_lens is None:
            return self.next_token_ids
        return self.next_token_ids[torch.cumsum(self.accept_lens, 0) - 1]


@dataclass(slots=True)
class ModelWorkerBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot of each new token
    prefix_lens: torch.Tensor  # int64 [B]
    extend_lens: torch.Tensor  # int64 [B]
    kv_slots: torch.Tensor  # int64 [B, max(seq_lens)]
    sampling: SamplingBatchInfo
    # Prompt logprobs (SGLang's input_token_logprobs): packed token rows whose logits give the
    # logprob of the prompt token after them, that token, and how many top tokens to list.
    prompt_logprob_rows: torch.Tensor | None = None  # int64 [R]
    prompt_logprob_targets: torch.Tensor | None = None  # int64 [R]
    prompt_top_logprobs_num: int = 0
    # int64 [B]: how many of each sequence's extend tokens are speculative drafts, its last ones
    # (spec_verify.py); None: the batch does not speculate
    draft_lens: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.extend_lens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens
