from __future__ import annotations

import torch

from model_worker.batch import SamplingBatchInfo
from model_worker.sampler import sample

VOCAB = 50


def info(temps: list[float], top_ps: list[float], top_ks: list[int]) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        is_all_greedy=all(t == 0 for t in temps),
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_argmax() -> None:
    logits = random_logits(8)
    out = sample(logits, info([0.0] * 8, [1.0] * 8, [-1] * 8))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_and_top_k_1_are_argmax_in_a_sampled_batch() -> None:
    logits = random_logits(4)
    gen = torch.Generator().manual_seed(0)
    batch = info([0.0, 1.5, 0.7, 1.0], [1.0, 1.0, 0.3, 1.0], [-1, 1, 1, -1])
    assert not batch.is_all_greedy
    for _ in range(50):
        out = sample(logits, batch, gen)
        assert torch.equal(out[:3], logits[:3].argmax(-1))


def test_top_k_and_top_p_keep_exactly_the_reference_set() -> None:
    logits = random_logits(4, seed=1)
    temps, top_ps, top_ks = [1.0, 0.8, 1.3, 1.0], [0.7, 0.9, 1.0, 0.75], [-1, 10, 5, 20]
    draws = 4000  # as many copies of each row in one batch
    batch = info(temps * draws, top_ps * draws, top_ks * draws)
    seen = sample(logits.repeat(draws, 1), batch, torch.Generator().manual_seed(0)).view(draws, 4)
    for row in range(4):
        support = _reference_support(logits[row], temps[row], top_ps[row], top_ks[row])
        assert set(seen[:, row].tolist()) == support, f"row {row}"


def test_unfiltered_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]])
    draws = 6000
    batch = info([1.0] * draws, [1.0] * draws, [-1] * draws)
    seen = sample(logits.repeat(draws, 1), batch, torch.Generator().manual_seed(0))
    freq = torch.bincount(seen, minlength=4).double() / seen.numel()
    torch.testing.assert_close(freq, logits[0].double().softmax(-1), atol=0.02, rtol=0)


def _reference_support(logits: torch.Tensor, temp: float, top_p: float, top_k: int) -> set[int]:
    """float64: the top_k likeliest tokens, then the smallest prefix of them whose renormalised
    probability reaches top_p."""
    probs = (logits.double() / temp).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    kept_mass = sum(probs[i].item() for i in order)
    support, mass = set(), 0.0
    for i in order:
        support.add(i)
        mass += probs[i].item() / kept_mass
        if mass >= top_p:
            break
    return support
