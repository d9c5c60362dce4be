"""The radix prefix cache inside the real scheduler, with the fake model worker: shared prefixes
are computed once, eviction under pressure, lpm, and outputs that never change."""

from __future__ import annotations

import random

import pytest
from fake_worker import reference_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import gen, make_scheduler, run_to_completion, tokens_of


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def computed_tokens(s) -> int:
    return sum(int(b.extend_lens.sum()) for b in s.worker.batches)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_shared_prefix_is_computed_once(page_size):
    system = _tokens(200, 0)
    a, b = system + _tokens(20, 1), system + _tokens(20, 2)
    s = make_scheduler(page_size=page_size)
    s.add_request(gen("a", a, 8))
    outs = run_to_completion(s)
    s.add_request(gen("b", b, 8))
    outs |= run_to_completion(s)
    assert tokens_of(outs["a"]) == reference_tokens(a, 8)
    assert tokens_of(outs["b"]) == reference_tokens(b, 8)
    cached = outs["b"][0].start.cached_tokens
    assert cached == 200 // page_size * page_size
    assert computed_tokens(s) == (len(a) + 7) + (len(b) - cached + 7)


def test_disabled_cache_computes_everything_and_says_the_same():
    system = _tokens(100, 0)
    prompts = {f"r{i}": system + _tokens(10, i + 1) for i in range(4)}
    results = {}
    for enabled in (True, False):
        s = make_scheduler(enable_radix_cache=enabled)
        for rid, p in prompts.items():
            s.add_request(gen(rid, p, 6))
            s.step()  # arrive one after another, so later ones can hit the cache
        outs = run_to_completion(s)
        results[enabled] = ({rid: tokens_of(o) for rid, o in outs.items()}, computed_tokens(s))
    assert results[True][0] == results[False][0]
    assert results[False][1] == sum(len(p) + 5 for p in prompts.values())
    assert results[True][1] < results[False][1] - 250


def test_eviction_under_pressure_keeps_outputs_and_invariants():
    systems = [_tokens(60, 100 + k) for k in range(3)]
    s = make_scheduler(pool=400, running=8, budget=128, chunk=64)
    prompts = {}
    for i in range(18):
        prompts[f"r{i}"] = systems[i % 3] + _tokens(15, i)
        s.add_request(gen(f"r{i}", prompts[f"r{i}"], 20))
        if i % 4 == 3:
            for _ in range(5):
                s.step()
    outs = run_to_completion(s)
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 20), rid
    assert s.kv.num_evicted_tokens > 0
    assert sum(outs[rid][0].start.cached_tokens for rid in prompts) > 0


def test_a_retracted_request_keeps_its_prefix_for_the_recompute():
    s = make_scheduler(pool=300, running=8, budget=128, chunk=64)
    prompts = {f"r{i}": _tokens(40, i) for i in range(6)}
    for rid, p in prompts.items():
        s.add_request(gen(rid, p, 40))
    outs = run_to_completion(s)
    assert s.stats.num_retractions > 0
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 40)
    # the recomputes were served from the tree, not recomputed from scratch
    assert (
        computed_tokens(s)
        < sum(len(p) + 39 for p in prompts.values()) + 40 * s.stats.num_retractions
    )


def test_lpm_admits_the_longest_prefix_match_first():
    system = _tokens(80, 0)
    s = make_scheduler(schedule_policy="lpm", running=1)
    s.add_request(gen("warm", system + [1], 1))
    run_to_completion(s)
    s.add_request(gen("cold", _tokens(81, 5), 2))
    s.add_request(gen("hot", system + [2], 2))
    s.step()
    assert [r.rid for r in s.running] == ["hot"]


def test_flush_cache_empties_the_tree_only_when_idle():
    s = make_scheduler()
    s.add_request(gen("a", _tokens(50, 0), 30))
    s.step()
    assert not s.flush_cache()
    run_to_completion(s)
    assert s.kv.tree_cache.total_size > 0
    assert s.flush_cache()
    assert s.kv.tree_cache.total_size == 0 and s.kv.allocator.num_free == s.config.max_total_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 25), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    pool=st.integers(150, 600),
    chunk=st.integers(8, 64),
    page_size=st.sampled_from([1, 16]),
    policy=st.sampled_from(["fcfs", "lpm"]),
)
def test_random_shared_prefix_workloads(shapes, pool, chunk, page_size, policy):
    systems = [_tokens(n, 50 + n) for n in (0, 17, 33, 64)]
    s = make_scheduler(
        pool=pool, running=6, budget=96, chunk=chunk, page_size=page_size, schedule_policy=policy
    )
    prompts = {}
    for i, (sys_idx, tail, max_new, abort) in enumerate(shapes):
        prompts[f"r{i}"] = (systems[sys_idx] + _tokens(tail, i))[:120] or [7]
        assert s.add_request(gen(f"r{i}", prompts[f"r{i}"], max_new)) is None
        s.step()
        if abort:
            s.abort(f"r{i - 1}")
    outs = run_to_completion(s)
    for i, (_, _, max_new, _) in enumerate(shapes):
        rid = f"r{i}"
        finals = [o for o in outs[rid] if o.finished_reason is not None]
        assert len(finals) == 1
        got, expected = tokens_of(outs[rid]), reference_tokens(prompts[rid], max_new)
        assert got == (
            expected if finals[0].finished_reason.type != "abort" else expected[: len(got)]
        )
    assert s.kv.available == pool


def test_requests_arriving_together_compute_their_shared_prefix_once():
    system = _tokens(100, 0)
    prompts = {f"r{i}": system + _tokens(10, i + 1) for i in range(8)}
    s = make_scheduler(budget=2048, chunk=2048)
    for rid, p in prompts.items():
        s.add_request(gen(rid, p, 4))
    outs = run_to_completion(s)
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 4)
    assert s.stats.num_prefill_tokens == 100 + 8 * 10
