"""ForwardBatch: one forward's inputs on the device, plus what attention reads besides q/k/v."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.kv_pool import TokenToKVPool


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T], device
    positions: torch.Tensor  # int64 [T], device
    out_cache_loc: torch.Tensor  # int64 [T], device
    last_rows: torch.Tensor  # int64 [B], device: each sequence's last token in the packed axis
    # Kept on the CPU: attention backends build their index tensors from these without a sync.
    prefix_lens: torch.Tensor  # int64 [B]
    extend_lens: torch.Tensor  # int64 [B]
    kv_slots: torch.Tensor  # int64 [B, max(seq_lens)]
    kv_pool: TokenToKVPool
    # Owned by the attention backend: set by its init_forward_metadata, read by its forward.
    attn_metadata: object = None

    @classmethod
    def from_worker_batch(
        cls, batch: ModelWorkerBatch, device: torch.device, kv_pool: TokenToKVPool
    ) -> ForwardBatch:
        return cls(
            input_ids=batch.input_ids.to(device),
            positions=batch.positions.to(device),
            out_cache_loc=batch.out_cache_loc.to(device),
            last_rows=(torch.cumsum(batch.extend_lens, 0) - 1).to(device),
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            kv_slots=batch.kv_slots,
            kv_pool=kv_pool,
        )

    @property
    def device(self) -> torch.device:
        return self.input_ids.device
