"""Verification of speculative drafts: which of them the target model accepts.

A speculating sequence computes [last token, d_1 .. d_k] as extend rows; the logits at its row j
give the target's distribution p_j of the token after d_j (after the last token for j = 0). Each
row is sampled as an ordinary decode at output index o + j would be (o: the sequence's next output
index), and the sequence gets the longest run where the sampled token equals the next draft, plus
the sampled token after it: the correction where a draft was wrong, the bonus when all were right.

Why that is exact. For a point-mass draft d, speculative sampling (Leviathan et al.) accepts with
probability p(d) and on rejection samples p with d removed, renormalised. The sampler draws by the
exponential race, argmax_t p(t) / E_t: its winner is d with probability p(d), and given that it is
not d, it is t with probability p(t) / (1 - p(d)). So "accept iff the race picks d, else take its
winner" is that same rejection sampling, one draw per row. Greedy rows are its limit: accept while
the argmax equals the draft. And a seeded request's noise depends on (seed, output index, token)
only, so with speculation it gets the very tokens it gets without, alone or in any batch.

Verification and a per-row vocabulary mask meet here: rows are sampled by the one Sampler, with
each sequence's parameters repeated over its rows (`expand_rows`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from radixserve.model_worker.batch import LogitBias, PenaltyTokens, SampleOutput, SamplingBatchInfo
from radixserve.model_worker.sampler import Sampler


def verify_rows(extend_lens: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """The packed rows scored per sequence: its last draft_lens + 1 (just the last without
    drafts), in order."""
    counts = draft_lens + 1
    ends = torch.cumsum(extend_lens, 0)
    return _spans(ends - counts, counts)


def draft_rows(extend_lens: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """The packed rows of every sequence's drafts, back to back: its last draft_lens rows."""
    ends = torch.cumsum(extend_lens, 0)
    return _spans(ends - draft_lens, draft_lens)


def draft_tokens(
    input_ids: torch.Tensor, extend_lens: torch.Tensor, draft_lens: torch.Tensor
) -> torch.Tensor:
    """The drafts of every sequence, back to back: the last draft_lens of its extend tokens."""
    return input_ids[draft_rows(extend_lens, draft_lens)]


def expand_rows(info: SamplingBatchInfo, draft_lens: torch.Tensor) -> SamplingBatchInfo:
    """Per-sequence sampling parameters repeated over each sequence's scored rows; row j of a
    sequence samples its output o + j. Penalised and biased sequences must not speculate
    (counts would have to see the drafts; min_new_tokens depends on the output's index): each
    of theirs stays one row."""
    counts = draft_lens + 1
    seq_of_row = torch.repeat_interleave(counts)  # one index, gathered by every column
    expanded: dict[str, Any] = {
        f.name: value[seq_of_row]
        for f in fields(info)
        if isinstance(value := getattr(info, f.name), torch.Tensor)
    }
    first_row = torch.cumsum(counts, 0) - counts
    expanded["output_index"] += torch.arange(seq_of_row.numel()) - first_row[seq_of_row]
    seen = info.penalty_tokens
    if seen is not None:
        assert not bool(draft_lens[seen.batch_rows].any()), "a penalised sequence drafted"
        seen = PenaltyTokens(first_row[seen.batch_rows], seen.token_ids, seen.output_counts)
    bias = info.logit_bias
    if bias is not None:
        assert not bool(draft_lens[bias.batch_rows].any()), "a biased sequence drafted"
        bias = LogitBias(first_row[bias.batch_rows], bias.token_ids, bias.biases)
    return replace(info, penalty_tokens=seen, logit_bias=bias, **expanded)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lens: torch.Tensor,
    info: SamplingBatchInfo,
    sampler: Sampler,
) -> SampleOutput:
    """Logits of the rows `verify_rows` picks [R, V], the drafts (int64, sequence after sequence)
    and each sequence's count [B] -> each sequence's accepted run: next_token_ids holds the runs
    back to back (with their logprobs, when asked for), accept_lens [B] their lengths."""
    sampled = sampler(logits, expand_rows(info, draft_lens))
    targets = sampled.next_token_ids
    counts = draft_lens + 1
    batch, width = counts.numel(), int(draft_lens.max())
    first_row = torch.cumsum(counts, 0) - counts
    # agree[i, j]: sequence i's row j sampled its draft j + 1 (False past its drafts)
    within = torch.arange(width)[None, :] < draft_lens[:, None]
    agree = torch.zeros(batch, width, dtype=torch.bool)
    draft_rows = _spans(first_row, draft_lens)
    agree[within] = targets[draft_rows] == drafts
    accepted = agree.to(torch.int64).cumprod(dim=1).sum(dim=1)
    kept = _spans(first_row, accepted + 1)  # each sequence's first accepted + 1 rows

    def keep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[kept]

    return SampleOutput(
        next_token_ids=targets[kept],
        token_logprobs=keep(sampled.token_logprobs),
        top_logprobs=keep(sampled.top_logprobs),
        top_logprob_ids=keep(sampled.top_logprob_ids),
        accept_lens=accepted + 1,
    )


def _spans(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """starts[i] .. starts[i] + counts[i] - 1 for each i, concatenated."""
    seq = torch.repeat_interleave(counts)
    first = torch.cumsum(counts, 0) - counts
    return starts[seq] + torch.arange(seq.numel()) - first[seq]
