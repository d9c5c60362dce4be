"""The sampler on real tensors: greedy rows, top_k/top_p/min_p against float64 references, seeded
draws that do not depend on the batch, and logprobs of the raw logits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from radixserve.model_worker.batch import SamplingBatchInfo
from radixserve.model_worker.sampler import (
    GREEDY_TEMPERATURE,
    VECTORISED_NOISE_COLUMNS,
    Sampler,
    _filter,
    mix64,
)
from radixserve.protocol.wire import MAX_TEMPERATURE, MIN_FRACTION
from radixserve.scheduler.seen_tokens import SeenTokens, penalty_tokens

VOCAB = 50
CPU = torch.device("cpu")


def make_info(batch_size: int, **fields: Any) -> SamplingBatchInfo:
    """`batch_size` rows with SGLang's defaults (temperature 1, no filter, no penalty, no seed).
    `fields` override any tensor (lists are converted), or give `seen`: {row: SeenTokens} of the
    rows whose penalties read them; the flags follow from the tensors, as the scheduler sets
    them."""
    n = batch_size
    t: dict[str, torch.Tensor] = {
        "temperatures": torch.ones(n),
        "top_ps": torch.ones(n),
        "top_ks": torch.full((n,), -1),
        "min_ps": torch.zeros(n),
        "repetition_penalties": torch.ones(n),
        "frequency_penalties": torch.zeros(n),
        "presence_penalties": torch.zeros(n),
        "seeds": torch.zeros(n, dtype=torch.int64),
        "seeded": torch.zeros(n, dtype=torch.bool),
        "output_index": torch.zeros(n, dtype=torch.int64),
        "top_logprobs_nums": torch.zeros(n, dtype=torch.int64),
        "return_logprob": torch.zeros(n, dtype=torch.bool),
    }
    seen: dict[int, SeenTokens] = fields.pop("seen", {})
    for name, value in fields.items():
        t[name] = torch.as_tensor(value, dtype=t[name].dtype)
        assert t[name].shape == (n,), name
    rows = sorted(seen)
    return SamplingBatchInfo(
        **t,
        penalty_tokens=penalty_tokens(np.array(rows), [seen[i] for i in rows]) if seen else None,
        is_all_greedy=bool((t["temperatures"] < GREEDY_TEMPERATURE).all()),
        any_logprob=bool(t["return_logprob"].any()),
    )


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_fast_path_is_argmax_and_computes_nothing_else() -> None:
    logits = random_logits(8)
    sampler = Sampler(CPU, seed=0)
    before = sampler.generator.get_state()
    out = sampler(logits, make_info(8, temperatures=[0.0] * 8, top_ks=[5] * 8))
    assert out.next_token_ids.dtype == torch.int64
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.token_logprobs is None and out.top_logprobs is None
    assert torch.equal(sampler.generator.get_state(), before)


def test_greedy_rows_and_top_k_1_are_argmax_in_a_sampled_batch() -> None:
    logits = random_logits(5)
    sampler = Sampler(CPU, seed=0)
    batch = make_info(
        5,
        temperatures=[0.0, 1.5, 0.7, 1.0, 2.0],
        top_ps=[1.0, 1.0, 0.3, 1.0, 0.9],
        top_ks=[-1, 1, 1, -1, 1],
        seeded=[False, False, False, False, True],
        seeds=[0, 0, 0, 0, 7],
    )
    assert not batch.is_all_greedy
    for step in range(50):
        batch.output_index.fill_(step)
        out = sampler(logits, batch).next_token_ids
        assert torch.equal(out[[0, 1, 2, 4]], logits[[0, 1, 2, 4]].argmax(-1))


# (temperature, top_p, top_k, min_p) per row.
FILTERS = [
    (1.0, 0.7, -1, 0.0),
    (0.8, 0.9, 10, 0.0),
    (1.3, 1.0, 5, 0.0),
    (1.0, 0.75, 20, 0.0),
    (1.0, 1.0, -1, 0.05),
    (1.5, 1.0, -1, 0.2),
    (1.0, 0.9, 12, 0.1),
    (0.7, 0.95, -1, 0.02),
]


def test_top_k_top_p_min_p_keep_exactly_the_reference_set() -> None:
    """Thousands of copies of each row, half of them seeded: the tokens drawn are exactly the set
    a float64 reference keeps."""
    logits = random_logits(len(FILTERS), seed=1) / 2  # flat enough that each filter binds
    temps, top_ps, top_ks, min_ps = (list(col) for col in zip(*FILTERS))
    draws = 3000
    n = draws * len(FILTERS)
    batch = make_info(
        n,
        temperatures=temps * draws,
        top_ps=top_ps * draws,
        top_ks=top_ks * draws,
        min_ps=min_ps * draws,
        seeds=torch.arange(n),
        seeded=torch.arange(n) % 2 == 0,
    )
    out = Sampler(CPU, seed=0)(logits.repeat(draws, 1), batch)
    seen = out.next_token_ids.view(draws, len(FILTERS))
    for row, params in enumerate(FILTERS):
        support = _reference_support(logits[row], *params)
        assert set(seen[:, row].tolist()) == support, f"row {row} {params}"
        assert 1 < len(support) < VOCAB, "the filter should keep some and drop some"


# A few columns, and a vocabulary wide enough that its noise comes from torch.rand.
@pytest.mark.parametrize("width", [4, VECTORISED_NOISE_COLUMNS], ids=["narrow", "vocabulary"])
def test_unfiltered_sampling_follows_the_distribution(width: int) -> None:
    logits = torch.full((1, width), -30.0)
    logits[0, :3] = torch.tensor([0.0, 1.0, 2.0])
    sampler, draws, chunk = Sampler(CPU, seed=0), 6000, 1000
    seen = torch.cat(
        [
            sampler(logits.expand(chunk, width), make_info(chunk)).next_token_ids
            for _ in range(draws // chunk)
        ]
    )
    freq = torch.bincount(seen, minlength=width)[:4].double() / seen.numel()
    torch.testing.assert_close(freq, logits[0, :4].double().softmax(-1), atol=0.02, rtol=0)


# Our seeded row's parameters: every filter on, so the seeded path goes through all of them.
SEEDED_ROW = {"temperatures": 1.2, "top_ps": 0.95, "top_ks": 30, "min_ps": 0.01}


def test_seeded_row_gives_the_same_token_alone_and_anywhere_in_any_batch() -> None:
    logits = random_logits(16, seed=2) / 3  # flat enough that different seeds disagree
    sampler = Sampler(CPU, seed=0)
    tokens = set()
    for seed in range(60):
        output_index = seed % 7
        own = {name: [value] for name, value in SEEDED_ROW.items()}
        alone = make_info(1, seeded=[True], seeds=[seed], output_index=[output_index], **own)
        token = int(sampler(logits[:1], alone).next_token_ids[0])
        tokens.add(token)

        # 15 companions with their own logits, parameters and seeds; ours sits at `position`.
        gen = torch.Generator().manual_seed(seed)
        position = seed % 16
        order = torch.arange(16).roll(position)  # row 0 of `logits` lands at `position`
        batch = make_info(
            16,
            temperatures=torch.rand(16, generator=gen) * 2,
            top_ps=0.5 + torch.rand(16, generator=gen) / 2,
            top_ks=torch.randint(-1, 40, (16,), generator=gen),
            min_ps=torch.rand(16, generator=gen) / 5,
            seeded=torch.rand(16, generator=gen) < 0.5,
            seeds=torch.randint(0, 2**62, (16,), generator=gen),
            output_index=torch.randint(0, 100, (16,), generator=gen),
        )
        for name, value in SEEDED_ROW.items():
            getattr(batch, name)[position] = value
        batch.seeded[position], batch.seeds[position] = True, seed
        batch.output_index[position] = output_index
        assert int(sampler(logits[order], batch).next_token_ids[position]) == token, seed
    assert len(tokens) > 5, "the row should be random enough for the check to mean something"


def seeded(seeds: torch.Tensor, output_index: torch.Tensor) -> SamplingBatchInfo:
    n = seeds.numel()
    return make_info(n, seeded=[True] * n, seeds=seeds, output_index=output_index)


def test_output_index_and_seed_choose_different_streams() -> None:
    logits = torch.zeros(100, VOCAB)  # uniform: every draw is the noise's argmax
    sampler = Sampler(CPU, seed=0)
    steps = torch.arange(100)
    first = sampler(logits, seeded(torch.full((100,), 5), steps)).next_token_ids
    again = sampler(logits, seeded(torch.full((100,), 5), steps)).next_token_ids
    other = sampler(logits, seeded(torch.full((100,), 6), steps)).next_token_ids
    assert torch.equal(first, again)
    assert len(set(first.tolist())) > 35  # 100 draws from 50 tokens: about 43 distinct
    assert (first != other).sum() > 80  # they agree about 1 time in 50


def test_seeded_draws_follow_the_distribution() -> None:
    """Pearson's chi-square over 8 tokens (7 degrees of freedom: 99.9% of it lies below 24.3),
    once across seeds and once across the output indices of one seed."""
    logits = torch.tensor([[0.5, 1.0, 2.0, -1.0, 0.0, 1.5, 0.2, -0.5]])
    expected = logits[0].double().softmax(-1)
    n = 8000
    for batch in [
        seeded(torch.arange(n), torch.zeros(n)),
        seeded(torch.full((n,), 3), torch.arange(n)),
    ]:
        seen = Sampler(CPU, seed=0)(logits.repeat(n, 1), batch).next_token_ids
        counts = torch.bincount(seen, minlength=8).double()
        chi2 = ((counts - n * expected) ** 2 / (n * expected)).sum()
        assert chi2 < 24.3, f"chi-square {chi2:.1f}"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperatures": [MAX_TEMPERATURE] * 100},
        {
            "repetition_penalties": [MIN_FRACTION] * 100,
            # every allowed token already seen: every one penalized
            "seen": {i: SeenTokens.of(list(range(10, VOCAB)), []) for i in range(100)},
        },
    ],
)
def test_the_wires_extreme_values_still_draw(fields) -> None:
    """At the bounds the wire takes (a temperature past them was infinite as a 32-bit float, a
    repetition penalty under them 0): masked tokens (-inf, as a grammar or min_tokens leaves
    them) are still never drawn, and the seeds still choose. Past the bounds the rows were NaN,
    and every one drew token 0, whatever its seed."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)).repeat(100, 1)
    logits[:, :10] = float("-inf")
    info = make_info(100, seeded=[True] * 100, seeds=torch.arange(100), **fields)
    drawn = Sampler(CPU, seed=0)(logits * 30, info).next_token_ids
    assert drawn.min() >= 10  # NaN rows drew token 0
    if "temperatures" in fields:  # all but uniform: the same logits, 100 seeds, many tokens
        assert len(set(drawn.tolist())) > 20


def test_mix64_is_splitmix64_mod_2_64() -> None:
    """int64 tensor arithmetic wraps as the mod-2^64 reference does, negative words included."""
    words = torch.randint(-(2**63), 2**63 - 1, (1000,), generator=torch.Generator().manual_seed(3))
    expected = [_splitmix64_finaliser(w % 2**64) for w in words.tolist()]
    assert [w % 2**64 for w in mix64(words).tolist()] == expected


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = random_logits(6, seed=4)
    nums = [0, 3, 5, 0, 1, 2]
    batch = make_info(
        6,
        temperatures=[0.0, 0.7, 1.0, 1.0, 0.0, 1.3],
        top_ks=[-1, 5, -1, -1, -1, 3],
        # Penalties change the tokens (row 0 no longer takes its argmax), not the logprobs.
        repetition_penalties=[100.0, 1.0, 1.0, 1.0, 1.0, 1.2],
        seen={0: SeenTokens.of(logits[0].argmax(-1, keepdim=True).tolist(), [])},
        return_logprob=[True, True, True, False, True, True],
        top_logprobs_nums=nums,
    )
    out = Sampler(CPU, seed=0)(logits, batch)
    assert out.next_token_ids[0] != logits[0].argmax()
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_logprobs is not None and out.token_logprobs.dtype == torch.float32
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    expected = reference.gather(1, out.next_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.token_logprobs.double(), expected, atol=1e-4, rtol=0)
    top = reference.topk(max(nums), dim=-1)
    assert out.top_logprobs.shape == out.top_logprob_ids.shape == (6, max(nums))
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs.double(), top.values, atol=1e-4, rtol=0)


def test_logprobs_of_a_greedy_batch() -> None:
    logits = random_logits(3, seed=5)
    batch = make_info(3, temperatures=[0.0] * 3, return_logprob=[True] * 3)
    out = Sampler(CPU, seed=0)(logits, batch)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.token_logprobs is not None and out.top_logprobs is not None
    expected = torch.log_softmax(logits.double(), dim=-1).max(dim=-1).values
    torch.testing.assert_close(out.token_logprobs.double(), expected, atol=1e-4, rtol=0)
    assert out.top_logprobs.shape == (3, 0)


def _reference_support(
    logits: torch.Tensor, temp: float, top_p: float, top_k: int, min_p: float
) -> set[int]:
    """float64: the top_k likeliest tokens, then the smallest prefix of them whose renormalised
    probability reaches top_p, then those at least min_p times as likely as the likeliest."""
    probs = (logits.double() / temp).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_mass = sum(probs[i].item() for i in order)
    support, mass = [], 0.0
    for i in order:
        support.append(i)
        mass += probs[i].item() / kept_mass
        if mass >= top_p:
            break
    top = probs[support[0]].item()
    return {i for i in support if probs[i].item() >= min_p * top}


def _splitmix64_finaliser(z: int) -> int:
    mask = 2**64 - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _reference_kept(probs: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """float64, one row, the whole vocabulary sorted: the set top_k then top_p keep."""
    p = probs.double()
    order = p.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    if top_p >= 1:
        return set(order)  # top_p 1 filters nothing
    mass = sum(p[i].item() for i in order)
    kept, before = set(), 0.0
    for i in order:
        if before < top_p * mass:
            kept.add(i)
        before += p[i].item()
    return kept


@pytest.mark.parametrize("sharpness", [8.0, 0.05])  # a peaked row, and a nearly flat one
def test_filter_on_a_large_vocabulary_keeps_the_reference_set(sharpness) -> None:
    vocab = 5000  # larger than FILTER_CANDIDATES: the topk path, or its full-sort fallback
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * sharpness
    probs = torch.softmax(logits, dim=-1)
    top_ks = torch.tensor([-1, -1, 40, 2000, -1, 1])
    top_ps = torch.tensor([0.9, 0.5, 0.8, 0.95, 1.0, 0.3])
    top_ps[4] = 0.999  # _filter serves filtering rows; top_p 1 without top_k never comes in
    values, ids = _filter(probs, top_ks, top_ps)
    for row in range(6):
        kept = values[row] > 0
        got = set(ids[row][kept].tolist())
        assert got == _reference_kept(probs[row], int(top_ks[row]), float(top_ps[row])), row
        assert torch.equal(values[row][kept], probs[row][ids[row][kept]])


def test_a_tiny_temperature_is_greedy() -> None:
    """Below 1e-5 a temperature means greedy, as in vLLM and SGLang: dividing logits by 1e-38
    overflows float32, and the softmax of infinities is NaN."""
    logits = random_logits(4, seed=6) * 10
    logits[0, 7] = 40.0  # not the first column: a NaN row's argmax would be column 0
    batch = make_info(4, temperatures=[1e-38, 1e-30, 1.0, 9e-6], seeded=[True, False, True, False])
    for _ in range(5):
        out = Sampler(CPU, seed=0)(logits, batch).next_token_ids
        assert out[[0, 1, 3]].tolist() == logits[[0, 1, 3]].argmax(-1).tolist()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperatures": [0.0] * 6},  # greedy: the argmax of the bfloat16 logits themselves
        {"temperatures": [0.0] * 6, "return_logprob": [True] * 6},
        {"temperatures": [0.0, 0.7, 1.0, 0.0, 1.3, 0.9], "top_ps": [1.0, 0.9, 1.0, 1, 0.5, 1]},
        {
            "temperatures": [0.8] * 6,
            "repetition_penalties": [1.3] * 6,
            "seen": {2: SeenTokens.of([5, 9, 9], [])},
        },
    ],
    ids=["greedy", "greedy-logprobs", "sampled", "penalised"],
)
def test_bfloat16_logits_give_what_their_float32_gives(fields) -> None:
    """The model hands its logits over in its own dtype: every path gives the same tokens and
    logprobs as on those logits converted to float32 (exactly) first, ties included (bfloat16
    rounds many logits to one value; the first index wins)."""
    logits = (random_logits(6, seed=9, vocab=300) * 4).to(torch.bfloat16)
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie for the max
    outs = [
        Sampler(CPU, seed=3)(given, make_info(6, **fields)) for given in (logits, logits.float())
    ]
    assert torch.equal(outs[0].next_token_ids, outs[1].next_token_ids)
    for name in ("token_logprobs", "top_logprobs"):
        a, b = getattr(outs[0], name), getattr(outs[1], name)
        assert (a is None and b is None) or torch.equal(a, b)
    if fields["temperatures"][1] == 0.0:
        assert outs[0].next_token_ids[1] == 7
