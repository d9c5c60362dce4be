"""FutureMap: tokens that are sampled but not yet back at the scheduler (overlap scheduling).

With overlap, step N+1 is planned while step N runs, so a decode's input in step N+1 is a token
step N has not sampled yet. The scheduler writes it as a negative placeholder, -index, where
`index` is the slot step N's worker stores that token in; the worker swaps placeholders for the
tokens before step N+1's forward. As SGLang's FutureMap, on the CPU:

    scheduler thread:  alloc(B) -> slots for step N's tokens; inputs of step N+1 say -slot
    worker thread:     resolve(step N+1)  reads the slots step N stored
                       store(step N's slots, step N's tokens)   right after step N samples

Each side owns its state: the scheduler the ring's cursor, the worker the token buffer. The
worker runs steps in order, so a step's placeholders are always stored before they are read.
Only the step in flight can leave placeholders in a plan (the scheduler processes each result
before planning the step after next), so two steps' worth of slots never collide.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, PenaltyTokens


class FutureMap:
    def __init__(self, max_batch_size: int):
        self.capacity = 2 * max_batch_size
        self._cursor = 0  # scheduler thread
        self._tokens = torch.zeros(self.capacity + 1, dtype=torch.int64)  # worker thread; 0 unused

    def alloc(self, n: int) -> torch.Tensor:
        """Slots (1 .. capacity, contiguous) for the n tokens of the step being launched."""
        assert n <= self.capacity // 2, "a batch larger than max_running_requests"
        if self._cursor + n > self.capacity:
            self._cursor = 0
        start = self._cursor + 1
        self._cursor += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._tokens[slots] = tokens

    def resolve(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """The batch with its placeholders (input ids, and the penalties' seen tokens) replaced
        by the tokens stored for them; the same batch when it has none."""
        input_ids = self._resolve_ids(batch.input_ids)
        sampling = batch.sampling
        seen = sampling.penalty_tokens
        if seen is not None and bool((seen.token_ids < 0).any()):
            sampling = replace(sampling, penalty_tokens=self._resolve_seen(seen))
        if input_ids is batch.input_ids and sampling is batch.sampling:
            return batch
        return replace(batch, input_ids=input_ids, sampling=sampling)

    def _resolve_ids(self, ids: torch.Tensor) -> torch.Tensor:
        future = ids < 0
        if not bool(future.any()):
            return ids
        return torch.where(future, self._tokens[(-ids).clamp_min(0)], ids)

    def _resolve_seen(self, seen: PenaltyTokens) -> PenaltyTokens:
        """A placeholder's token may already be among its sequence's seen tokens: merge such
        entries (their output counts add up), since penalties expect each (sequence, token)
        once."""
        ids = self._resolve_ids(seen.token_ids)
        entries = torch.stack([seen.batch_rows, ids])
        keys, inverse = torch.unique(entries, dim=1, return_inverse=True)
        counts = torch.zeros(keys.shape[1], dtype=seen.output_counts.dtype)
        counts.index_add_(0, inverse, seen.output_counts)
        return PenaltyTokens(batch_rows=keys[0], token_ids=keys[1], output_counts=counts)
