"""Penalties: the same logits as transformers' RepetitionPenaltyLogitsProcessor and a float64
formula, and the seen tokens the scheduler keeps per request, step by step, equal to those
rebuilt from its history."""

from __future__ import annotations

from collections import Counter

import torch
from test_sampler import CPU, make_info, random_logits
from test_scheduler import gen, make_scheduler
from transformers import RepetitionPenaltyLogitsProcessor

from radixserve.model_worker.penalties import apply_penalties
from radixserve.model_worker.sampler import Sampler
from radixserve.scheduler.seen_tokens import SeenTokens


def histories(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, outputs) per row, from a small alphabet so tokens repeat."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int, min_len: int, max_len: int) -> list[int]:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        return torch.randint(low, high, (length,), generator=gen).tolist()

    return [(tokens(0, 20, 1, 15), tokens(10, 30, 0, 10)) for _ in range(n)]


def output_tokens(seen: SeenTokens) -> dict[int, int]:
    """The counted output tokens."""
    counted = seen.output_counts > 0
    return dict(zip(seen.ids[counted].tolist(), seen.output_counts[counted].tolist()))


def seen_of(rows: list[tuple[list[int], list[int]]]) -> dict[int, SeenTokens]:
    return {i: SeenTokens.of(prompt, outputs) for i, (prompt, outputs) in enumerate(rows)}


def penalised(logits: torch.Tensor, **fields: object) -> torch.Tensor:
    return apply_penalties(logits, make_info(logits.shape[0], **fields))


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(5, seed=10)
    penalties = [1.3, 0.8, 2.0, 1.1, 1.0]  # the last row has none
    rows = histories(5, seed=11)
    ours = penalised(logits, repetition_penalties=penalties, seen=seen_of(rows))
    for i, (prompt, outputs) in enumerate(rows):
        process = RepetitionPenaltyLogitsProcessor(penalty=penalties[i])
        expected = process(torch.tensor([prompt + outputs]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected, atol=1e-6, rtol=0)
    assert not torch.equal(ours[:4], logits[:4])


def test_all_penalties_match_a_float64_formula() -> None:
    logits = random_logits(4, seed=12)
    rep, freq, pres = [1.2, 1.0, 0.9, 1.0], [0.5, 0.0, -0.3, 1.0], [0.0, 0.7, 0.4, -0.2]
    rows = histories(4, seed=13)
    ours = penalised(
        logits,
        repetition_penalties=rep,
        frequency_penalties=freq,
        presence_penalties=pres,
        seen=seen_of(rows),
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
    tokens: built from their histories (some with outputs, as recomputes), then five steps that
    add repeated and new tokens (a chunk row's not), each equal to the dense formula."""
    vocab, n = 49152, 40
    gen_ = torch.Generator().manual_seed(16)
    order = torch.randperm(n, generator=gen_)
    penalised_rows, unpenalised = order[:32], order[32:]
    rep, freq, pres = torch.ones(n), torch.zeros(n), torch.zeros(n)
    rep[penalised_rows] = 0.5 + torch.rand(32, generator=gen_) * 1.5
    freq[penalised_rows] = torch.rand(32, generator=gen_) * 4 - 2
    pres[penalised_rows] = torch.rand(32, generator=gen_) * 4 - 2
    # Each row draws from its own 300 tokens, so its prompt and outputs repeat and overlap.
    alphabets = torch.randint(0, vocab, (n, 300), generator=gen_)

    def draw(i: int, length: int) -> list[int]:
        return alphabets[i, torch.randint(0, 300, (length,), generator=gen_)].tolist()

    rows = [(draw(i, 200), draw(i, i % 3 * 20)) for i in range(n)]
    fields = {"repetition_penalties": rep, "frequency_penalties": freq, "presence_penalties": pres}
    kept = {i: SeenTokens.of(*rows[i]) for i in penalised_rows.tolist()}
    for step in range(6):
        emits = [not (step == 0 and i % 5 == 0) for i in range(n)]
        info = make_info(n, seen=kept, **fields)
        logits = random_logits(n, seed=200 + step, vocab=vocab)
        ours = apply_penalties(logits, info)
        expected = dense_reference(logits, rows, rep, freq, pres)
        torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=0)
        assert torch.equal(ours[unpenalised], logits[unpenalised])
        assert info.penalty_tokens is not None
        assert set(info.penalty_tokens.batch_rows.tolist()) == set(penalised_rows.tolist())
        # Odd steps repeat a seen token; even ones mostly bring a new one.
        fresh = torch.randint(0, vocab, (n,), generator=gen_).tolist()
        tokens = [draw(i, 1)[0] if step % 2 else fresh[i] for i in range(n)]
        for i in penalised_rows.tolist():
            if emits[i]:
                rows[i][1].append(tokens[i])
                kept[i] = kept[i].with_output(tokens[i])


def test_the_scheduler_keeps_each_requests_seen_tokens_equal_to_its_history() -> None:
    """Penalised requests through the real scheduler: one prefilled in chunks (a chunk's sample is
    no output), rows reused by later requests, and retractions (the recompute keeps its state).
    Before every step the batch carries each penalised request's seen tokens, equal to those
    rebuilt from its prompt and outputs so far; unpenalised requests carry none."""
    s = make_scheduler(pool=200, running=3, budget=64, chunk=24)
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}
    prompts = {f"r{i}": [(7 * i + 3 * j) % 40 + 1 for j in range(10 + 9 * i)] for i in range(6)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        s.add_request(gen(rid, prompt, 30, **(penalties if i % 3 else {})))
    chunked = False
    while s.has_unfinished():
        batch = s.step()
        assert batch is not None
        info = s.worker.batches[-1].sampling
        seen = info.penalty_tokens
        for i, req in enumerate(batch.reqs):
            rows = seen.batch_rows == i if seen is not None else torch.zeros(0, dtype=torch.bool)
            if req.seen is None:
                assert not rows.any(), f"{req.rid} has no penalty"
                continue
            assert seen is not None
            outputs = req.output_ids[: int(batch.columns[3][i])]  # its outputs as the step began
            expected = SeenTokens.of(req.origin_input_ids, outputs)
            assert seen.token_ids[rows].tolist() == expected.ids.tolist(), req.rid
            assert seen.output_counts[rows].tolist() == expected.output_counts.tolist(), req.rid
            chunked |= not batch.emits[i]
        for req in s.running:
            if req.seen is not None:
                assert output_tokens(req.seen) == output_tokens(
                    SeenTokens.of(req.origin_input_ids, req.output_ids)
                )
        s.outbox = []
    assert chunked and s.stats.num_retractions > 0


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = random_logits(3, seed=15)
    top = logits.argmax(-1).tolist()
    fields = {
        "temperatures": [0.0, 0.0, 1.0],
        "repetition_penalties": [100.0, 1.0, 1.0],
        "frequency_penalties": [0.0, 100.0, 0.0],
    }
    seen = {0: SeenTokens.of([top[0]], []), 1: SeenTokens.of([5], [top[1]])}
    penalised_logits = penalised(logits, seen=seen, **fields)
    for n in (3, 2):
        info = make_info(n, seen=seen, **{k: v[:n] for k, v in fields.items()})
        out = Sampler(CPU, seed=0)(logits[:n], info).next_token_ids
        assert out[:2].tolist() == penalised_logits[:2].argmax(-1).tolist()
        assert out[0] != top[0] and out[1] != top[1]


def test_batches_without_penalties_carry_no_seen_tokens() -> None:
    s = make_scheduler()
    s.add_request(gen("a", [1, 2, 3], 4, top_k=5, min_p=0.1))
    s.step()
    assert s.running[0].seen is None
    assert s.worker.batches[-1].sampling.penalty_tokens is None


def test_seen_tokens_are_immutable_so_a_built_batch_keeps_what_it_saw() -> None:
    before = SeenTokens.of([1, 2], [2])
    after = before.with_output(2).with_output(9)
    assert output_tokens(before) == {2: 1}
    assert output_tokens(after) == {2: 2, 9: 1}
    assert after.ids.tolist() == [1, 2, 9]
