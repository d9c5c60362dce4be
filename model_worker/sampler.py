"""Next-token sampling: one batched call, each row with its own sampling parameters.

The order is SGLang's and vLLM's: penalties on the raw logits -> greedy rows take the argmax ->
temperature -> softmax -> top_k -> top_p -> min_p -> draw. Work a batch does not ask for is
skipped: an all-greedy batch without penalties or logprobs is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_worker.batch import SampleOutput, SamplingBatchInfo
from model_worker.penalties import PenaltyState, penalised_rows


class Sampler:
    """What sampling keeps between steps: the generator unseeded rows draw from, and the
    penalty state of the requests' rows."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.penalties = PenaltyState(vocab_size, device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """float32 logits [B, V] -> the next tokens (and logprobs if asked for), on the CPU."""
        if info.is_all_greedy and not info.has_penalties and not info.any_logprob:
            return SampleOutput(logits.argmax(dim=-1).cpu())
        rows = penalised_rows(info) if info.has_penalties else None
        processed = logits if rows is None else self.penalties.apply(logits, info, rows)
        if info.is_all_greedy:
            tokens = processed.argmax(dim=-1)
        else:
            tokens = sample_tokens(processed, info, self.generator)
        if rows is not None:
            self.penalties.record(tokens, info, rows)
        if not info.any_logprob:
            return SampleOutput(tokens.cpu())
        return _with_logprobs(logits, tokens, info)


# Top-k / top-p filter among this many likeliest tokens instead of sorting the whole vocabulary,
# whenever that is exact (see _filter): natural distributions put a top_p nucleus well inside.
FILTER_CANDIDATES = 1024


def sample_tokens(
    logits: torch.Tensor, info: SamplingBatchInfo, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(Penalised) logits float32 [B, V] -> token ids int64 [B] on logits' device.

    Rows with temperature 0 take the argmax. top_k keeps the k likeliest tokens (-1: all);
    top_p then keeps the smallest set of those whose renormalised probability reaches top_p;
    min_p then drops tokens less likely than min_p times the likeliest one. Only the rows that
    sample pay for any of it.
    """
    device = logits.device
    tokens = logits.argmax(dim=-1)
    sampling = (info.temperatures > 0).nonzero()[:, 0]  # CPU: decided without a device sync
    if sampling.numel() == 0:
        return tokens
    rows = _rows(info, sampling)
    on_device = sampling.to(device)
    probs = torch.softmax(logits[on_device] / rows.temperatures.to(device)[:, None], dim=-1)
    if bool(((rows.top_ks > 0) | (rows.top_ps < 1)).any()):
        probs = _filter(probs, rows.top_ks.to(device), rows.top_ps.to(device))
    if bool((rows.min_ps > 0).any()):
        # The likeliest token always survives top_k and top_p, so its probability is the max
        # before and after them: renormalising would not change which tokens min_p drops.
        threshold = rows.min_ps.to(device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    tokens[on_device] = _draw(probs, _exponential_noise(probs, rows, generator))
    return tokens


@dataclass(slots=True)
class _Rows:
    """The sampling rows' parameters (CPU)."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    output_index: torch.Tensor


def _rows(info: SamplingBatchInfo, idx: torch.Tensor) -> _Rows:
    return _Rows(
        info.temperatures[idx],
        info.top_ks[idx],
        info.top_ps[idx],
        info.min_ps[idx],
        info.seeds[idx],
        info.seeded[idx],
        info.output_index[idx],
    )


def _filter(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero what top_k and top_p filter out, in token order.

    Among the K likeliest tokens (one topk, O(V)) when that is exact: each row's top_k fits in
    K, and a row without top_k has top_p of its mass in them, so its nucleus lies inside. Else
    a full sort. Either way the filter sees the candidates in descending order.
    """
    vocab = probs.shape[-1]
    k = min(vocab, max(FILTER_CANDIDATES, int(top_ks.max())))
    values, order = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
    total = torch.ones_like(top_ps)  # the rows' whole mass: softmax output sums to 1
    unfiltered = (top_ks <= 0) & (top_ps >= 1)  # rows in a filtered batch that keep everything
    nucleus_rows = (top_ks <= 0) & ~unfiltered
    if k < vocab and bool((nucleus_rows & (values.sum(-1) < top_ps)).any()):
        values, order = probs.sort(dim=-1, descending=True)
    kept = _top_k_top_p(values, top_ks, top_ps, total)
    # Back to token order: seeded noise is keyed by token id, not by rank.
    filtered = torch.zeros_like(probs).scatter_(1, order, kept)
    return torch.where(unfiltered[:, None], probs, filtered)


def _top_k_top_p(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities (descending; the K likeliest, or all) that top_k or top_p filter
    out. `total`: each row's whole mass, for rows without top_k."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    k = torch.where(top_ks > 0, top_ks, sorted_probs.shape[-1])
    kept = sorted_probs.masked_fill(ranks[None, :] >= k[:, None], 0.0)
    cumulative = kept.cumsum(dim=-1)
    # A token stays if the likelier tokens before it do not already reach top_p of the mass
    # top_k left (all of it without top_k); the first token always stays.
    mass = torch.where(top_ks > 0, cumulative[:, -1], total)
    before = cumulative - kept
    return kept.masked_fill(before >= top_ps[:, None] * mass[:, None], 0.0)


def _draw(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One index per row with probability proportional to `probs` (which need not sum to 1),
    given Exp(1) noise of the same shape.

    argmax(p / E) with E ~ Exp(1) picks i with probability p_i / sum(p): the exponential race,
    one elementwise op and one argmax for the whole batch.
    """
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _exponential_noise(
    probs: torch.Tensor, info: _Rows, generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise shaped like `probs`: from `generator` for unseeded rows; for seeded rows a
    function of (seed, output_index, token id) only, so their draws do not depend on the rest
    of the batch or on their place in it."""
    if not bool(info.seeded.any()):
        return torch.empty_like(probs).exponential_(generator=generator)
    device = probs.device
    seeded = info.seeded.nonzero()[:, 0]
    unseeded = (~info.seeded).nonzero()[:, 0]
    noise = torch.empty_like(probs)
    noise[seeded.to(device)] = seeded_exponential(
        info.seeds[seeded].to(device), info.output_index[seeded].to(device), probs.shape[-1]
    ).to(probs.dtype)
    if unseeded.numel():
        rows = torch.empty(unseeded.numel(), probs.shape[-1], dtype=probs.dtype, device=device)
        noise[unseeded.to(device)] = rows.exponential_(generator=generator)
    return noise


# splitmix64's constants, as the int64 values of the same 64 bits.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def seeded_exponential(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise float64 [N, vocab] from int64 seeds and output indices [N], counter-based:
    entry (n, t) is a hash of (seeds[n], output_index[n], t), vectorised over the whole block.

    Each (seed, output_index) picks a splitmix64 stream and token t takes its t-th value; 53 of
    its bits make a uniform u in (0, 1), and -log1p(-u) an exponential that is never 0.
    """
    step_keys = mix64(mix64(seeds) + (output_index + 1) * _GOLDEN)
    token_offsets = (torch.arange(vocab, device=seeds.device) + 1) * _GOLDEN
    bits = mix64(step_keys[:, None] + token_offsets[None, :])
    u = (_shift_right(bits, 11).double() + 0.5) * 2.0**-53
    return -torch.log1p(-u)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: a bijection of 64-bit words whose output bits
    each depend on every input bit. int64 arithmetic wraps, which is the mod 2^64 it needs."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift: torch's >> on int64 copies the sign bit, so mask those copies off."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _with_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, info: SamplingBatchInfo
) -> SampleOutput:
    """The tokens with the logprobs of the raw logits: the model's own distribution, before
    penalties, temperature and filtering, in float32 (as vLLM's default "raw_logprobs"; SGLang
    reports this with SGLANG_RETURN_ORIGINAL_LOGPROB, and by default after temperature). Such
    logprobs mean the same whatever sampling parameters a request uses, and a filtered-out token
    keeps a finite value."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k = int(torch.where(info.return_logprob, info.top_logprobs_nums, 0).max())
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return SampleOutput(
        next_token_ids=tokens.cpu(),
        token_logprobs=logprobs.gather(1, tokens[:, None])[:, 0].cpu(),
        top_logprobs=top.values.cpu(),
        top_logprob_ids=top.indices.cpu(),
    )
