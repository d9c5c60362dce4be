"""Penalties: the same logits as transformers' RepetitionPenaltyLogitsProcessor and a float64
formula, and per-row state kept step by step equal to state rebuilt from scratch."""

from __future__ import annotations

from collections import Counter

import torch
from test_sampler import CPU, make_info, random_logits
from transformers import RepetitionPenaltyLogitsProcessor

from radixserve.model_worker.batch import PenaltyInit
from radixserve.model_worker.penalties import PenaltyState, penalised_rows
from radixserve.model_worker.sampler import Sampler


def histories(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, outputs) per row, from a small alphabet so tokens repeat."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int, min_len: int, max_len: int) -> list[int]:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        return torch.randint(low, high, (length,), generator=gen).tolist()

    return [(tokens(0, 20, 1, 15), tokens(10, 30, 0, 10)) for _ in range(n)]


def output_tokens(sampler: Sampler, row: int) -> dict[int, int]:
    """Row `row`'s counted output tokens."""
    seen = sampler.penalties.rows[row]
    counted = seen.output_counts > 0
    return dict(zip(seen.ids[counted].tolist(), seen.output_counts[counted].tolist()))


def penalised_from_scratch(logits: torch.Tensor, **fields: object) -> torch.Tensor:
    """The logits penalised by a fresh state, rebuilt from the batch's PenaltyInits."""
    info = make_info(logits.shape[0], **fields)
    return PenaltyState().apply(logits, info, penalised_rows(info))


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(5, seed=10)
    penalties = [1.3, 0.8, 2.0, 1.1, 1.0]  # the last row has none
    rows = histories(5, seed=11)
    inits = [PenaltyInit(i, p, o) for i, (p, o) in enumerate(rows)]
    ours = penalised_from_scratch(
        logits, repetition_penalties=penalties, req_rows=[3, 0, 7, 1, 2], penalty_inits=inits
    )
    for i, (prompt, outputs) in enumerate(rows):
        process = RepetitionPenaltyLogitsProcessor(penalty=penalties[i])
        expected = process(torch.tensor([prompt + outputs]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected, atol=1e-6, rtol=0)
    assert not torch.equal(ours[:4], logits[:4])


def test_all_penalties_match_a_float64_formula() -> None:
    logits = random_logits(4, seed=12)
    rep, freq, pres = [1.2, 1.0, 0.9, 1.0], [0.5, 0.0, -0.3, 1.0], [0.0, 0.7, 0.4, -0.2]
    rows = histories(4, seed=13)
    inits = [PenaltyInit(i, p, o) for i, (p, o) in enumerate(rows)]
    ours = penalised_from_scratch(
        logits,
        repetition_penalties=rep,
        frequency_penalties=freq,
        presence_penalties=pres,
        penalty_inits=inits,
    )
    expected = logits.double().clone()
    for i, (prompt, outputs) in enumerate(rows):
        for token in set(prompt + outputs):
            x = expected[i, token].item()
            expected[i, token] = x / rep[i] if x > 0 else x * rep[i]
        for token, count in Counter(outputs).items():
            expected[i, token] -= freq[i] * count + pres[i]
    torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=0)


def dense_reference(
    logits: torch.Tensor,
    rows: list[tuple[list[int], list[int]]],
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
) -> torch.Tensor:
    """The penalties over the whole vocabulary in float64, from dense per-row output counts and
    seen-token masks: the formula the sparse state must equal."""
    vocab = logits.shape[-1]
    counts = torch.stack(
        [torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=vocab) for _, o in rows]
    ).double()
    seen = counts > 0
    for i, (prompt, _) in enumerate(rows):
        seen[i, prompt] = True
    x = logits.double()
    r = rep.double()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - freq.double()[:, None] * counts - pres.double()[:, None] * (counts > 0)


def test_large_vocabulary_state_kept_step_by_step_equals_the_dense_formula() -> None:
    """32 penalised rows among 40 over a 49152-token vocabulary, each with a few hundred seen
    tokens: rebuilt from PenaltyInits (some with outputs, as recomputes), then five steps that
    record repeated and new tokens (a chunk row's not), each equal to the dense formula."""
    vocab, n = 49152, 40
    gen = torch.Generator().manual_seed(16)
    order = torch.randperm(n, generator=gen)
    penalised, unpenalised = order[:32], order[32:]
    rep, freq, pres = torch.ones(n), torch.zeros(n), torch.zeros(n)
    rep[penalised] = 0.5 + torch.rand(32, generator=gen) * 1.5
    freq[penalised] = torch.rand(32, generator=gen) * 4 - 2
    pres[penalised] = torch.rand(32, generator=gen) * 4 - 2
    # Each row draws from its own 300 tokens, so its prompt and outputs repeat and overlap.
    alphabets = torch.randint(0, vocab, (n, 300), generator=gen)

    def draw(i: int, length: int) -> list[int]:
        return alphabets[i, torch.randint(0, 300, (length,), generator=gen)].tolist()

    rows = [(draw(i, 200), draw(i, i % 3 * 20)) for i in range(n)]
    fields = {
        "repetition_penalties": rep,
        "frequency_penalties": freq,
        "presence_penalties": pres,
        "req_rows": torch.randperm(100, generator=gen)[:n],
    }
    state = PenaltyState()
    for step in range(6):
        first = step == 0
        emits = [not (first and i % 5 == 0) for i in range(n)]
        inits = [PenaltyInit(i, p, list(o)) for i, (p, o) in enumerate(rows)] if first else []
        info = make_info(n, emits_token=emits, penalty_inits=inits, **fields)
        logits = random_logits(n, seed=200 + step, vocab=vocab)
        ours = state.apply(logits, info, penalised_rows(info))
        expected = dense_reference(logits, rows, rep, freq, pres)
        torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=0)
        assert torch.equal(ours[unpenalised], logits[unpenalised])
        # Odd steps repeat a seen token; even ones mostly bring a new one.
        fresh = torch.randint(0, vocab, (n,), generator=gen).tolist()
        tokens = [draw(i, 1)[0] if step % 2 else fresh[i] for i in range(n)]
        state.record(torch.tensor(tokens), info, penalised_rows(info))
        for i in penalised.tolist():
            if emits[i]:
                rows[i][1].append(tokens[i])
    assert state.num_rows == 32


def test_state_kept_step_by_step_equals_state_rebuilt_from_scratch() -> None:
    """A (row 5) starts with its prompt, B (row 0) is a recompute that brings outputs, C (row 2)
    prefills in two chunks, D (row 1) has no penalty; then six decode steps. The kept state gives
    the same penalised logits as a fresh state built from each request's whole history."""
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (6, 4, 9, 5)]
    outputs: list[list[int]] = [[], [7, 7, 31], [], []]
    params = {
        "repetition_penalties": [1.4, 1.0, 1.2, 1.0],
        "frequency_penalties": [0.3, 0.6, 0.0, 0.0],
        "presence_penalties": [0.0, 0.5, 0.2, 0.0],
        "req_rows": [5, 0, 2, 1],
    }
    sampler = Sampler(CPU, seed=0)
    for step in range(7):
        first = step == 0
        inits = [PenaltyInit(i, prompts[i], list(outputs[i])) for i in range(4)] if first else []
        emits = [True, True, not first, True]  # C's first chunk: its sample is discarded
        info = make_info(
            4,
            temperatures=[1.0, 0.0, 2.0, 1.0],
            emits_token=emits,
            output_index=[len(o) for o in outputs],
            penalty_inits=inits,
            **params,
        )
        tokens = sampler(random_logits(4, seed=100 + step), info).next_token_ids.tolist()
        for i in range(4):
            if emits[i]:
                outputs[i].append(tokens[i])

    assert sorted(sampler.penalties.rows) == [0, 2, 5], "D has no penalty: its row is untouched"
    logits = random_logits(4, seed=99)
    info = make_info(4, **params)
    kept = sampler.penalties.apply(logits, info, penalised_rows(info))
    inits = [PenaltyInit(i, prompts[i], outputs[i]) for i in range(4)]
    fresh = penalised_from_scratch(logits, penalty_inits=inits, **params)
    torch.testing.assert_close(kept, fresh, atol=0, rtol=0)
    for i, row in enumerate(params["req_rows"][:3]):
        seen = sampler.penalties.rows[row]
        assert seen.ids.tolist() == sorted(set(prompts[i] + outputs[i])), f"request {i}"
        assert seen.output_counts.sum() == len(outputs[i]), f"request {i}"


def test_a_prefill_chunk_does_not_count_its_token() -> None:
    sampler = Sampler(CPU, seed=0)
    chunk = make_info(
        1,
        temperatures=[0.0],
        presence_penalties=[1.0],
        emits_token=[False],
        penalty_inits=[PenaltyInit(0, [1, 2, 3], [])],
    )
    sampler(random_logits(1), chunk)
    assert output_tokens(sampler, 0) == {}
    decode = make_info(1, temperatures=[0.0], presence_penalties=[1.0])
    token = int(sampler(random_logits(1), decode).next_token_ids[0])
    assert output_tokens(sampler, 0) == {token: 1}


def test_a_reused_row_is_rebuilt() -> None:
    sampler = Sampler(CPU, seed=0)
    old = {"frequency_penalties": [1.0], "repetition_penalties": [1.5], "req_rows": [2]}
    sampler(random_logits(1), make_info(1, penalty_inits=[PenaltyInit(0, [1, 2, 3], [4])], **old))
    for step in range(3):
        sampler(random_logits(1, seed=step), make_info(1, **old))
    assert sum(output_tokens(sampler, 2).values()) == 5  # the init's output and 4 samples

    # Another request now owns row 2, in a batch where it is the second sequence.
    new = make_info(
        2,
        presence_penalties=[0.0, 0.5],
        req_rows=[0, 2],
        emits_token=[True, False],
        penalty_inits=[PenaltyInit(1, [7, 8], [])],
    )
    sampler(random_logits(2), new)
    assert output_tokens(sampler, 2) == {}
    assert sampler.penalties.rows[2].ids.tolist() == [7, 8]


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = random_logits(3, seed=15)
    top = logits.argmax(-1).tolist()
    fields = {
        "temperatures": [0.0, 0.0, 1.0],
        "repetition_penalties": [100.0, 1.0, 1.0],
        "frequency_penalties": [0.0, 100.0, 0.0],
        "penalty_inits": [PenaltyInit(0, [top[0]], []), PenaltyInit(1, [5], [top[1]])],
    }
    penalised = penalised_from_scratch(logits, **fields)
    for info in (make_info(3, **fields), make_info(2, **{k: v[:2] for k, v in fields.items()})):
        out = Sampler(CPU, seed=0)(logits[: info.req_rows.numel()], info).next_token_ids
        assert out[:2].tolist() == penalised[:2].argmax(-1).tolist()
        assert out[0] != top[0] and out[1] != top[1]


def test_batches_without_penalties_allocate_no_state() -> None:
    sampler = Sampler(CPU, seed=0)
    info = make_info(4, top_ks=[5] * 4, min_ps=[0.1] * 4, return_logprob=[True] * 4)
    sampler(random_logits(4), info)
    assert sampler.penalties.num_rows == 0
