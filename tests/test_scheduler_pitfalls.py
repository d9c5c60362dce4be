"""Seed 000 §5.7, the nine pitfalls of a continuous-batching scheduler: one test each, written so
that reintroducing the pitfall makes it fail. Real scheduler and pools, fake model worker."""

from __future__ import annotations

import random

import torch
from fake_worker import EOS, reference_tokens
from test_scheduler import gen, make_scheduler, run_to_completion, tokens_of


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def test_1_prefill_advances_by_its_length_not_by_one():
    s = make_scheduler()
    s.add_request(gen("a", _prompt(37), 5))
    s.step()
    (req,) = s.running
    assert req.num_computed_tokens == 37
    s.step()
    assert req.num_computed_tokens == 38


def test_2_every_token_is_computed_exactly_once():
    """Not advancing before the next step re-prefills forever; here the total work is exact."""
    s = make_scheduler(chunk=16)
    p = _prompt(50)
    s.add_request(gen("a", p, 20))
    run_to_completion(s)
    assert sum(int(b.extend_lens.sum()) for b in s.worker.batches) == len(p) + 20 - 1


def test_3_prefill_chunks_feed_the_prompt_not_the_last_output():
    s = make_scheduler(chunk=16, budget=64)
    p = _prompt(50)
    s.add_request(gen("a", p, 3))
    run_to_completion(s)
    chunks = [b.input_ids.tolist() for b in s.worker.batches[:4]]
    assert [t for c in chunks for t in c] == p


def test_4_kv_padding_points_at_the_reserved_slot_only():
    s = make_scheduler()
    s.add_request(gen("short", _prompt(3, 1), 4))
    s.add_request(gen("long", _prompt(40, 2), 4))
    s.step()
    batch = s.worker.batches[-1]
    seq_lens = batch.seq_lens
    for i in range(batch.batch_size):
        pad = batch.kv_slots[i, seq_lens[i] :]
        assert pad.numel() == 0 or bool((pad == 0).all())
    assert batch.kv_slots.shape[1] == int(seq_lens.max())


def test_5_no_step_writes_over_kv_a_running_request_holds():
    s = make_scheduler(pool=400, chunk=32, budget=96)
    for i in range(8):
        s.add_request(gen(f"r{i}", _prompt(30 + 7 * i, i), 25))
    rows = s.kv.req_to_token_pool.req_to_token
    while s.has_unfinished():
        held = {r: set(rows[r.kv.row, : r.num_computed_tokens].tolist()) for r in s.running}
        s.step()
        new = set(s.worker.batches[-1].out_cache_loc.tolist())
        # A request retracted in this step gave its KV up; every other one kept it.
        kept = [slots for r, slots in held.items() if r not in s.waiting]
        assert not set().union(*kept) & new, "a slot holding a request's KV was handed out again"
    assert s.stats.num_retractions > 0, "the pool is meant to be small enough to force retraction"


def test_6_per_request_sampling_rows_match_the_batch():
    s = make_scheduler()
    s.add_request(gen("a", _prompt(5), 4, temperature=0.5, top_k=3))
    s.step()
    s.add_request(gen("b", _prompt(20), 4, top_p=0.9))
    s.step()
    batch = s.worker.batches[-1]
    sampling = batch.sampling
    assert batch.batch_size == 2
    assert sampling.temperatures.tolist() == [0.5, 0.0]
    assert sampling.top_ks.tolist() == [3, -1]
    assert torch.allclose(sampling.top_ps, torch.tensor([1.0, 0.9]))


def test_7_eos_in_the_prompt_or_as_padding_does_not_stop_a_request():
    s = make_scheduler()
    p = [EOS] * 10 + [7]  # the padding slot and the EOS id are both 0 in the fake model
    s.add_request(gen("a", p, 12, ignore_eos=False))
    outs = run_to_completion(s)["a"]
    assert tokens_of(outs) == reference_tokens(p, 12)
    assert outs[-1].finished_reason.type == "length"


def test_8_every_sequence_of_a_batch_gets_its_own_token():
    s = make_scheduler()
    prompts = [_prompt(n, n) for n in (5, 1, 3)]
    for i, p in enumerate(prompts):
        s.add_request(gen(f"r{i}", p, 4))
    s.step()
    assert s.worker.batches[0].batch_size == 3
    for i, p in enumerate(prompts):
        req = next(r for r in s.running if r.rid == f"r{i}")
        assert req.output_ids == reference_tokens(p, 1)


def test_9_a_fresh_prefill_reserves_its_whole_length():
    s = make_scheduler(pool=1000)
    s.add_request(gen("a", _prompt(64), 4))
    batch = s.get_next_batch_to_run()
    assert batch.num_tokens == 64
    assert s.kv.allocator.num_free == 1000 - 64
