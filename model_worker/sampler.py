"""Next-token sampling: one batched call, each row with its own sampling parameters.

The order is SGLang's and vLLM's: the grammar's vocab mask first (constrained decoding: the
disallowed tokens' logits become -inf) -> logit_bias (and min_new_tokens' mask) -> penalties ->
greedy rows take the argmax -> temperature -> softmax -> top_k -> top_p -> min_p -> draw. Work a
batch does not ask for is skipped: an all-greedy batch without penalties, biases or logprobs is
one argmax. Logprobs are of the masked logits, as both peers report them (their masks are applied
to the logits before the sampler sees them), and before biases and penalties: a constrained row's
chosen token is always finite. Everything per request
comes with the batch; the sampler keeps only the generator unseeded rows draw from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.model_worker.batch import SampleOutput, SamplingBatchInfo
from radixserve.model_worker.penalties import apply_logit_bias, apply_penalties

# A temperature below this is greedy, as in vLLM (its _SAMPLING_EPS) and SGLang: dividing the
# logits by less can overflow float32 into infinities, whose softmax is NaN.
GREEDY_TEMPERATURE = 1e-5


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(
        self,
        device: torch.device,
        seed: int,
        argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
    ):
        """`argmax`: each row's argmax of [B, V] logits for greedy batches (the model's ops'
        own, a faster one on the CPU); torch.argmax by default."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.argmax = argmax

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """Logits [B, V] (float32, or the model's bfloat16) -> the next tokens (and logprobs if
        asked for), on the CPU."""
        plain = not info.has_penalties and info.logit_bias is None
        argmax_only = info.is_all_greedy and plain and not info.any_logprob
        if argmax_only and info.vocab_mask is None:
            # float32 holds every bfloat16 exactly: the same argmax as of the float32 logits,
            # without a float32 pass over the vocabulary.
            return SampleOutput(self.argmax(logits).cpu())
        logits = logits.float()  # the rest works in float32 (no copy of float32 logits)
        if info.vocab_mask is not None:
            logits = apply_vocab_mask(logits, info.vocab_mask)
        if argmax_only:
            return SampleOutput(self.argmax(logits).cpu())
        processed = apply_penalties(apply_logit_bias(logits, info), info)
        if info.is_all_greedy:
            tokens = self.argmax(processed)
        else:
            tokens = sample_tokens(processed, info, self.generator)
        if not info.any_logprob:
            return SampleOutput(tokens.cpu())
        return _with_logprobs(logits, tokens, info)


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> torch.Tensor:
    """The logits [B, V], in place, with the tokens the packed bitmask int32 [B, ceil(V / 32)]
    disallows at -inf, in the constrained rows only (a row of all ones is left alone). On the
    CPU xgrammar's own kernel does it (3x faster than the shifts below on float32)."""
    rows = (vocab_mask != -1).any(dim=1).nonzero()[:, 0]
    if rows.numel() == 0:
        return logits
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr  # here: its import (with transformers') took ~0.8 s of a start

        xgr.apply_token_bitmask_inplace(logits, vocab_mask, indices=rows.tolist())
        return logits
    device_rows = rows.to(logits.device)
    allowed = unpack_vocab_mask(vocab_mask[rows].to(logits.device), logits.shape[-1])
    logits[device_rows] = logits[device_rows].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_vocab_mask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 [N, W] -> bool [N, vocab]: bit j of word w is token 32 * w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return (((words[:, :, None] >> shifts) & 1) == 1).reshape(words.shape[0], -1)[:, :vocab]


# Top-k / top-p filter among this many likeliest tokens instead of sorting the whole vocabulary,
# whenever that is exact (see _filter): natural distributions put a top_p nucleus well inside.
FILTER_CANDIDATES = 1024


def sample_tokens(
    logits: torch.Tensor, info: SamplingBatchInfo, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(Penalised) logits float32 [B, V] -> token ids int64 [B] on logits' device.

    Rows with a temperature below GREEDY_TEMPERATURE take the argmax. top_k keeps the k
    likeliest tokens (-1: all); top_p then keeps the smallest set of those whose renormalised
    probability reaches top_p; min_p then drops tokens less likely than min_p times the likeliest
    one. Only the rows that sample pay for any of it, and rows that filter draw among their
    candidates only.
    """
    device = logits.device
    # On the CPU: decided without a device sync.
    sampling = (info.temperatures >= GREEDY_TEMPERATURE).nonzero()[:, 0]
    if sampling.numel() == 0:
        return logits.argmax(dim=-1)
    # When every row samples (the usual batch), no argmax is wasted on them: each gets a draw.
    everyone = sampling.numel() == logits.shape[0]
    tokens = logits.new_empty(logits.shape[0], dtype=torch.int64) if everyone else logits.argmax(-1)
    rows = _rows(info, sampling)
    probs = torch.softmax(
        _take_rows(logits, sampling) / rows.temperatures.to(device)[:, None], dim=-1
    )
    filtering = (rows.top_ks > 0) | (rows.top_ps < 1)
    for members, filters in (
        (filtering.nonzero()[:, 0], True),
        ((~filtering).nonzero()[:, 0], False),
    ):
        if members.numel() == 0:
            continue
        group = _rows(rows, members)
        group_probs = _take_rows(probs, members)
        candidates = None  # token ids of the columns; None: all of the vocabulary, in order
        if filters:
            group_probs, candidates = _filter(group_probs, group.top_ks, group.top_ps)
        if bool((group.min_ps > 0).any()):
            # The likeliest token survives top_k and top_p, so it is the max before and after
            # them: renormalising would not change which tokens min_p drops.
            threshold = group.min_ps.to(device)[:, None] * group_probs.amax(dim=-1, keepdim=True)
            group_probs = group_probs.masked_fill(group_probs < threshold, 0.0)
        noise = _exponential_noise(group_probs, candidates, group, generator)
        choice = _draw(group_probs, noise)
        if candidates is not None:
            choice = candidates.gather(1, choice[:, None])[:, 0]
        tokens[sampling[members].to(device)] = choice
    return tokens


def _take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x's rows `idx` (ascending, CPU); x itself when they are all of them: over a vocabulary of
    151k a copy of 64 rows costs as much as the softmax."""
    return x if idx.numel() == x.shape[0] else x[idx.to(x.device)]


@dataclass(slots=True)
class _Rows:
    """Some rows' sampling parameters (CPU)."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    output_index: torch.Tensor


def _rows(info: SamplingBatchInfo | _Rows, idx: torch.Tensor) -> _Rows:
    return _Rows(
        info.temperatures[idx],
        info.top_ks[idx],
        info.top_ps[idx],
        info.min_ps[idx],
        info.seeds[idx],
        info.seeded[idx],
        info.output_index[idx],
    )


def _filter(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What top_k and top_p keep: (probabilities, token ids), both [N, K], likeliest first, the
    filtered out zeroed. K is the FILTER_CANDIDATES likeliest tokens (one topk, O(V)) when that
    is exact: each row's top_k fits in K, and a row without top_k has top_p of its mass in
    them, so its nucleus lies inside. Else K is the whole vocabulary, sorted."""
    vocab = probs.shape[-1]
    k = min(vocab, max(FILTER_CANDIDATES, int(top_ks.max())))
    top_ks, top_ps = top_ks.to(probs.device), top_ps.to(probs.device)
    values, order = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
    nucleus_rows = (top_ks <= 0) & (top_ps < 1)
    if k < vocab and bool((nucleus_rows & (values.sum(-1) < top_ps)).any()):
        values, order = probs.sort(dim=-1, descending=True)
    total = torch.ones_like(top_ps)  # the rows' whole mass: softmax output sums to 1
    return _top_k_top_p(values, top_ks, top_ps, total), order


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
    probs: torch.Tensor,
    candidates: torch.Tensor | None,
    rows: _Rows,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise shaped like `probs`, whose columns are the tokens `candidates` (None: the
    whole vocabulary in order): from `generator` for unseeded rows; for seeded rows a function of
    (seed, output_index, token id) only, so their draws depend neither on the rest of the batch
    nor on their place in it."""
    if not bool(rows.seeded.any()):
        return _fresh_exponential(probs.shape, probs, generator)
    device = probs.device
    seeded = rows.seeded.nonzero()[:, 0]
    unseeded = (~rows.seeded).nonzero()[:, 0]
    token_ids = (
        torch.arange(probs.shape[-1], device=device)[None, :]
        if candidates is None
        else candidates[seeded.to(device)]
    )
    noise = torch.empty_like(probs)
    noise[seeded.to(device)] = seeded_exponential(
        rows.seeds[seeded].to(device), rows.output_index[seeded].to(device), token_ids
    ).to(probs.dtype)
    if unseeded.numel():
        shape = (unseeded.numel(), probs.shape[-1])
        noise[unseeded.to(device)] = _fresh_exponential(shape, probs, generator)
    return noise


def _fresh_exponential(
    shape: tuple[int, ...] | torch.Size, like: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise from `generator`. Over a whole vocabulary as -log(1 - U): torch.rand and a
    log take about 0.4x the time of Tensor.exponential_, which draws element by element (151k
    tokens x 64 rows: most of an unfiltered step's sampler). Over filtered candidates (1024
    columns) exponential_ stays: one serial pass beats three parallel ones there."""
    if shape[-1] < VECTORISED_NOISE_COLUMNS:
        return torch.empty(shape, dtype=like.dtype, device=like.device).exponential_(
            generator=generator
        )
    u = torch.rand(shape, dtype=like.dtype, device=like.device, generator=generator)
    return u.neg_().log1p_().neg_()


# Rows of at least this many columns draw their noise with torch.rand (see _fresh_exponential).
VECTORISED_NOISE_COLUMNS = 16384


# splitmix64's constants, as the int64 values of the same 64 bits.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def seeded_exponential(
    seeds: torch.Tensor, output_index: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise float64 [N, K] from int64 seeds and output indices [N] and the token ids of
    the columns ([N, K], or [1, K] for all rows), counter-based: entry (n, k) is a hash of
    (seeds[n], output_index[n], token_ids[n, k]), vectorised over the whole block.

    Each (seed, output_index) picks a splitmix64 stream and token t takes its t-th value; 53 of
    its bits make a uniform u in (0, 1), and -log1p(-u) an exponential that is never 0.
    """
    step_keys = mix64(mix64(seeds) + (output_index + 1) * _GOLDEN)
    bits = mix64(step_keys[:, None] + (token_ids + 1) * _GOLDEN)
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
