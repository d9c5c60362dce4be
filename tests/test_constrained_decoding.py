"""Constrained decoding in the scheduler, in-process, on a real tiny random model with the default
model's tokenizer and the real sampler: grammars compile off the loop (once per spec), every
constrained output matches its grammar at temperature 1 (mixed with unconstrained requests, with
overlap on and off, with retractions forced by a small pool), and bad or slow grammars are
refused with the request's rid."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.tp_worker import TpModelWorker
from radixserve.protocol.internal import ReqError, TokenizedGenerateReq
from radixserve.protocol.wire import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.grammar import COMPILE_THREADS, GrammarBackend
from radixserve.scheduler.scheduler import Scheduler

REGEX = r"[a-c]{3}-[0-9]{2}"
EBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= "yes" | "no" | [0-9]'
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}


def matches(field: str, text: str) -> bool:
    if field == "regex":
        return re.fullmatch(REGEX, text) is not None
    if field == "ebnf":
        return re.fullmatch(r"\((yes|no|[0-9])(,(yes|no|[0-9])){0,2}\)", text) is not None
    value = json.loads(text)
    return (
        set(value) == {"color", "ok", "tags"}
        and value["color"] in {"red", "green", "blue"}
        and isinstance(value["ok"], bool)
        and set(value["tags"]) <= {"x", "y"}
    )


SPECS = {"regex": REGEX, "ebnf": EBNF, "json_schema": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def runner(tiny_served_model: Path) -> ModelRunner:
    return float32_runner(tiny_served_model)


def float32_runner(model: Path) -> ModelRunner:
    return ModelRunner(
        str(model),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=256,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
    )


def make_scheduler(
    runner: ModelRunner, model: Path, enable_overlap: bool, reasoning_parser: str | None = None
) -> Scheduler:
    config = SchedulerConfig(
        max_total_tokens=runner.max_total_tokens,
        max_running_requests=16,
        max_prefill_tokens=128,
        chunked_prefill_size=24,  # prompts in chunks: their sampled tokens are dropped
        context_len=1024,
        eos_token_ids=frozenset({2}),
        check_invariants=True,
        enable_overlap=enable_overlap,
    )
    vocab = runner.model_config.vocab_size
    backend = GrammarBackend(str(model), vocab, reasoning_parser=reasoning_parser)
    return Scheduler(config, TpModelWorker(runner), backend)


def gen(rid: str, ids: list[int], **params) -> TokenizedGenerateReq:
    # 80: room for the longest output of each grammar, one token per character, and EOS.
    sp = SamplingParams(**{"max_new_tokens": 80, "temperature": 1.0, **params})
    return TokenizedGenerateReq(rid, ids, sp, stream=False)


def run(s: Scheduler, timeout_s: float = 300) -> dict[str, list]:
    outs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while s.has_unfinished():
        assert time.monotonic() < deadline, "the scheduler did not finish"
        if s.step() is None:
            time.sleep(0.005)  # grammars compiling: as the event loop, do not spin on the GIL
        for out in s.outbox:
            outs.setdefault(out.rid, []).append(out)
        s.outbox = []
    return outs


@pytest.mark.parametrize("enable_overlap", [False, True])
def test_every_constrained_output_matches_in_mixed_batches_with_retraction(
    runner: ModelRunner, tiny_served_model: Path, enable_overlap: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_served_model)
    s = make_scheduler(runner, tiny_served_model, enable_overlap)
    fields = {}
    for i in range(18):
        ids = tokenizer.encode(f"Request {i}: write something " + "long " * (i % 4) * 8)
        field = ("regex", "ebnf", "json_schema", None)[i % 4]
        grammar = {field: SPECS[field]} if field else {"ignore_eos": True, "max_new_tokens": 120}
        # Seeded and unseeded, greedy and sampled, with logprobs on some.
        # (Seeded draws hash the whole vocabulary: few of them keep the test short.)
        msg = gen(f"r{i}", ids, seed=i if field and i % 3 == 1 else None, **grammar)
        if i % 5 == 0:
            msg = TokenizedGenerateReq(msg.rid, ids, msg.sampling_params, False, True, 2)
        assert s.add_request(msg) is None
        fields[msg.rid] = field
    outs = run(s)
    assert s.stats.num_retractions > 0, "the pool was meant to force retractions"
    assert not s.errors
    for rid, field in fields.items():
        final = outs[rid][-1]
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        if field is None:
            assert len(tokens) == 120
            continue
        assert final.finished_reason.type == "stop", (rid, final.finished_reason)
        assert tokens[-1] == 2  # the grammar ends only with EOS
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert matches(field, text), (rid, field, text)
    assert s.kv.available == s.config.max_total_tokens


def test_n_copies_share_one_compile_and_seeds_repeat(
    runner: ModelRunner, tiny_served_model: Path
) -> None:
    s = make_scheduler(runner, tiny_served_model, enable_overlap=False)
    assert s.grammar_queue is not None
    backend = s.grammar_queue.backend
    for i in range(4):  # as the tokenizer manager sends n = 4: same spec, same seed
        s.add_request(gen(f"n{i}", [1, 5, 9, 14], regex=REGEX, seed=7))
    assert len(backend._cache) == 1
    outs = run(s)
    texts = {tuple(t for o in outs[f"n{i}"] for t in o.new_token_ids) for i in range(4)}
    assert len(texts) == 1  # same seed, same grammar: the same tokens


def thinking_scheduler(tiny_model, tiny_served_model: Path, parser: str | None):
    """A scheduler over a model whose tokenizer has <think> and </think> (one token each), with
    `parser`'s grammars; the tokenizer, and the tags' ids."""
    model = tiny_model("llama", vocab_size=49160, max_position_embeddings=1024, bos_token_id=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_served_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(model)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    scheduler = make_scheduler(float32_runner(model), model, False, reasoning_parser=parser)
    return scheduler, tokenizer, start, end


@pytest.mark.parametrize("parser", [None, "qwen3", "deepseek-r1"])
def test_with_a_reasoning_parser_the_grammar_holds_after_the_thinking(
    tiny_model, tiny_served_model: Path, parser: str | None
) -> None:
    """Biased to write the tags: with qwen3's parser the output may open with <think> (no other
    token outside the grammar), thinks freely until </think>, then follows the grammar; with
    deepseek-r1's it thinks from its first token. Without a parser the grammar holds from the
    first token: neither tag can come."""
    s, tokenizer, start, end = thinking_scheduler(tiny_model, tiny_served_model, parser)
    bias = {start: 50.0, end: 100.0}  # </think> wherever it may come, else <think>
    s.add_request(gen("r", [1, 5, 9, 14], regex=REGEX, temperature=0.0, logit_bias=bias))
    outs = run(s)
    tokens = [t for o in outs["r"] for t in o.new_token_ids]
    thinking = {None: [], "qwen3": [start, end], "deepseek-r1": [end]}[parser]
    assert tokens[: len(thinking)] == thinking
    assert matches("regex", tokenizer.decode(tokens[len(thinking) :], skip_special_tokens=True))
    assert outs["r"][-1].finished_reason.type == "stop"


def test_a_thinking_is_free_text_a_closed_one_is_not(tiny_model, tiny_served_model: Path) -> None:
    """deepseek-r1: while the output thinks, min_new_tokens holds EOS back as without a grammar;
    a prompt that closed the thinking (its template with the thinking off) leaves no thinking to
    wait for: the grammar holds from the first token."""
    s, tokenizer, start, end = thinking_scheduler(tiny_model, tiny_served_model, "deepseek-r1")
    eos_first = {2: 100.0}
    s.add_request(gen("min", [1, 5, 9, 14], regex=REGEX, temperature=0.0, logit_bias=eos_first))
    held = {"logit_bias": eos_first, "min_new_tokens": 6}
    s.add_request(gen("held", [1, 5, 9, 14], regex=REGEX, temperature=0.0, **held))
    closed = [1, 5, start, 9, end, 14]
    bias = {end: 100.0}
    s.add_request(gen("closed", closed, regex=REGEX, temperature=0.0, logit_bias=bias))
    outs = run(s)
    tokens = {rid: [t for o in out for t in o.new_token_ids] for rid, out in outs.items()}
    assert tokens["min"] == [2]  # no minimum: EOS ends the thinking at once
    assert len(tokens["held"]) == 7 and tokens["held"][6] == 2 and 2 not in tokens["held"][:6]
    assert end not in tokens["closed"]
    assert matches("regex", tokenizer.decode(tokens["closed"], skip_special_tokens=True))


def test_bad_grammars_are_refused_naming_the_field(
    runner: ModelRunner, tiny_served_model: Path
) -> None:
    s = make_scheduler(runner, tiny_served_model, enable_overlap=False)
    s.add_request(gen("bad-regex", [1, 2, 3], regex="[a-"))
    s.add_request(gen("bad-ebnf", [1, 2, 3], ebnf="root ::= "))
    s.add_request(gen("bad-schema", [1, 2, 3], json_schema='{"type": 5}'))
    s.add_request(gen("fine", [1, 2, 3], regex="ok"))
    outs = run(s)
    errors = {e.rid: e for e in s.errors}
    assert set(errors) == {"bad-regex", "bad-ebnf", "bad-schema"}
    assert all(e.code == "invalid_request" for e in errors.values())
    assert errors["bad-regex"].message.startswith("regex: ")
    assert "Unclosed" in errors["bad-regex"].message
    assert errors["bad-ebnf"].message.startswith("ebnf: ")
    assert errors["bad-schema"].message.startswith("json_schema: ")
    assert set(outs) == {"fine"}  # the others never ran


def test_a_slow_compile_times_out_and_an_abort_ends_a_compiling_request(
    runner: ModelRunner, tiny_served_model: Path
) -> None:
    s = make_scheduler(runner, tiny_served_model, enable_overlap=False)
    assert s.grammar_queue is not None
    s.grammar_queue.timeout_s = s.grammar_queue.wall_limit_s = 0.2
    # Hold every compile thread, so that the grammars below cannot start compiling.
    release = threading.Event()
    for _ in range(COMPILE_THREADS):
        s.grammar_queue.backend._pool.submit(release.wait)
    s.add_request(gen("slow", [1, 2, 3], regex="a+"))
    s.add_request(gen("aborted", [1, 2, 3], regex="b+"))
    s.add_request(gen("plain", [1, 2, 3], max_new_tokens=3, ignore_eos=True))
    s.step()  # the unconstrained request runs while the others compile
    s.abort("aborted")
    time.sleep(0.3)
    s.step()
    release.set()
    outs = run(s)
    assert [(e.rid, e.code, e.message) for e in s.errors] == [
        (
            "slow",
            "overloaded",
            "regex did not compile within 0.2 s (the server is busy); retry later",
        )
    ]
    assert outs["aborted"][-1].finished_reason.type == "abort"
    assert len([t for o in outs["plain"] for t in o.new_token_ids]) == 3


def test_compiles_past_their_timeout_still_hold_their_threads_and_the_excess_waits(
    runner: ModelRunner, tiny_served_model: Path
) -> None:
    """A compile cannot be stopped: one past its request's timeout still counts against the
    threads until it ends, and the grammars beyond them wait in the grammar queue (never handed
    to the pool, where they would compile after their requests are gone) until a thread is free
    or their time is up (`overloaded`, retry later)."""
    s = make_scheduler(runner, tiny_served_model, enable_overlap=False)
    assert s.grammar_queue is not None
    s.grammar_queue.timeout_s = s.grammar_queue.wall_limit_s = 0.3
    backend = s.grammar_queue.backend
    specs = [f"x{{{i + 1}}}" for i in range(COMPILE_THREADS + 3)]
    with backend._compiler_lock:  # every compile hangs, as a pathological grammar's would
        for i, spec in enumerate(specs):
            s.add_request(gen(f"hang{i}", [1, 2, 3], regex=spec))
        assert backend.busy() == COMPILE_THREADS
        time.sleep(0.4)
        s.step()
        assert [(e.rid, e.code) for e in s.errors] == [
            (f"hang{i}", "overloaded") for i in range(len(specs))
        ]
        assert "did not compile within 0.3 s (the server is busy)" in s.errors[0].message
        assert "waited 0.3 s for a compile thread" in s.errors[-1].message
        s.errors = []
        s.grammar_queue.timeout_s = s.grammar_queue.wall_limit_s = 300
        s.add_request(gen("late", [1, 2, 3], regex="[0-9]{2}"))
        s.step()
        assert backend.busy() == COMPILE_THREADS  # timed out, still compiling: late waits
    outs = run(s)
    tokens = [t for o in outs["late"] for t in o.new_token_ids]
    text = AutoTokenizer.from_pretrained(tiny_served_model).decode(tokens, skip_special_tokens=True)
    assert re.fullmatch("[0-9]{2}", text) and not s.errors
    compiled = {spec for _, spec in backend._cache}
    assert compiled == {*specs[:COMPILE_THREADS], "[0-9]{2}"}  # the waiting ones never ran


def test_the_compile_timeout_counts_the_compiles_cpu_time(
    runner: ModelRunner, tiny_served_model: Path
) -> None:
    """At idle priority a compile gets little CPU on a busy machine: its CPU time is what is
    bounded (client input), and the wall time only by a generous backstop."""
    s = make_scheduler(runner, tiny_served_model, enable_overlap=False)
    assert s.grammar_queue is not None
    backend = s.grammar_queue.backend
    s.grammar_queue.timeout_s = 0.05
    properties = {
        f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},40}}"} for i in range(300)
    }
    schema = json.dumps({"type": "object", "properties": properties, "required": list(properties)})
    s.add_request(gen("big", [1, 2, 3], json_schema=schema))
    (entry,) = s.grammar_queue._compiling
    assert entry.future is not None
    while not entry.future.done() and backend.cpu_seconds(entry.future) <= 0.05:
        time.sleep(0.005)
    s.step()
    assert [(e.rid, e.code) for e in s.errors] == [("big", "invalid_request")]
    assert s.errors[0].message == "json_schema did not compile within 0.05 s of CPU time"


def test_a_compiles_cpu_time_counts_from_its_start_not_from_its_threads(
    tiny_served_model: Path,
) -> None:
    """The pool's threads live on from compile to compile: the CPU time that bounds a compile is
    its own, not its thread's since it was created (else a thread that has compiled 30 s of
    grammars in all refuses every grammar it takes after)."""
    backend = GrammarBackend(str(tiny_served_model), 49152, threads=1)

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    backend._pool.submit(burn, 0.5).result()  # the one thread has worked before
    with backend._compiler_lock:  # the compile starts, then waits without using a CPU
        future = backend.compile("regex", "a")
        assert future is not None
        clock = backend._running[future]
        while clock._clock_id is None:
            time.sleep(0.005)
        assert backend.cpu_seconds(future) < 0.25
    assert future.result(timeout=60) is not None


def test_the_cache_is_bounded_and_keyed_by_the_spec(tiny_served_model: Path) -> None:
    backend = GrammarBackend(str(tiny_served_model), 49152, cache_size=2, threads=3)
    first = backend.compile("regex", "a")
    assert backend.compile("regex", "a") is first
    assert backend.compile("ebnf", 'root ::= "a"') is not first  # the field is in the key
    backend.compile("regex", "b")
    assert ("regex", "a") not in backend._cache and len(backend._cache) == 2
    assert first.result(timeout=30) is not None


def test_grammars_compile_on_threads_that_run_only_when_a_core_would_idle(
    tiny_served_model: Path,
) -> None:
    """SCHED_IDLE, which Linux sets per thread (policy 5 in /proc/<pid>/task/<tid>/sched): a big
    schema compiling takes no slice from the forward's threads (bench_structured.py)."""
    backend = GrammarBackend(str(tiny_served_model), 49152)
    assert backend._pool.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the scheduler's own thread is untouched


def test_without_a_backend_a_grammar_is_refused(runner: ModelRunner) -> None:
    config = SchedulerConfig(
        max_total_tokens=runner.max_total_tokens,
        max_running_requests=4,
        max_prefill_tokens=64,
        chunked_prefill_size=64,
        context_len=256,
        eos_token_ids=frozenset({2}),
    )
    error = Scheduler(config, TpModelWorker(runner)).add_request(gen("r", [1, 2], regex="a"))
    assert isinstance(error, ReqError) and error.message.startswith("regex")
