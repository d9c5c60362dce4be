"""ScheduleBatch: one step's plan on the scheduler side, and its ModelWorkerBatch.

`prepare` is the one place a step touches KV bookkeeping: it allocates the new tokens' slots and
writes them into the requests' rows, and takes what the step reads from its requests. After
that the batch does not change: `to_model_worker_batch` only reads, so it gives the same
ModelWorkerBatch however often it is called (overlap scheduling and TP broadcast rely on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_rows import SamplingRows

# Columns read from every request of a step, by C-level getters (no Python frame per request).
_ROW = attrgetter("kv.row")  # a request in a batch runs, so it holds a KVHandle
_NUM_COMPUTED = attrgetter("num_computed_tokens")


@dataclass(frozen=True, slots=True)
class ScheduleBatch:
    reqs: list[Req]
    prefix_lens: list[int]  # num_computed_tokens of each request before this step
    extend_lens: list[int]  # tokens each request computes in this step
    emits: list[bool]  # whether the request catches up, so its sampled token is a real output
    num_decodes: int  # requests that are one behind; the rest are prefilling
    # int64 [B] each: prefix_lens, extend_lens, each request's row, and which output token of
    # its request each samples (its output_index)
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    input_ids: torch.Tensor  # int64 [T]: the tokens computed, request after request
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T]: KV slots of the new tokens
    # int64 [B]: the FutureMap slot of each sequence's sampled token; an emitted token in flight
    # is -slot in its request's future_ids
    future_slots: torch.Tensor
    # Prompt logprobs: (sequence, first position, count) of each run of rows whose logits give
    # the logprob of the prompt token after them; empty when no request asks.
    prompt_spans: tuple[tuple[int, int, int], ...] = ()
    # Speculative drafts each request computes after its last token, the last of its extend
    # tokens (0 for the others); None: the step does not speculate
    draft_lens: list[int] | None = None

    @classmethod
    def prepare(
        cls,
        reqs: list[Req],
        extend_lens: list[int],
        emits: list[bool],
        num_decodes: int,
        kv: KVManager,
        future_slots: torch.Tensor,
        drafts: list[list[int]] | None = None,
    ) -> ScheduleBatch:
        prefix_lens = list(map(_NUM_COMPUTED, reqs))
        n_out = [r.num_outputs for r in reqs]
        # One conversion for every int column: each torch.tensor call on a list costs ~25 µs.
        columns = np.array([prefix_lens, extend_lens, list(map(_ROW, reqs)), n_out], dtype=np.int64)
        prefix, extend, rows, output_index = torch.from_numpy(columns)
        num_tokens = sum(extend_lens)
        if num_tokens == len(reqs):  # one token each: decodes, the common case
            positions, token_rows = prefix, rows
        else:  # positions of sequence i run prefix[i] .. prefix[i] + extend[i] - 1
            shift = torch.cumsum(extend, 0) - extend - prefix  # token index - position
            positions = torch.arange(num_tokens) - torch.repeat_interleave(shift, extend)
            token_rows = torch.repeat_interleave(rows, extend)
        spans: tuple[tuple[int, int, int], ...] = ()
        if num_tokens == len(reqs) and all(emits):  # each computes its last token
            input_ids = [r.last_token for r in reqs]
        else:  # a speculating request: its last token, then its drafts
            input_ids = []
            for i, (req, start, n) in enumerate(zip(reqs, prefix_lens, extend_lens)):
                draft = drafts[i] if drafts is not None else []
                input_ids += req.token_slice(start, start + n - len(draft)) + draft
            spans = prompt_spans(reqs, prefix_lens, extend_lens)
        return cls(
            reqs=reqs,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            emits=emits,
            num_decodes=num_decodes,
            columns=(prefix, extend, rows, output_index),
            input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
            positions=positions,
            out_cache_loc=kv.alloc_extend(token_rows, positions),
            future_slots=future_slots,
            prompt_spans=spans,
            draft_lens=None if drafts is None else [len(d) for d in drafts],
        )

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.draft_lens) if self.draft_lens else 0

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.reqs)

    def to_model_worker_batch(self, kv: KVManager, sampling_rows: SamplingRows) -> ModelWorkerBatch:
        prefix, extend, rows, output_index = self.columns
        # Past a request's tokens its row holds zeros (ReqToTokenPool), so these rows come padded.
        seq_lens = prefix + extend
        pool = kv.req_to_token_pool.req_to_token
        kv_slots = pool[:, : int(seq_lens.max())].index_select(0, rows)
        return ModelWorkerBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            prefix_lens=prefix,
            extend_lens=extend,
            kv_slots=kv_slots,
            sampling=sampling_rows.batch_info(self.reqs, rows, output_index),
            **self._prompt_logprob_rows(),
            draft_lens=None if self.draft_lens is None else torch.tensor(self.draft_lens),
        )

    def _prompt_logprob_rows(self) -> dict[str, Any]:
        """ModelWorkerBatch's prompt_logprob_* fields for the batch's prompt spans."""
        if not self.prompt_spans:
            return {}
        offsets = np.cumsum([0, *self.extend_lens])
        rows: list[int] = []
        targets: list[int] = []
        for i, first, count in self.prompt_spans:
            start = int(offsets[i]) + first - self.prefix_lens[i]
            rows += range(start, start + count)
            targets += self.reqs[i].origin_input_ids[first + 1 : first + 1 + count]
        top = max(self.reqs[i].top_logprobs_num for i, _, _ in self.prompt_spans)
        return {
            "prompt_logprob_rows": torch.tensor(rows, dtype=torch.int64),
            "prompt_logprob_targets": torch.tensor(targets, dtype=torch.int64),
            "prompt_top_logprobs_num": top,
        }


def prompt_spans(
    reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]
) -> tuple[tuple[int, int, int], ...]:
    """For each request that wants prompt logprobs, the positions of this step's rows that
    predict one of its prompt tokens from logprob_start_len on (position p predicts p + 1)."""
    spans = []
    for i, (req, prefix, extend) in enumerate(zip(reqs, prefix_lens, extend_lens)):
        if req.logprob_start_len < 0:
            continue
        first = max(prefix, req.logprob_start_len - 1, 0)
        end = min(prefix + extend, len(req.origin_input_ids) - 1)
        if first < end:
            spans.append((i, first, end - first))
    return tuple(spans)
