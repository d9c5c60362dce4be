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
class PenaltyInit:
    """A sequence whose penalty state the worker (re)builds before sampling it: its first step in
    a ReqToTokenPool row (just admitted, or recomputed after a retraction)."""

    batch_index: int
    prompt_ids: list[int]
    output_ids: list[int]  # outputs so far: non-empty only for a recompute


@dataclass(slots=True)
class SamplingBatchInfo:
    """Per-sequence sampling parameters, one row per sequence of the batch (CPU tensors)."""

    temperatures: torch.Tensor  # float32 [B]; 0 means greedy
    top_ps: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]; -1 means off
    min_ps: torch.Tensor  # float32 [B]; 0 means off
    repetition_penalties: torch.Tensor  # float32 [B]; 1 means off (prompt and output tokens)
    frequency_penalties: torch.Tensor  # float32 [B]; 0 means off (output tokens)
    presence_penalties: torch.Tensor  # float32 [B]; 0 means off (output tokens)
    seeds: torch.Tensor  # int64 [B]; meaningful where `seeded`
    seeded: torch.Tensor  # bool [B]
    output_index: torch.Tensor  # int64 [B]: which output token of its request each row samples
    req_rows: torch.Tensor  # int64 [B]: the request's ReqToTokenPool row, keys penalty state
    emits_token: torch.Tensor  # bool [B]: False for a prefill chunk, whose sample is discarded
    top_logprobs_nums: torch.Tensor  # int64 [B]; meaningful where `return_logprob`
    return_logprob: torch.Tensor  # bool [B]
    penalty_inits: list[PenaltyInit]
    is_all_greedy: bool  # no row samples: argmax, unless penalties change the logits
    has_penalties: bool
    any_logprob: bool


@dataclass(slots=True)
class SampleOutput:
    """What the worker returns for a batch (CPU tensors)."""

    next_token_ids: torch.Tensor  # int64 [B]
    # With any_logprob: log_softmax of the raw logits (before temperature and penalties).
    token_logprobs: torch.Tensor | None = None  # float32 [B]: of the chosen token
    top_logprobs: torch.Tensor | None = None  # float32 [B, K], K = max(top_logprobs_nums)
    top_logprob_ids: torch.Tensor | None = None  # int64 [B, K]


@dataclass(slots=True)
class ModelWorkerBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slot of each new token
    prefix_lens: torch.Tensor  # int64 [B]
    extend_lens: torch.Tensor  # int64 [B]
    kv_slots: torch.Tensor  # int64 [B, max(seq_lens)]
    sampling: SamplingBatchInfo

    @property
    def batch_size(self) -> int:
        return self.extend_lens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens
