"""Repetition, frequency and presence penalties, from the tokens each request has seen.

State is keyed by the request's ReqToTokenPool row and sparse: the distinct tokens of its prompt
and output, with how often each appeared in the output. A request's first step in a row carries a
PenaltyInit and the row is rebuilt from its tokens then; after that only each step's emitted
token is added. Applying reads and writes the logits at those tokens only, never a pass over the
vocabulary: a request sees hundreds of distinct tokens, the vocabulary has 10^5.

Repetition as transformers' RepetitionPenaltyLogitsProcessor, on tokens of the prompt or the
output: a positive logit is divided by it, any other multiplied. Then, as in OpenAI, vLLM and
SGLang, frequency * count + presence * (count > 0) is subtracted for output tokens. Repetition
goes first, as in vLLM, so it scales the model's logit rather than an already shifted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model_worker.batch import SamplingBatchInfo


def penalised_rows(info: SamplingBatchInfo) -> torch.Tensor:
    """Batch indices (int64, CPU) of the rows with any penalty."""
    on = (
        (info.repetition_penalties != 1)
        | (info.frequency_penalties != 0)
        | (info.presence_penalties != 0)
    )
    return on.nonzero()[:, 0]


@dataclass(slots=True)
class SeenTokens:
    """The distinct tokens of one request's prompt and output so far (CPU)."""

    ids: torch.Tensor  # int64 [S], ascending
    output_counts: torch.Tensor  # int32 [S]: occurrences in the output, 0 for prompt-only tokens

    @classmethod
    def of(cls, prompt_ids: list[int], output_ids: list[int]) -> SeenTokens:
        tokens = torch.tensor(prompt_ids + output_ids, dtype=torch.int64)
        ids, inverse = torch.unique(tokens, return_inverse=True)
        counts = torch.bincount(inverse[len(prompt_ids) :], minlength=ids.numel())
        return cls(ids, counts.to(torch.int32))

    def add(self, token: int) -> None:
        """Count one more output token, inserting it in order if it is new."""
        at = int(torch.searchsorted(self.ids, token))
        if at < self.ids.numel() and int(self.ids[at]) == token:
            self.output_counts[at] += 1
            return
        self.ids = torch.cat([self.ids[:at], self.ids.new_tensor([token]), self.ids[at:]])
        one = self.output_counts.new_ones(1)
        self.output_counts = torch.cat([self.output_counts[:at], one, self.output_counts[at:]])


class PenaltyState:
    """Per ReqToTokenPool row, the SeenTokens of the penalised request last started there. Rows
    appear when a penalised request starts in them; unpenalised requests' rows are never read or
    written (a penalised request moving into one rebuilds it from its PenaltyInit).

    The state stays on the CPU whatever device the logits are on: recording a step's tokens
    branches on them per row, which on an accelerator would be a sync per row, while shipping
    the seen tokens to the logits is one small copy per step.
    """

    def __init__(self) -> None:
        self.rows: dict[int, SeenTokens] = {}

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def apply(
        self, logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor
    ) -> torch.Tensor:
        """The logits with penalties applied to batch rows `rows` (from `penalised_rows`), after
        rebuilding the state of those that start in their row. Returns a new tensor: the raw
        logits stay as they are, for logprobs."""
        if rows.numel() == 0:
            return logits
        self._rebuild(info, rows)
        seen = [self.rows[row] for row in info.req_rows[rows].tolist()]
        lengths = torch.tensor([s.ids.numel() for s in seen])
        # One entry per (batch row, seen token), flat over the rows: no padding to the longest.
        batch_rows = torch.repeat_interleave(rows, lengths)
        ids = torch.cat([s.ids for s in seen])
        counts = torch.cat([s.output_counts for s in seen])
        # The subtrahends as the dense formula rounds them, float32 products, on the CPU where
        # the counts are; the logits' device then gets two copies.
        params = torch.stack(
            [
                info.repetition_penalties[batch_rows],
                info.frequency_penalties[batch_rows] * counts,
                info.presence_penalties[batch_rows] * (counts > 0),
            ]
        ).to(logits.device)
        index = torch.stack([batch_rows, ids]).to(logits.device)
        rep, frequency, presence = params
        x = logits[index[0], index[1]]
        penalised = torch.where(x > 0, x / rep, x * rep) - frequency - presence
        # The ids of a row are distinct, so no entry is written twice.
        return logits.index_put((index[0], index[1]), penalised)

    def record(self, tokens: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> None:
        """Count each sampled token (int64 [B], device) into its row's output counts, for the rows
        of `rows` whose token is kept: a prefill chunk's sample is discarded by the scheduler."""
        rows = rows[info.emits_token[rows]]
        sampled = tokens[rows.to(tokens.device)].tolist()
        for row, token in zip(info.req_rows[rows].tolist(), sampled):
            self.rows[row].add(token)

    def _rebuild(self, info: SamplingBatchInfo, rows: torch.Tensor) -> None:
        """Reset the rows of the penalised requests that start in them to their prompt and
        outputs so far. A penalised row that never had a PenaltyInit (a caller that starts
        requests without one) has seen nothing."""
        inits = {p.batch_index: p for p in info.penalty_inits}
        for index, row in zip(rows.tolist(), info.req_rows[rows].tolist()):
            init = inits.get(index)
            if init is not None:
                self.rows[row] = SeenTokens.of(init.prompt_ids, init.output_ids)
            elif row not in self.rows:
                self.rows[row] = SeenTokens.of([], [])
