"""Repetition, frequency and presence penalties, from the tokens each sequence has seen.

Stateless: the batch carries, for each penalised sequence, the distinct tokens of its prompt and
output with how often each appeared in the output (PenaltyTokens; the scheduler keeps them per
request). Applying reads and writes the logits at those tokens only, never a pass over the
vocabulary: a request sees hundreds of distinct tokens, the vocabulary has 10^5.

Repetition as transformers' RepetitionPenaltyLogitsProcessor, on tokens of the prompt or the
output: a positive logit is divided by it, any other multiplied. Then, as in OpenAI, vLLM and
SGLang, frequency * count + presence * (count > 0) is subtracted for output tokens. Repetition
goes first, as in vLLM, so it scales the model's logit rather than an already shifted one.

Before all of them, `apply_logit_bias` adds the requests' logit_bias (and masks the stop tokens
of those short of min_new_tokens), as SGLang and vLLM do.
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


def apply_logit_bias(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The logits plus each sequence's biases (its `logit_bias`, and -inf on its stop tokens
    while it is short of `min_new_tokens`): the first change to them, before penalties. Returns a
    new tensor when there is any, so the raw logits stay as they are, for logprobs."""
    bias = info.logit_bias
    if bias is None:
        return logits
    index = (bias.batch_rows.to(logits.device), bias.token_ids.to(logits.device))
    return logits.index_put(index, bias.biases.to(logits.device), accumulate=True)
