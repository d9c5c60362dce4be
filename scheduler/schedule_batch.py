"""ScheduleBatch: one step's plan on the scheduler side, and its ModelWorkerBatch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_worker.batch import ModelWorkerBatch, PenaltyInit, SamplingBatchInfo
from scheduler.memory_pool import ReqToTokenPool
from scheduler.req import Req


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

    def to_model_worker_batch(self, pool: ReqToTokenPool) -> ModelWorkerBatch:
        reqs = self.reqs
        # One tensor per dtype for everything per-request: each torch.tensor call costs ~30 µs.
        ints = _tensor(
            [
                (s, n, r.req_pool_idx, len(r.output_ids), *r.sampling_ints)
                for r, s, n in zip(reqs, self.prefix_lens, self.extend_lens)
            ],
            np.int64,
        )
        prefix, extend, rows = ints[:, 0], ints[:, 1], ints[:, 2]
        # positions of sequence i run prefix[i] .. prefix[i] + extend[i] - 1
        starts = torch.cumsum(extend, 0) - extend
        positions = torch.arange(self.num_tokens) - torch.repeat_interleave(starts - prefix, extend)
        pool.req_to_token[torch.repeat_interleave(rows, extend), positions] = self.out_cache_loc

        input_ids: list[int] = []
        for req, start, n in zip(reqs, self.prefix_lens, self.extend_lens):
            if n == 1 and req.output_ids and start == req.num_tokens - 1:
                input_ids.append(req.output_ids[-1])  # a decode: the common case, made cheap
            else:
                input_ids += req.token_slice(start, start + n)

        seq_lens = prefix + extend
        kv_slots = pool.req_to_token[rows, : int(seq_lens.max())]
        kv_slots.masked_fill_(torch.arange(kv_slots.shape[1]) >= seq_lens[:, None], 0)

        return ModelWorkerBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            out_cache_loc=self.out_cache_loc,
            prefix_lens=prefix.contiguous(),
            extend_lens=extend.contiguous(),
            kv_slots=kv_slots,
            sampling=self._sampling_info(ints),
        )

    def _sampling_info(self, ints: torch.Tensor) -> SamplingBatchInfo:
        """ints: the int64 columns built in to_model_worker_batch (see Req.sampling_ints)."""
        reqs = self.reqs
        floats = _tensor([r.sampling_floats for r in reqs], np.float32)
        flags = _tensor(
            [(r.seeded, e, r.return_logprob) for r, e in zip(reqs, self.emits)], np.bool_
        )
        penalized = [r.penalized for r in reqs]
        inits = [
            PenaltyInit(i, r.origin_input_ids, r.output_ids)
            for i, r in enumerate(reqs)
            if r.new_row and penalized[i]
        ]
        for r in reqs:
            r.new_row = False
        temperatures, top_ps, min_ps, rep, freq, pres = floats.T.contiguous()
        top_ks, seeds, top_logprobs_nums = ints[:, 4:].T.contiguous()
        return SamplingBatchInfo(
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            seeds=seeds,
            seeded=flags[:, 0].contiguous(),
            output_index=ints[:, 3].contiguous(),
            req_rows=ints[:, 2].contiguous(),
            emits_token=flags[:, 1].contiguous(),
            top_logprobs_nums=top_logprobs_nums,
            return_logprob=flags[:, 2].contiguous(),
            penalty_inits=inits,
            is_all_greedy=all(r.sampling_params.is_greedy for r in reqs),
            has_penalties=any(penalized),
            has_min_p=bool((min_ps > 0).any()),
            any_logprob=any(r.return_logprob for r in reqs),
        )


def _tensor(rows: list[tuple], dtype: type) -> torch.Tensor:
    # Through numpy: twice as fast as torch.tensor on a list of tuples.
    return torch.from_numpy(np.array(rows, dtype=dtype))
