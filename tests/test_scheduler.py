"""The real scheduler and pools, driven with a fake model worker (tests/fake_worker.py)."""

from __future__ import annotations

import random

import pytest
from fake_worker import EOS, FakeModelWorker, reference_tokens

from radixserve.protocol.internal import TokenizedGenerateReq
from radixserve.protocol.wire import MAX_OUTPUT_TOP_LOGPROBS, SamplingParams
from radixserve.scheduler.kv_manager import InvariantError
from radixserve.scheduler.prefill_adder import NewTokenRatio
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig


def make_scheduler(
    pool=4096, running=64, budget=512, chunk=256, context=2048, **options
) -> Scheduler:
    config = SchedulerConfig(
        max_total_tokens=pool,
        max_running_requests=running,
        max_prefill_tokens=budget,
        chunked_prefill_size=chunk,
        context_len=context,
        eos_token_ids=frozenset({EOS}),
        check_invariants=True,
        **options,
    )
    return Scheduler(config, FakeModelWorker(pool))


def gen(rid: str, prompt: list[int], max_new: int, **params) -> TokenizedGenerateReq:
    params = {"temperature": 0, "ignore_eos": True, **params}
    sp = SamplingParams(max_new_tokens=max_new, **params)
    return TokenizedGenerateReq(rid, prompt, sp, stream=True)


def run_to_completion(s: Scheduler, max_steps: int = 100_000) -> dict[str, list]:
    """Step until idle; returns each rid's outputs in order (ReqTokenOut list)."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        for out in s.outbox:
            outs.setdefault(out.rid, []).append(out)
        s.outbox = []
        if not s.has_unfinished():
            return outs
        s.step()
    raise AssertionError("scheduler did not finish: deadlock or livelock")


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def test_single_request_matches_reference():
    s = make_scheduler()
    p = prompt(random.Random(0), 37)
    s.add_request(gen("a", p, 20))
    outs = run_to_completion(s)["a"]
    assert tokens_of(outs) == reference_tokens(p, 20)
    assert outs[-1].finished_reason.type == "length"
    assert sum(o.finished_reason is not None for o in outs) == 1
    assert s.kv.available == s.config.max_total_tokens


def test_concurrent_requests_mix_prefill_and_decode():
    s = make_scheduler()
    rng = random.Random(1)
    prompts = {f"r{i}": prompt(rng, rng.randrange(1, 300)) for i in range(12)}
    for i, (rid, p) in enumerate(prompts.items()):
        s.add_request(gen(rid, p, 30))
        if i % 3 == 2:  # later arrivals land while earlier requests decode
            s.step()
    outs = run_to_completion(s)
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 30), rid
        # The detokenizer decodes the output after the prompt's last ids.
        assert outs[rid][0].start.context == p[-5:], rid
    assert s.stats.num_mixed_steps > 0


def test_long_prompt_is_chunked_while_others_decode():
    s = make_scheduler(chunk=64, budget=128)
    rng = random.Random(2)
    short, long_ = prompt(rng, 10), prompt(rng, 500)
    s.add_request(gen("short", short, 40))
    s.step()
    s.add_request(gen("long", long_, 5))
    outs = run_to_completion(s)
    assert tokens_of(outs["long"]) == reference_tokens(long_, 5)
    assert tokens_of(outs["short"]) == reference_tokens(short, 40)
    batches = s.worker.batches
    long_chunks = [b for b in batches if b.extend_lens.max() > 1]
    assert len(long_chunks) >= 500 // 64
    assert all(int(b.extend_lens.max()) <= 64 for b in batches)
    # "short" decoded in the steps that prefilled "long"
    assert sum(b.batch_size == 2 for b in long_chunks) >= 3


def test_small_pool_forces_retraction_and_outputs_survive():
    s = make_scheduler(pool=600, running=32, budget=256, chunk=128)
    rng = random.Random(3)
    prompts = {f"r{i}": prompt(rng, rng.randrange(20, 120)) for i in range(16)}
    for rid, p in prompts.items():
        s.add_request(gen(rid, p, 60))
    outs = run_to_completion(s)
    assert s.stats.num_retractions > 0
    for rid, p in prompts.items():
        assert tokens_of(outs[rid]) == reference_tokens(p, 60), rid
        assert sum(o.finished_reason is not None for o in outs[rid]) == 1


def test_too_long_requests_are_refused_at_once():
    s = make_scheduler(pool=100, context=64)
    assert s.add_request(gen("a", list(range(1, 65)), 1)).code == "too_long"
    assert s.add_request(gen("b", list(range(1, 60)), 100)) is None  # capped by the context
    assert s.add_request(gen("c", list(range(1, 2)), 10)) is None
    s2 = make_scheduler(pool=50, context=1000)
    err = s2.add_request(gen("d", list(range(1, 40)), 20))
    assert err.code == "too_long" and "KV pool" in err.message


def test_an_empty_prompt_is_refused_and_the_queue_moves_on():
    """A prompt of no tokens (a text the tokenizer makes nothing of) has nothing to prefill:
    admitted, it would be let go and stop admission, step after step, for everyone behind it."""
    s = make_scheduler()
    err = s.add_request(gen("empty", [], 5))
    assert err is not None and err.code == "invalid_request" and "no tokens" in err.message
    assert s.add_request(gen("next", [1, 2, 3], 4)) is None
    assert tokens_of(run_to_completion(s)["next"]) == reference_tokens([1, 2, 3], 4)


def test_output_top_logprobs_are_bounded_in_all():
    """top_logprobs_num x max_new_tokens lists are kept until a request ends: bounded, as the
    prompt's are, naming the field; just inside the bound is served."""
    s = make_scheduler(pool=8192, context=8192)
    most = MAX_OUTPUT_TOP_LOGPROBS // 256

    def with_logprobs(rid: str, max_new: int, top: int) -> TokenizedGenerateReq:
        return TokenizedGenerateReq(
            rid, [1, 2], SamplingParams(max_new_tokens=max_new), True, True, top
        )

    err = s.add_request(with_logprobs("over", most + 1, 256))
    assert err is not None and err.code == "invalid_request"
    assert err.message.startswith("top_logprobs_num") and "max_new_tokens" in err.message
    assert s.add_request(with_logprobs("ok", most, 256)) is None
    # The clip to the context counts, not the number asked for.
    assert s.add_request(with_logprobs("clipped", 10**6, 8)) is None


def test_the_new_token_ratio_starts_afresh_when_idle():
    """Retractions raise the reserve's estimate and decode steps decay it; a burst after an idle
    spell starts from the first estimate (as SGLang), not from the last burst's history."""
    s = make_scheduler(pool=600, running=32, budget=256, chunk=128)
    rng = random.Random(3)
    for i in range(16):
        s.add_request(gen(f"r{i}", prompt(rng, rng.randrange(20, 120)), 60))
    run_to_completion(s)
    assert s.stats.num_retractions > 0 and s.new_token_ratio.value != NewTokenRatio().value
    assert s.step() is None
    assert s.new_token_ratio == NewTokenRatio()


def test_max_new_tokens_past_context_stops_at_context():
    s = make_scheduler(context=50)
    p = list(range(1, 41))
    s.add_request(gen("a", p, 100))
    outs = run_to_completion(s)["a"]
    assert len(tokens_of(outs)) == 10
    assert outs[-1].finished_reason.type == "length"


def test_max_new_tokens_past_context_is_admitted_even_with_a_pessimistic_reserve():
    """Admission reserves KV for max_new_tokens: unclipped, a request that add_request accepted
    (its peak is capped by the context) could never be admitted and would block the queue."""
    s = make_scheduler(pool=80, context=64)
    s.new_token_ratio.value = 1.0  # as after retractions: reserve every future token
    p = list(range(1, 11))
    assert s.add_request(gen("a", p, 1000)) is None
    assert s.step() is not None  # admitted at once, under that reserve
    outs = run_to_completion(s, max_steps=200)["a"]
    assert tokens_of(outs) == reference_tokens(p, 54)
    assert outs[-1].finished_reason.type == "length"


@pytest.mark.parametrize("when", ["waiting", "running", "mid_chunk"])
def test_abort_frees_everything(when):
    s = make_scheduler(chunk=16, budget=64)
    s.add_request(gen("keep", list(range(1, 20)), 30))
    s.add_request(gen("x", list(range(1, 100)), 30))
    if when == "running":
        for _ in range(8):
            s.step()
        assert any(r.rid == "x" and r.is_decoding for r in s.running)
    elif when == "mid_chunk":
        s.step()  # "keep" takes a partial chunk, which ends admission for this step
        s.step()
        assert any(r.rid == "x" and not r.is_decoding for r in s.running)
    s.abort("x")
    outs = run_to_completion(s)
    assert outs["x"][-1].finished_reason.type == "abort"
    assert sum(o.finished_reason is not None for o in outs["x"]) == 1
    assert tokens_of(outs["keep"]) == reference_tokens(list(range(1, 20)), 30)
    assert s.kv.available == s.config.max_total_tokens


def test_stop_token_ends_request_unless_ignore_eos():
    s = make_scheduler()
    p = [5, 6, 7]
    expected = reference_tokens(p, 10)
    stop_at = expected[3]
    s.add_request(gen("a", p, 10, stop_token_ids=[stop_at]))
    outs = run_to_completion(s)["a"]
    assert tokens_of(outs) == expected[: expected.index(stop_at) + 1]
    assert outs[-1].finished_reason.type == "stop"
    assert outs[-1].finished_reason.matched == stop_at


def test_each_sequence_carries_its_own_sampling_parameters_across_row_reuse():
    s = make_scheduler(running=3)
    rng = random.Random(3)
    params = {}
    for i in range(9):  # three waves through three rows: every row is reused
        p = {"temperature": 0.1 * i, "top_p": 1 - 0.05 * i, "top_k": i + 1, "seed": 100 + i}
        if i % 3 == 0:
            p["repetition_penalty"] = 1.1
        params[f"r{i}"] = p
        s.add_request(gen(f"r{i}", prompt(rng, 5 + i), 3 + i % 4, **p))
    checked = 0
    while s.has_unfinished():
        batch = s.step()
        info = s.worker.batches[-1].sampling
        for i, req in enumerate(batch.reqs):
            p = params[req.rid]
            assert info.temperatures[i].item() == pytest.approx(p["temperature"])
            assert info.top_ps[i].item() == pytest.approx(p["top_p"])
            assert (info.top_ks[i].item(), info.seeds[i].item()) == (p["top_k"], p["seed"])
            assert info.repetition_penalties[i].item() == pytest.approx(
                p.get("repetition_penalty", 1.0)
            )
            checked += 1
        rows = batch.columns[2].tolist()  # each request's row
        assert len(set(rows)) == len(batch.reqs)
        # The batch carries the seen tokens of exactly its penalised requests.
        penalised = [i for i, r in enumerate(batch.reqs) if "repetition_penalty" in params[r.rid]]
        seen = info.penalty_tokens
        assert sorted(set(seen.batch_rows.tolist()) if seen else []) == penalised
        s.outbox = []
    assert checked > 9


def _running_scheduler() -> tuple[Scheduler, int]:
    """A scheduler mid-way: one request decoding (its prompt cached and locked), and its row."""
    s = make_scheduler(pool=256)
    s.add_request(gen("a", list(range(1, 41)), 20))
    for _ in range(3):
        s.step()
    (req,) = s.running
    assert req.kv is not None
    s.check_invariants(None)  # sound so far
    return s, req.kv.row


def test_the_invariant_checker_catches_a_leaked_slot():
    s, _ = _running_scheduler()
    s.kv.allocator.alloc(1)  # taken from the free list, held by no one
    with pytest.raises(InvariantError, match="a slot leaked"):
        s.check_invariants(None)


def test_the_invariant_checker_catches_a_slot_owned_twice():
    s, row = _running_scheduler()
    owned = s.kv.req_to_token_pool.req_to_token[row, 39:40].clone()  # the request's own slot
    s.kv.allocator.free(owned)  # free as well
    with pytest.raises(InvariantError, match="owned twice"):
        s.check_invariants(None)


def test_the_invariant_checker_catches_a_locked_prefix_unlocked():
    s, row = _running_scheduler()
    tree = s.kv.tree_cache
    assert tree is not None
    node = s.kv._locked[row]
    assert node is not None and node is not tree.root
    tree.dec_lock_ref(node)  # evictable now, while the request still reads it
    with pytest.raises(InvariantError, match="does not lock its prefix"):
        s.check_invariants(None)
