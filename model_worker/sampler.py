"""Next-token sampling: one batched call, each row with its own temperature, top_k and top_p."""

from __future__ import annotations

import torch

from model_worker.batch import SamplingBatchInfo


def sample(
    logits: torch.Tensor, info: SamplingBatchInfo, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits float32 [B, V] -> token ids int64 [B] on logits' device.

    Rows with temperature 0 take the argmax. top_k keeps the k likeliest tokens (-1: all);
    top_p then keeps the smallest set of those whose renormalised probability reaches top_p.
    """
    if info.is_all_greedy:
        return logits.argmax(dim=-1)
    device = logits.device
    temperatures = info.temperatures.to(device)
    greedy = temperatures <= 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1)
    # Decided on the CPU copies, so no device sync: most batches filter nothing and skip the sort.
    if bool((info.top_ks > 0).any()) or bool((info.top_ps < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = _top_k_top_p(sorted_probs, info.top_ks.to(device), info.top_ps.to(device))
        sampled = order.gather(1, _draw(sorted_probs, generator)[:, None])[:, 0]
    else:
        sampled = _draw(probs, generator)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _top_k_top_p(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities (sorted, descending) that top_k or top_p filter out."""
    vocab = sorted_probs.shape[-1]
    ranks = torch.arange(vocab, device=sorted_probs.device)
    k = torch.where(top_ks > 0, top_ks, vocab)
    kept = sorted_probs.masked_fill(ranks[None, :] >= k[:, None], 0.0)
    cumulative = kept.cumsum(dim=-1)
    # A token stays if the likelier tokens before it do not already reach top_p of the mass
    # top_k left; the first token always stays.
    before = cumulative - kept
    return kept.masked_fill(before >= top_ps[:, None] * cumulative[:, -1:], 0.0)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row with probability proportional to `probs` (which need not sum to 1).

    argmax(p / E) with E ~ Exp(1) picks i with probability p_i / sum(p): the exponential race,
    one elementwise op and one argmax for the whole batch.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
