"""Overlap scheduling: the same tokens with and without it.

The scheduler with the fake model worker (tests/fake_worker.py) on its overlap thread, the
FutureMap against the real penalties, and two real servers on a tiny random model."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from fake_worker import reference_tokens
from test_scheduler import gen, make_scheduler, prompt, run_to_completion, tokens_of

from radixserve.client import AsyncClient
from radixserve.client.local_server import launched_server
from radixserve.model_worker.batch import ModelWorkerBatch
from radixserve.model_worker.future_map import FutureMap
from radixserve.model_worker.penalties import apply_penalties
from radixserve.scheduler.rank_setup import overlap_schedule
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.seen_tokens import SeenTokens, penalty_tokens
from radixserve.server_args import ServerArgs


def run_mixed_workload(enable_overlap: bool) -> tuple[Scheduler, dict[str, list[int]], int]:
    """Staggered arrivals (decodes mix with prefills), a long prompt in chunks, a pool small
    enough to retract, a stop token, an abort, requests sharing a prompt (as n > 1 does), one
    with penalties, one stopped by the context; each request's tokens checked against the fake
    model's reference. Returns the scheduler, each rid's tokens, and how many steps were planned
    while a step's tokens were still in flight."""
    s = make_scheduler(
        pool=700, running=32, budget=160, chunk=64, context=300, enable_overlap=enable_overlap
    )
    rng = random.Random(11)
    shared = prompt(rng, 40)
    arrivals = [gen(f"r{i}", prompt(rng, rng.randrange(5, 90)), 40) for i in range(10)]
    arrivals += [gen(f"n{i}", shared, 30) for i in range(3)]
    arrivals.append(gen("long", prompt(rng, 250), 100))  # stopped by the context at 50
    stop_prompt = prompt(rng, 12)
    stop_at = reference_tokens(stop_prompt, 20)[6]
    arrivals.append(gen("stop", stop_prompt, 20, stop_token_ids=[stop_at]))
    arrivals.append(gen("penalised", prompt(rng, 30), 25, repetition_penalty=1.3))
    arrivals.append(gen("aborted", prompt(rng, 20), 60))
    expected_len = {m.rid: m.sampling_params.max_new_tokens for m in arrivals}
    expected_len |= {"long": 50, "stop": reference_tokens(stop_prompt, 20).index(stop_at) + 1}
    prompts = {m.rid: m.input_ids for m in arrivals}
    outs: dict[str, list] = {}
    overlapped = 0
    for step in range(100_000):
        if step % 2 == 0 and arrivals:
            s.add_request(arrivals.pop(0))
        if step == 40:
            s.abort("aborted")
        overlapped += any(r.future_ids for r in s.running)
        s.step()
        for out in s.outbox:
            outs.setdefault(out.rid, []).append(out)
        s.outbox = []
        if not arrivals and not s.has_unfinished():
            break
    tokens = {rid: tokens_of(o) for rid, o in outs.items()}
    for rid, o in outs.items():
        assert sum(out.finished_reason is not None for out in o) == 1, rid
        assert tokens[rid] == reference_tokens(prompts[rid], len(tokens[rid])), rid
        if rid != "aborted":
            assert len(tokens[rid]) == expected_len[rid], rid
    assert outs["aborted"][-1].finished_reason.type == "abort"
    assert outs["stop"][-1].finished_reason.type == "stop"
    return s, tokens, overlapped


def test_overlap_gives_the_same_tokens_on_mixed_batches() -> None:
    runs = {overlap: run_mixed_workload(overlap) for overlap in (False, True)}
    assert runs[True][1] == runs[False][1]
    for overlap, (s, _, overlapped) in runs.items():
        assert s.stats.num_retractions > 0 and s.stats.num_mixed_steps > 0
        assert s.kv.available == s.config.max_total_tokens  # every slot back, none twice
        assert all(bool((b.input_ids >= 0).all()) for b in s.worker.batches)
        # Without overlap a plan never sees a token in flight; with it nearly every one does.
        assert (overlapped > 100) == overlap, overlapped


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_costs_one_step_after_a_stop_token_and_none_after_the_length(overlap) -> None:
    """A step planned while the previous one runs cannot know that its token is a stop token:
    that request computes one step more, whose token is dropped. Its length is known: a request
    whose last token is in flight gets no more steps."""
    p = [5, 6, 7]
    stop_at = reference_tokens(p, 10)[3]
    for params, n in (({}, 6), ({"stop_token_ids": [stop_at]}, 4)):
        s = make_scheduler(enable_overlap=overlap)
        s.add_request(gen("a", p, 6, **params))
        outs = run_to_completion(s)["a"]
        assert tokens_of(outs) == reference_tokens(p, n)
        extra = overlap and bool(params)
        assert len(s.worker.batches) == n + extra  # the prefill emits the first token
        assert s.kv.available == s.config.max_total_tokens


def test_overlap_is_on_with_a_gpu_and_off_on_the_cpu_unless_the_flags_say() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not overlap_schedule(ServerArgs(), cpu)
    assert overlap_schedule(ServerArgs(), gpu)
    assert overlap_schedule(ServerArgs(enable_overlap_schedule=True), cpu)
    assert not overlap_schedule(ServerArgs(disable_overlap_schedule=True), gpu)


def test_a_placeholder_in_the_seen_tokens_penalises_like_the_real_token() -> None:
    """A penalised decode's last output is in flight when its next step is planned: its seen
    tokens carry the placeholder, which the worker resolves, merging it with an equal token."""
    prompt_ids, outputs = [5, 9, 9, 14], [9, 3]
    real = SeenTokens.of(prompt_ids, outputs)
    before = SeenTokens.of(prompt_ids, outputs[:-1])
    future_map = FutureMap(max_batch_size=4)
    slots = future_map.alloc(2)
    future_map.store(slots, torch.tensor([7, 3]))  # the step in flight sampled 3 for row 1
    info = _sampling_info(penalty_tokens(torch.tensor([1]).numpy(), [real]))
    pending = penalty_tokens(torch.tensor([1]).numpy(), [before], [[-int(slots[1])]])
    batch = _batch(torch.tensor([-int(slots[1]), 4]), _sampling_info(pending))
    resolved = future_map.resolve(batch)
    assert resolved.input_ids.tolist() == [3, 4]
    logits = torch.randn(2, 16)
    expected = apply_penalties(logits, info)
    assert torch.equal(apply_penalties(logits, resolved.sampling), expected)
    assert future_map.resolve(resolved) is resolved  # nothing left to resolve


def _sampling_info(penalties: Any) -> Any:
    from radixserve.model_worker.batch import SamplingBatchInfo

    b = 2
    return SamplingBatchInfo(
        temperatures=torch.zeros(b),
        top_ps=torch.ones(b),
        top_ks=torch.full((b,), -1),
        min_ps=torch.zeros(b),
        repetition_penalties=torch.tensor([1.0, 1.3]),
        frequency_penalties=torch.tensor([0.0, 0.4]),
        presence_penalties=torch.tensor([0.0, 0.2]),
        seeds=torch.zeros(b, dtype=torch.int64),
        seeded=torch.zeros(b, dtype=torch.bool),
        output_index=torch.zeros(b, dtype=torch.int64),
        top_logprobs_nums=torch.zeros(b, dtype=torch.int64),
        return_logprob=torch.zeros(b, dtype=torch.bool),
        penalty_tokens=penalties,
        is_all_greedy=True,
        any_logprob=False,
    )


def _batch(input_ids: torch.Tensor, sampling: Any) -> ModelWorkerBatch:
    ones = torch.ones(2, dtype=torch.int64)
    return ModelWorkerBatch(
        input_ids=input_ids,
        positions=ones,
        out_cache_loc=torch.tensor([1, 2]),
        prefix_lens=ones,
        extend_lens=ones,
        kv_slots=torch.tensor([[3, 1], [4, 2]]),
        sampling=sampling,
    )


# ---- two real servers, tiny random model ---------------------------------------------------

BASE_ARGS = ("--max-total-tokens", "1200", "--chunked-prefill-size", "48")
BASE_ARGS += ("--max-prefill-tokens", "96", "--check-invariants")
# The two servers batch requests differently (`--dtype auto`: bfloat16 on CPUs with it). Their
# greedy tokens agree where a row's logits do not depend on its batch: on the CPU, whose kernels
# give bfloat16 rows the same bits (linear_panels sums as oneDNN does; on AMX oneDNN takes every
# row count: these servers' tokens agreed on a Xeon with AMX, not checked bit for bit; at a
# 0.5B's shapes its rows depend on the call) and float32 rows the same up to rounding. On an H100,
# in bfloat16, they parted (2026-11-27: CUDA's kernels are chosen by shape), as in SGLang without
# its deterministic mode.
SERVER_ARGS = (*BASE_ARGS, "--device", "cpu")
SPECULATIVE = ("--speculative-algorithm", "NGRAM", "--speculative-disable-by-batch-size", "3")


@pytest.fixture(scope="module")
def servers(tiny_served_model):
    model = str(tiny_served_model)
    with (
        # NGRAM too, once at most 3 requests run: steps overlap at first, speculate at the end.
        launched_server(
            "--model", model, "--enable-overlap-schedule", *SERVER_ARGS, *SPECULATIVE
        ) as overlap,
        # The modules op by op here, the fused layers there (the default): the same tokens too.
        launched_server(
            "--model", model, "--disable-overlap-schedule", "--disable-fused-layers", *SERVER_ARGS
        ) as off,
    ):
        yield {"overlap": overlap, "off": off}


@pytest.fixture(scope="module")
def device_servers(tiny_served_model, device):
    """An overlap and a no-overlap server on a GPU (`RADIXSERVE_TEST_DEVICE=cuda`), where overlap
    is the default: no NGRAM (its verify steps are not overlapped, and their rows are another
    shape)."""
    if device.type == "cpu":
        pytest.skip(
            "needs RADIXSERVE_TEST_DEVICE=cuda; on the CPU overlap's tokens are checked batched "
            "(test_servers_with_and_without_overlap_give_the_same_tokens)"
        )
    model = str(tiny_served_model)
    on_device = ("--model", model, *BASE_ARGS, "--device", str(device))
    with (
        launched_server(*on_device, "--enable-overlap-schedule") as overlap,
        launched_server(*on_device, "--disable-overlap-schedule") as off,
    ):
        yield {"overlap": overlap, "off": off}


async def _mixed_load(address: str, at_once: bool = True) -> dict[str, Any]:
    """Concurrent greedy requests: long prompts in chunks beside decodes, enough of them to
    retract, stop strings, n = 2, penalties, logprobs, and one aborted mid-stream. With
    `at_once=False` one after another, and no n = 2 (its two samples are sent apart, so whether
    they share their first steps depends on timing): no retraction, nothing beside a chunk."""
    rng = random.Random(5)
    words = ["the", "of", "sea", "a", "village", "lived", "once", "upon", "time", "by", "and"]
    prompts = [" ".join(rng.choices(words, k=rng.randrange(4, 120))) for _ in range(10)]
    results: dict[str, Any] = {}
    async with AsyncClient(address, timeout=300) as c:

        async def one(i: int, text: str) -> None:
            params: dict[str, Any] = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
            if i % 4 == 1:
                params["stop"] = ["e"]
            if i % 5 == 2:
                params |= {"repetition_penalty": 1.2, "frequency_penalty": 0.3}
            if i % 6 == 3 and at_once:
                params["n"] = 2
            pieces: dict[int, list] = {}
            async for chunk in c.stream(text, sampling_params=params, return_logprob=i % 3 == 0):
                logprobs = (chunk.meta_info.output_token_logprobs or []) if i % 3 == 0 else []
                pieces.setdefault(chunk.index or 0, []).append(
                    (chunk.output_ids, chunk.text, [lp for lp, _ in logprobs])
                )
            results[f"p{i}"] = pieces

        async def aborted() -> None:
            params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
            n = 0
            async for chunk in c.stream("once upon a time", sampling_params=params, rid="x"):
                n += len(chunk.output_ids)
                if n >= 5 and not chunk.finished:
                    await c.abort("x")
                if chunk.finished:
                    results["aborted"] = chunk.meta_info.finish_reason.type
            assert n < 200

        if at_once:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), aborted())
        else:
            for i, p in enumerate(prompts):
                await one(i, p)
                # A stop string's request may run a step more after its reply: not beside the next.
                await _until_idle(c)
            await aborted()
        results["info"] = await c.server_info()
    return results


async def _until_idle(c: AsyncClient) -> None:
    for _ in range(200):
        if (await c.server_info()).running_requests == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the server still runs a finished request")


def test_servers_with_and_without_overlap_give_the_same_tokens(servers) -> None:
    assert "fused layers True" in servers["overlap"].log()
    assert "fused layers False" in servers["off"].log()
    results = {mode: asyncio.run(_mixed_load(s.address)) for mode, s in servers.items()}
    info = {mode: r.pop("info") for mode, r in results.items()}
    for r in results.values():
        assert r.pop("aborted") == "abort"
    joined = {mode: _tokens(r) for mode, r in results.items()}
    assert joined["overlap"] == joined["off"]
    texts = {
        mode: {rid: {k: "".join(p[1] for p in v) for k, v in ps.items()} for rid, ps in r.items()}
        for mode, r in results.items()
    }
    assert texts["overlap"] == texts["off"]
    logprobs = {
        mode: [lp for ps in r.values() for v in ps.values() for p in v for lp in p[2]]
        for mode, r in results.items()
    }
    # Batched differently, so rounded differently: equal to float32 noise, not bit for bit.
    assert logprobs["overlap"] == pytest.approx(logprobs["off"], abs=1e-3)
    assert len(logprobs["off"]) > 50
    assert all(len(v) == 2 for rid, v in joined["off"].items() if int(rid[1:]) % 6 == 3)
    assert any(0 < len(v[0][0]) < 24 for v in joined["off"].values())  # a stop string hit
    for mode, i in info.items():
        assert i.running_requests == 0 and i.kv_tokens_used == 0, mode
    assert info["overlap"].spec_verifies > 0 and info["off"].spec_verifies == 0


def test_one_request_at_a_time_gives_the_same_tokens_on_a_gpu(device_servers) -> None:
    """Overlap's own parts (placeholder tokens, the forward on its thread, the step's copy back)
    on CUDA, where the batched test above cannot go: one request at a time, every step's batch
    is the same in both modes, so the same kernels run on the same shapes. Logprobs within 1e-5,
    not bit for bit: CUDA does not promise a reduction the same order from call to call."""
    results = {
        mode: asyncio.run(_mixed_load(s.address, at_once=False))
        for mode, s in device_servers.items()
    }
    for mode, r in results.items():
        info = r.pop("info")
        assert info.running_requests == 0 and info.kv_tokens_used == 0, mode
        assert r.pop("aborted") == "abort"
    assert _tokens(results["overlap"]) == _tokens(results["off"])
    logprobs = {
        mode: [lp for ps in r.values() for v in ps.values() for p in v for lp in p[2]]
        for mode, r in results.items()
    }
    assert logprobs["overlap"] == pytest.approx(logprobs["off"], abs=1e-5)
    assert len(logprobs["off"]) > 50


def _tokens(results: dict[str, Any]) -> dict[str, dict[int, list[list[int]]]]:
    """_mixed_load's output tokens, per request and index."""
    return {
        rid: {index: [sum((p[0] for p in v), [])] for index, v in pieces.items()}
        for rid, pieces in results.items()
        if rid not in ("info", "aborted")
    }


def test_a_standalone_server_gives_the_same_tokens(servers, tiny_served_model) -> None:
    """STANDALONE end to end, the model as its own draft: the draft's path through the
    launcher, its KV mirrored in overlapped steps while more than 3 requests run, drafts once
    at most 3 do."""
    model = str(tiny_served_model)
    draft = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model)
    draft += ("--speculative-num-steps", "3", "--speculative-disable-by-batch-size", "3")
    with launched_server(
        "--model", model, "--enable-overlap-schedule", *SERVER_ARGS, *draft
    ) as standalone:
        got = asyncio.run(_mixed_load(standalone.address))
    want = asyncio.run(_mixed_load(servers["off"].address))
    assert _tokens(got) == _tokens(want)
    info = got["info"]
    assert info.spec_verifies > 0 and info.spec_accepted_tokens > info.spec_verifies
    assert info.running_requests == 0 and info.kv_tokens_used == 0
