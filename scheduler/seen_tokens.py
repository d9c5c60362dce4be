"""SeenTokens: what a penalised request's repetition, frequency and presence penalties read.

The request owns it (`Req.seen`): built from its prompt when it arrives, one output token added
per emitted token, so it survives a retraction as its tokens do. Sparse: the distinct tokens of
its prompt and outputs, with how often each came out; a request sees hundreds of distinct tokens,
the vocabulary has 10^5. Each batch carries a flat copy of its penalised requests' (PenaltyTokens),
so the model worker keeps no state between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.model_worker.batch import PenaltyTokens


@dataclass(frozen=True, slots=True)
class SeenTokens:
    """Immutable: a batch built from it keeps what it saw even after the request moves on."""

    ids: torch.Tensor  # int64 [S], ascending
    output_counts: torch.Tensor  # int32 [S]: occurrences in the output, 0 for prompt-only tokens

    @classmethod
    def of(cls, prompt_ids: list[int], output_ids: list[int]) -> SeenTokens:
        tokens = torch.tensor(prompt_ids + output_ids, dtype=torch.int64)
        ids, inverse = torch.unique(tokens, return_inverse=True)
        counts = torch.bincount(inverse[len(prompt_ids) :], minlength=ids.numel())
        return cls(ids, counts.to(torch.int32))

    def with_output(self, token: int) -> SeenTokens:
        """These tokens and one more output token."""
        at = int(torch.searchsorted(self.ids, token))
        if at < self.ids.numel() and int(self.ids[at]) == token:
            counts = self.output_counts.clone()
            counts[at] += 1
            return SeenTokens(self.ids, counts)
        ids = torch.cat([self.ids[:at], self.ids.new_tensor([token]), self.ids[at:]])
        one = self.output_counts.new_ones(1)
        return SeenTokens(ids, torch.cat([self.output_counts[:at], one, self.output_counts[at:]]))


def penalty_tokens(
    batch_indices: np.ndarray,
    seen: list[SeenTokens],
    future_ids: list[list[int]] | None = None,
) -> PenaltyTokens:
    """The flat PenaltyTokens of the batch whose sequence batch_indices[i] has seen seen[i] and
    has future_ids[i] in flight (overlap): those come as placeholder entries of count 1, which
    the worker's FutureMap resolves (and merges with an equal token) before sampling."""
    if future_ids is None:
        future_ids = [[] for _ in seen]
    lengths = torch.tensor([s.ids.numel() + len(f) for s, f in zip(seen, future_ids)])
    rows = torch.repeat_interleave(torch.from_numpy(batch_indices.astype(np.int64)), lengths)
    ids: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    for s, futures in zip(seen, future_ids):
        ids.append(s.ids)
        counts.append(s.output_counts)
        if futures:
            ids.append(torch.tensor(futures, dtype=torch.int64))
            counts.append(torch.ones(len(futures), dtype=torch.int32))
    return PenaltyTokens(batch_rows=rows, token_ids=torch.cat(ids), output_counts=torch.cat(counts))
