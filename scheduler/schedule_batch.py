"""ScheduleBatch: one step's plan on the scheduler side, and its ModelWorkerBatch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.model_worker.batch import ModelWorkerBatch, PenaltyInit
from radixserve.scheduler.memory_pool import ReqToTokenPool
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_rows import SamplingRows


@dataclass(slots=True)
class ScheduleBatch:
    reqs: list[Req]
    prefix_lens: list[int]  # num_computed_tokens of each request before this step
    extend_lens: list[int]  # tokens each request computes in this step
    emits: list[bool]  # whether the request catches up, so its sampled token is a real output
    out_cache_loc: torch.Tensor  # KV slots of the new tokens, in request order
    num_decodes: int  # requests that are one behind; the rest are prefilling

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.reqs)

    def to_model_worker_batch(
        self, pool: ReqToTokenPool, sampling_rows: SamplingRows
    ) -> ModelWorkerBatch:
        reqs = self.reqs
        rows_list = [r.req_pool_idx for r in reqs]
        n_out = [len(r.output_ids) for r in reqs]
        # One conversion for every int column: each torch.tensor call on a list costs ~25 µs.
        columns = np.array([self.prefix_lens, self.extend_lens, rows_list, n_out], dtype=np.int64)
        prefix, extend, rows, output_index = torch.from_numpy(columns)
        if self.num_tokens == len(reqs):  # one token each: decodes, the common case
            positions, token_rows = prefix, rows
        else:  # positions of sequence i run prefix[i] .. prefix[i] + extend[i] - 1
            shift = torch.cumsum(extend, 0) - extend - prefix  # token index - position
            positions = torch.arange(self.num_tokens) - torch.repeat_interleave(shift, extend)
            token_rows = torch.repeat_interleave(rows, extend)
        pool.req_to_token[token_rows, positions] = self.out_cache_loc

        if self.num_tokens == len(reqs) and all(self.emits):  # each computes its last token
            input_ids = [(r.output_ids or r.origin_input_ids)[-1] for r in reqs]
        else:
            input_ids = []
            for req, start, n in zip(reqs, self.prefix_lens, self.extend_lens):
                input_ids += req.token_slice(start, start + n)

        # Past a request's tokens its row holds zeros (ReqToTokenPool), so these rows come padded.
        seq_lens = prefix + extend
        kv_slots = pool.req_to_token[:, : int(seq_lens.max())].index_select(0, rows)

        inits = []
        for i in [i for i, r in enumerate(reqs) if r.new_row]:
            req = reqs[i]
            req.new_row = False
            if req.sampling_params.has_penalties:
                inits.append(PenaltyInit(i, req.origin_input_ids, req.output_ids))
        return ModelWorkerBatch(
            input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            prefix_lens=prefix,
            extend_lens=extend,
            kv_slots=kv_slots,
            sampling=sampling_rows.batch_info(rows, output_index, self.emits, inits),
        )
