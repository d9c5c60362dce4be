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
class SamplingBatchInfo:
    """Per-sequence sampling parameters, one row per sequence of the batch."""

    temperatures: torch.Tensor  # float32 [B]; 0 means greedy
    top_ps: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]; -1 means off
    is_all_greedy: bool  # lets the sampler skip everything but argmax


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
