"""The grammar's vocab mask in the sampler: xgrammar's packed bitmask unpacked as xgrammar itself
applies it, applied before penalties, filters and the draw, so every path samples allowed tokens
only; and it travels with a batch to the other TP ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xgrammar as xgr

from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.batch_codec import decode_batch, encode_batch
from radixserve.model_worker.sampler import Sampler, apply_vocab_mask, unpack_vocab_mask
from radixserve.scheduler.seen_tokens import SeenTokens
from tests.test_sampler import make_info, random_logits

CPU = torch.device("cpu")
VOCAB = 100  # not a multiple of 32: the last word's high bits are past the vocabulary


def random_mask(rows: int, seed: int, allowed_per_row: int = 3) -> torch.Tensor:
    """A packed mask allowing `allowed_per_row` random tokens in each row but the last, which
    allows all (an unconstrained row)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, (VOCAB + 31) // 32, dtype=torch.int32)
    for row in range(rows - 1):
        for token in torch.randperm(VOCAB, generator=gen)[:allowed_per_row].tolist():
            mask[row, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(
                torch.int32
            )
    mask[rows - 1] = -1
    return mask


def allowed_sets(mask: torch.Tensor) -> list[set[int]]:
    return [
        {t for t in range(VOCAB) if (int(mask[r, t // 32]) >> (t % 32)) & 1}
        for r in range(mask.shape[0])
    ]


def test_apply_vocab_mask_equals_xgrammars_own() -> None:
    logits, mask = random_logits(6, vocab=VOCAB), random_mask(6, seed=1)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask)
    masked = apply_vocab_mask(logits.clone(), mask)
    assert torch.equal(masked, expected)
    assert torch.isinf(masked[:-1]).sum() == 5 * (VOCAB - 3)
    assert torch.equal(masked[-1], logits[-1])  # the unconstrained row is untouched
    # The unpacking other devices use (and xgrammar's CPU kernel) agree bit for bit.
    allowed = unpack_vocab_mask(mask, VOCAB)
    assert torch.equal(allowed, torch.isfinite(expected))
    for dtype in (torch.bfloat16, torch.float16):  # not xgrammar's CPU kernel: the shifts
        half = apply_vocab_mask(logits.to(dtype), mask)
        assert torch.equal(torch.isfinite(half), allowed)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperatures": [0.0] * 6},  # the all-greedy fast path
        {"temperatures": [0.0] * 6, "return_logprob": [True] * 6},
        {"temperatures": [1.0] * 6},
        {"temperatures": [2.0] * 6, "top_ks": [2] * 6, "top_ps": [0.5] * 6, "min_ps": [0.1] * 6},
        {"seeded": [True] * 6, "seeds": list(range(6)), "repetition_penalties": [1.5] * 6},
    ],
)
def test_every_path_samples_allowed_tokens_only(fields: dict) -> None:
    sampler = Sampler(CPU, seed=0)
    seen = {r: SeenTokens.of(list(range(50)), [1, 2, 3]) for r in range(6)}
    if "repetition_penalties" not in fields:
        seen = {}
    for seed in range(20):
        # Logits that favour disallowed tokens strongly: the mask must win.
        logits, mask = random_logits(6, seed=seed, vocab=VOCAB) * 5, random_mask(6, seed=seed)
        info = dataclasses.replace(make_info(6, seen=seen, **fields), vocab_mask=mask)
        out = sampler(logits, info)
        allowed = allowed_sets(mask)
        for row, token in enumerate(out.next_token_ids.tolist()):
            assert token in allowed[row]
        if out.token_logprobs is not None:
            # Logprobs of the masked distribution (as SGLang and vLLM report them): finite for
            # the chosen token, and the allowed tokens' probabilities sum to 1.
            assert torch.isfinite(out.token_logprobs).all()


def test_masked_logprobs_renormalise_over_the_allowed_tokens() -> None:
    logits, mask = random_logits(6, vocab=VOCAB), random_mask(6, seed=3)
    info = dataclasses.replace(
        make_info(6, temperatures=[0.0] * 6, return_logprob=[True] * 6, top_logprobs_nums=[3] * 6),
        vocab_mask=mask,
    )
    out = Sampler(CPU, seed=0)(logits, info)
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    # Rows with 3 allowed tokens: the top 3 are exactly those, and their probabilities sum to 1.
    allowed = allowed_sets(mask)
    for row in range(5):
        assert set(out.top_logprob_ids[row].tolist()) == allowed[row]
        assert float(out.top_logprobs[row].exp().sum()) == pytest.approx(1.0, abs=1e-5)


def test_the_mask_travels_to_the_other_tp_ranks() -> None:
    mask = random_mask(2, seed=4)
    batch = ModelWorkerBatch(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 4]),
        out_cache_loc=torch.tensor([1, 2, 3]),
        prefix_lens=torch.tensor([0, 4]),
        extend_lens=torch.tensor([2, 1]),
        kv_slots=torch.tensor([[1, 2, 0, 0, 0], [9, 8, 7, 6, 3]]),
        sampling=dataclasses.replace(make_info(2), vocab_mask=mask),
    )
    received = decode_batch(encode_batch(batch))
    assert received.sampling.vocab_mask is not None
    assert torch.equal(received.sampling.vocab_mask, mask)
    plain = decode_batch(encode_batch(dataclasses.replace(batch, sampling=make_info(2))))
    assert plain.sampling.vocab_mask is None
