"""The scheduler and the detokenizer joined as the server joins them, each step's outputs through
the msgpack codec and each StopReq back: what stays the same for a request travels once, with
its first output, and the detokenizer keeps state exactly for the requests still live.
Real scheduler and pools (fake model worker), the default model's real tokenizer."""

from __future__ import annotations

import random
import string

import pytest
from fake_worker import reference_tokens
from test_scheduler import gen, make_scheduler, prompt

from radixserve.detokenizer.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from radixserve.detokenizer.tokenizer_handoff import decoder_for
from radixserve.model_worker.model_source import default_model_dir
from radixserve.protocol import transport
from radixserve.protocol.internal import BatchTokenOut, ReqTokenOut, TokenizedGenerateReq
from radixserve.protocol.wire import FinishReason
from radixserve.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def long_stops(rng: random.Random) -> list[str]:
    """4 stop strings of 64 characters that the fake model's text never holds."""
    return ["".join(rng.choices(string.ascii_letters, k=64)) for _ in range(4)]


def matching_stop(tokenizer, p: list[int], max_new: int) -> str:
    """A short piece of the text that the fake model writes for prompt `p`: a stop string that
    ends the request partway."""
    ids = reference_tokens(p, max_new)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    middle = len(text) // 2
    for start in range(middle, len(text) - 3):
        piece = text[start : start + 3]
        if REPLACEMENT_CHAR not in piece and piece.strip():
            return piece
    raise AssertionError("no stop string in the fake model's text")


ABORT_KINDS = ("running", "waiting, never admitted", "waiting, retracted after outputs")


def abort_one(s: Scheduler, aborted: dict[str, str], exclude: set[str]) -> None:
    """Abort one request of a kind not aborted yet, if one is there now."""
    candidates = {
        ABORT_KINDS[0]: [r for r in s.running if r.num_sent_tokens],
        ABORT_KINDS[1]: [r for r in s.waiting if not r.retracted],
        ABORT_KINDS[2]: [r for r in s.waiting if r.retracted and r.num_sent_tokens],
    }
    for kind, reqs in candidates.items():
        reqs = [r for r in reqs if r.rid not in exclude]
        if kind not in aborted.values() and reqs:
            aborted[reqs[-1].rid] = kind
            s.abort(reqs[-1].rid)
            return


def test_every_path_that_ends_a_request_frees_the_detokenizer_state(tokenizer):
    """With overlap scheduling (the default with a GPU), every way a request ends: by length;
    by a stop string (the detokenizer's StopReq, outputs coming between the match and the
    final); aborted while running, while waiting, and while waiting after a retraction with
    outputs sent; max_new_tokens 0; non-streamed, its first output its final; completions
    sharing a prompt and stop strings (as n > 1 sends them); retraction and re-admission."""
    rng = random.Random(5)
    s = make_scheduler(pool=800, running=24, budget=128, chunk=64, context=300, enable_overlap=True)
    arrivals: list[TokenizedGenerateReq] = []
    for i in range(24):
        p = prompt(rng, rng.randrange(40, 80))
        kind = i % 4
        stop = [matching_stop(tokenizer, p, 100)] if kind == 0 else long_stops(rng)
        msg = gen(f"r{i}", p, 100, stop=[] if kind == 3 else stop)
        msg.stream = kind == 1
        arrivals.append(msg)
    shared = prompt(rng, 20)
    arrivals += [gen(f"n{i}", shared, 12, stop=long_stops(random.Random(0))) for i in range(3)]
    arrivals.append(gen("zero", prompt(rng, 5), 0, stop=long_stops(rng)))
    sent = {m.rid: m for m in arrivals}
    stop_ended = {f"r{i}" for i in range(0, 24, 4)}
    aborted: dict[str, str] = {}

    codec = transport.Codec(BatchTokenOut)
    detok = IncrementalDetokenizer(decoder_for(tokenizer))
    outs: dict[str, list[ReqTokenOut]] = {}
    finals: dict[str, list[FinishReason]] = {}
    for step in range(2_000):
        for _ in range(8):
            if arrivals:
                s.add_request(arrivals.pop(0))
        abort_one(s, aborted, exclude=stop_ended)
        s.step()
        batch: BatchTokenOut = codec.decode(codec.encode(BatchTokenOut(s.outbox)))
        s.outbox = []
        for out in batch.outs:
            outs.setdefault(out.rid, []).append(out)
        strs, stops = detok.step(batch.outs)
        for str_out in strs:
            if str_out.finished_reason is not None:
                finals.setdefault(str_out.rid, []).append(str_out.finished_reason)
        live = {r.rid for r in [*s.waiting, *s.running] if r.num_sent_tokens}
        assert set(detok.states) == live, step
        for stop in stops:
            s.abort(stop.rid, FinishReason("stop", stop.matched))
        if not arrivals and not s.has_unfinished() and not s.outbox:
            break
    assert len(detok) == 0 and not s.has_unfinished()
    assert s.stats.num_retractions > 0
    assert {rid: len(f) for rid, f in finals.items()} == dict.fromkeys(sent, 1)
    for rid, req_outs in outs.items():
        first, *rest = req_outs
        assert first.start is not None and first.start.stop == sent[rid].sampling_params.stop
        assert first.start.prompt_tokens == len(sent[rid].input_ids), rid
        assert all(out.start is None for out in rest), rid
    reasons = {rid: f[0].type for rid, f in finals.items()}
    assert all(reasons[rid] == "stop" for rid in stop_ended)
    assert sorted(aborted.values()) == sorted(ABORT_KINDS)
    assert all(reasons[rid] == "abort" for rid in aborted)
    assert len(outs["r7"]) == 1  # not streamed, no stop strings: its first output is its final
    assert reasons["zero"] == "length" and len(outs["zero"]) == 1


def test_stop_strings_travel_once_not_in_every_step():
    """64 running requests with 4 stop strings of 64 characters each (a decode step's message
    used to carry all of them): only each request's first output carries them."""
    rng = random.Random(7)
    stops = long_stops(rng)
    s = make_scheduler(budget=2048, chunk=2048)  # every prompt in the first step
    for i in range(64):
        msg = gen(f"{i:x}", prompt(rng, 16), 8, stop=stops)  # internal rids: hex counters
        msg.stream = False  # stop strings alone make a request send every step
        s.add_request(msg)
    codec = transport.Codec(BatchTokenOut)
    steps = []
    while s.has_unfinished():
        s.step()
        steps.append((len(s.outbox), codec.encode(BatchTokenOut(s.outbox))))
        s.outbox = []
    assert [n for n, _ in steps] == [64] * 8
    assert [sum(data.count(stop.encode()) for _, data in steps) for stop in stops] == [64] * 4
    sizes = [len(data) for _, data in steps]
    print(
        f"\nscheduler -> detokenizer, 64 requests with 4 stop strings of 64 characters: "
        f"{sizes[0]} bytes in the step of their first outputs, {sizes[1]} in a decode step"
    )
