"""ScheduleBatch: one step's plan on the scheduler side, and its ModelWorkerBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_worker.batch import ModelWorkerBatch, PenaltyInit, SamplingBatchInfo
from scheduler.memory_pool import ReqToTokenPool
from scheduler.req import Req


@dataclass(slots=True)
class ScheduleBatch:
    reqs: list[Req]
    prefix_lens: list[int]  # num_computed_tokens of each request before this step
    extend_lens: list[int]  # tokens each request computes in this step
    out_cache_loc: torch.Tensor  # KV slots of the new tokens, in request order
    num_decodes: int  # requests that are one behind; the rest are prefilling

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.reqs)

    def write_req_to_token(self, pool: ReqToTokenPool, positions: torch.Tensor) -> None:
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        token_rows = torch.repeat_interleave(rows, torch.tensor(self.extend_lens))
        pool.req_to_token[token_rows, positions] = self.out_cache_loc

    def to_model_worker_batch(self, pool: ReqToTokenPool) -> ModelWorkerBatch:
        prefix = torch.tensor(self.prefix_lens, dtype=torch.int64)
        extend = torch.tensor(self.extend_lens, dtype=torch.int64)
        # positions of sequence i run prefix[i] .. prefix[i] + extend[i] - 1
        starts = torch.cumsum(extend, 0) - extend
        positions = torch.arange(self.num_tokens) - torch.repeat_interleave(starts - prefix, extend)
        self.write_req_to_token(pool, positions)

        input_ids: list[int] = []
        for req, start, n in zip(self.reqs, self.prefix_lens, self.extend_lens):
            input_ids += req.token_slice(start, start + n)

        seq_lens = prefix + extend
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        kv_slots = pool.req_to_token[rows, : int(seq_lens.max())]
        kv_slots.masked_fill_(torch.arange(kv_slots.shape[1]) >= seq_lens[:, None], 0)

        return ModelWorkerBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            prefix_lens=prefix,
            extend_lens=extend,
            kv_slots=kv_slots,
            sampling=self._sampling_info(),
        )

    def _sampling_info(self) -> SamplingBatchInfo:
        reqs = self.reqs
        params = [r.sampling_params for r in reqs]
        penalized = [
            p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
            for p in params
        ]
        inits = [
            PenaltyInit(i, r.origin_input_ids, r.output_ids)
            for i, r in enumerate(reqs)
            if r.new_row and penalized[i]
        ]
        for r in reqs:
            r.new_row = False
        return SamplingBatchInfo(
            temperatures=_f32([p.temperature for p in params]),
            top_ps=_f32([p.top_p for p in params]),
            top_ks=_i64([p.top_k for p in params]),
            min_ps=_f32([p.min_p for p in params]),
            repetition_penalties=_f32([p.repetition_penalty for p in params]),
            frequency_penalties=_f32([p.frequency_penalty for p in params]),
            presence_penalties=_f32([p.presence_penalty for p in params]),
            seeds=_i64([p.seed or 0 for p in params]),
            seeded=torch.tensor([p.seed is not None for p in params]),
            output_index=_i64([len(r.output_ids) for r in reqs]),
            req_rows=_i64([r.req_pool_idx for r in reqs]),
            emits_token=torch.tensor(
                [s + n == r.num_tokens for r, s, n in zip(reqs, self.prefix_lens, self.extend_lens)]
            ),
            top_logprobs_nums=_i64([r.top_logprobs_num for r in reqs]),
            return_logprob=torch.tensor([r.return_logprob for r in reqs]),
            penalty_inits=inits,
            is_all_greedy=all(p.is_greedy for p in params),
            has_penalties=any(penalized),
            has_min_p=any(p.min_p > 0 for p in params),
            any_logprob=any(r.return_logprob for r in reqs),
        )


def _f32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
