"""Property-based: random arrivals, prompt lengths, max_new_tokens, aborts and small KV pools that
force chunking and retraction, with the invariant checker on after every step."""

from __future__ import annotations

from fake_worker import reference_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import gen, make_scheduler

request = st.fixed_dictionaries(
    {
        "arrival": st.integers(0, 30),  # step at which it arrives
        "prompt_len": st.integers(1, 160),
        "max_new": st.integers(0, 40),
        "abort_at": st.none() | st.integers(0, 60),
        "stream": st.booleans(),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=14),
    pool=st.integers(48, 700),
    running=st.integers(1, 12),
    chunk=st.integers(1, 64),
    budget=st.integers(12, 160),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_every_invariant(requests, pool, running, chunk, budget, seed):
    s = make_scheduler(pool=pool, running=running, budget=budget, chunk=chunk, context=256)
    prompts = {
        f"r{i}": [(seed * 7 + i * 13 + j * 31) % 999 + 1 for j in range(r["prompt_len"])]
        for i, r in enumerate(requests)
    }
    finals: dict[str, list] = {}
    tokens: dict[str, list[int]] = {}
    refused: set[str] = set()
    step = 0
    while step < 20_000:
        for i, r in enumerate(requests):
            rid = f"r{i}"
            if r["arrival"] == step:
                msg = gen(rid, prompts[rid], r["max_new"])
                msg.stream = r["stream"]
                if s.add_request(msg) is not None:
                    refused.add(rid)
            if r["abort_at"] == step and r["arrival"] <= step:
                s.abort(rid)
        s.step()  # checks the invariants
        for out in s.outbox:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished_reason is not None:
                finals.setdefault(out.rid, []).append(out.finished_reason)
        s.outbox = []
        step += 1
        if step > 31 and not s.has_unfinished():
            break
    assert not s.has_unfinished(), "did not drain: deadlock or livelock"
    assert s.kv.available == pool
    assert s.kv.req_to_token_pool.num_free == s.config.max_running_requests

    for i, r in enumerate(requests):
        rid = f"r{i}"
        peak = min(r["prompt_len"] + r["max_new"], 256)
        too_long = r["prompt_len"] >= 256 or peak > pool
        assert (rid in refused) == too_long, rid
        if too_long:
            assert rid not in finals
            continue
        assert len(finals[rid]) == 1, f"{rid} got {len(finals[rid])} final replies"
        got = tokens.get(rid, [])
        expected = reference_tokens(prompts[rid], min(r["max_new"], 256 - r["prompt_len"]))
        if finals[rid][0].type == "abort":
            assert got == expected[: len(got)]  # a prefix of what it would have said
        else:
            assert got == expected
