"""Repetition, frequency and presence penalties, from the tokens each sequence has seen.

Stateless: the batch carries, for each penalised sequence, the distinct tokens of its prompt and
output with how often each appeared in the output (PenaltyTokens; the scheduler keeps them per
request). Applying reads and writes the logits at those tokens only, never a pass over the
vocabulary: a request sees hundreds of distinct tokens, the vocabulary has 10^5.

Repetition as transformers' RepetitionPenaltyLogitsProcessor, on tokens of the prompt or the
output: a positive logit is divided by it, any other multiplied. Then, as in OpenAI, vLLM and
SGLang, frequency * count + presence * (count > 0) is subtracted for output tokens. Repetition
goes first, as in vLLM, so it scales the model's logit rather than an already shifted one.
"""

from __future__ import annotations

import torch

from radixserve.model_worker.batch import SamplingBatchInfo


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The logits with each sequence's penalties applied to the tokens it has seen. Returns a new
    tensor: the raw logits stay as they are, for logprobs."""
    seen = info.penalty_tokens
    if seen is None:
        return logits
    rows, counts = seen.batch_rows, seen.output_counts
    # The subtrahends as the dense formula rounds them, float32 products, on the CPU where the
    # counts are; the logits' device then gets two copies.
    params = torch.stack(
        [
            info.repetition_penalties[rows],
            info.frequency_penalties[rows] * counts,
            info.presence_penalties[rows] * (counts > 0),
        ]
    ).to(logits.device)
    index = torch.stack([rows, seen.token_ids]).to(logits.device)
    rep, frequency, presence = params
    x = logits[index[0], index[1]]
    penalised = torch.where(x > 0, x / rep, x * rep) - frequency - presence
    # The ids of a sequence are distinct, so no entry is written twice.
    return logits.index_put((index[0], index[1]), penalised)
