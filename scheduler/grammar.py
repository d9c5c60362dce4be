"""Constrained decoding on the scheduler's side (xgrammar), as SGLang places it.

A request with a grammar (json_schema, regex or ebnf) first waits in the GrammarQueue while its
grammar compiles on GrammarBackend's threads (xgrammar releases the GIL while it compiles), or waits
for one of them (they are bounded, a compile past its timeout included), so nobody else waits for
it; each distinct spec compiles once (a bounded LRU cache keyed by its text, in-flight compiles
shared). When its grammar is ready the request gets its own matcher (`Req.grammar`; after the
thinking, for a reasoning model) and joins the waiting queue. Each step, `vocab_mask` fills one
packed bitmask for the batch's constrained rows from their matchers; the sampler applies it; the
scheduler advances a matcher with each accepted token, and the request ends when its grammar is
complete.

A retracted request keeps its outputs (they are recomputed, not resampled), so its matcher, which
has accepted exactly those, stays as it is: nothing to roll back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from radixserve.protocol.internal import ReqError
from radixserve.protocol.reasoning_tags import END, START, ThinkTags, starts_thinking, think_tags
from radixserve.protocol.wire import FinishReason
from radixserve.scheduler.reasoning_grammar import ThinkThenGrammar
from radixserve.scheduler.req import Req

if TYPE_CHECKING:
    # Imported where a grammar is first used: xgrammar, and the transformers it imports, took
    # ~0.8 s of every scheduler's start.
    import xgrammar as xgr

logger = logging.getLogger("radixserve.scheduler")

COMPILE_THREADS = 2
CACHE_SIZE = 256  # distinct compiled grammars kept
COMPILE_TIMEOUT_S = 30.0  # CPU seconds a compile may take (client input: bounded)
# A request's wall time in the grammar queue, at most: a compile at idle priority on a busy
# machine gets little CPU, so its CPU time bounds the work and this the wait.
WALL_LIMIT_FACTOR = 4

_GRAMMAR = attrgetter("grammar")


def _yield_to_forward() -> None:
    """A compile thread runs only when a core would otherwise idle: on a CPU the forward's
    threads share the same cores, and a big schema compiling at their priority took a core from
    every running request's steps (ITL p99 2.51x, bench_structured.py; 1.10x at nice 19, whose
    weight of 15 still takes a slice). Linux schedules threads one by one: SCHED_IDLE (weight 3)
    for this thread alone, which any user may ask for; nice 19 where it is refused."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


class GrammarBackend:
    """Compiles grammars for one tokenizer, off the scheduler's thread. `compile` is called from
    the scheduler's thread only; the pool's threads only run `_compile`.

    A compile cannot be stopped, and one past its request's timeout still holds its thread until
    it ends: at most `threads` compiles are handed to the pool at a time, those included, so a
    stream of pathological grammars queues no work behind them that nobody waits for."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        cache_size: int = CACHE_SIZE,
        threads: int = COMPILE_THREADS,
        reasoning_parser: str | None = None,
    ):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the logits' width, which the masks cover
        self.reasoning_parser = reasoning_parser
        self._tags: ThinkTags | None = None  # the thinking's tags (ids), with the compiler
        self.cache_size = cache_size
        self.threads = threads
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix="grammar-compile", initializer=_yield_to_forward
        )
        # Handed to the pool and not done, each with its thread's CPU clock once it starts.
        self._running: dict[Future[xgr.CompiledGrammar], _CpuClock] = {}
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    def compile(self, field: str, spec: str) -> Future[xgr.CompiledGrammar] | None:
        """The compiled grammar of `spec` (given as `field`), now or later; None while every
        compile thread is taken: ask again."""
        key = (field, spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self.busy() >= self.threads:
            return None
        clock = _CpuClock()
        future = self._pool.submit(self._compile, field, spec, clock)
        self._running[future] = clock
        self._cache[key] = future
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def matcher(
        self, compiled: xgr.CompiledGrammar, prompt_ids: list[int]
    ) -> xgr.GrammarMatcher | ThinkThenGrammar:
        """A request's own matcher over a grammar this backend compiled: after the thinking, for
        a reasoning model."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        if self.reasoning_parser is None or self._tags is None:
            return matcher
        thinking = starts_thinking(self.reasoning_parser, prompt_ids, self._tags)
        return ThinkThenGrammar(matcher, self._tags, thinking)

    def busy(self) -> int:
        """Compiles running now, those whose requests timed out included."""
        self._running = {f: c for f, c in self._running.items() if not f.done()}
        return len(self._running)

    def cpu_seconds(self, future: Future[xgr.CompiledGrammar]) -> float:
        """The CPU time a running compile has taken so far (0 before it starts)."""
        clock = self._running.get(future)
        return 0.0 if clock is None else clock.seconds()

    def _compile(self, field: str, spec: str, clock: _CpuClock) -> xgr.CompiledGrammar:
        clock.start()
        compiler = self._get_compiler()
        if field == "json_schema":
            # No free whitespace: a small model at temperature 1 could otherwise pad forever.
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if field == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_grammar(spec)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        """Built by the first compile (its tokenizer takes ~0.5 s), on a pool thread."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                if self.reasoning_parser is not None:
                    self._tags = think_tags(tokenizer)
                    if self._tags is None:
                        logger.warning(
                            "--reasoning-parser %s: %s and %s are not one token each in this "
                            "tokenizer; grammars hold from the first output token",
                            self.reasoning_parser,
                            START,
                            END,
                        )
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                # Our own cache above: xgrammar's would keep a second copy. One thread per
                # compile: the forward's threads already take every core.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


class _CpuClock:
    """The CPU time one compile has taken on its pool thread, read from the scheduler's thread.
    A pool thread runs compile after compile: its clock counts from the thread's start, so the
    compile's time is the clock past its reading at the compile's start."""

    def __init__(self) -> None:
        self._clock_id: int | None = None
        self._started_at = 0.0

    def start(self) -> None:  # on the compile's thread
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
        self._started_at = time.clock_gettime(clock_id)
        self._clock_id = clock_id  # last: `seconds` reads _started_at once this is set

    def seconds(self) -> float:
        if self._clock_id is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock_id) - self._started_at
        except OSError:  # the thread ended just now
            return 0.0


@dataclass(slots=True)
class _Compiling:
    req: Req
    field: str
    spec: str
    future: Future[xgr.CompiledGrammar] | None  # None: waits for a compile thread
    arrived: float


class GrammarQueue:
    """Requests whose grammar is compiling, or waits for a compile thread (in arrival order).
    Owned by the scheduler's thread."""

    def __init__(self, backend: GrammarBackend, timeout_s: float = COMPILE_TIMEOUT_S):
        self.backend = backend
        self.timeout_s = timeout_s  # a compile's CPU time
        self.wall_limit_s = WALL_LIMIT_FACTOR * timeout_s  # the whole time in this queue
        self._compiling: list[_Compiling] = []

    def __len__(self) -> int:
        return len(self._compiling)

    def add(self, req: Req, field: str, spec: str) -> None:
        future = self.backend.compile(field, spec)
        self._compiling.append(_Compiling(req, field, spec, future, time.monotonic()))

    def remove(self, rid: str) -> Req | None:
        for entry in self._compiling:
            if entry.req.rid == rid:
                self._compiling.remove(entry)
                return entry.req
        return None

    def take_ready(self) -> tuple[list[Req], list[ReqError]]:
        """The requests whose grammar is ready, each with its own matcher, in arrival order, and
        the errors of those whose grammar failed to compile or took too long: more than
        `timeout_s` of CPU time compiling, or `wall_limit_s` in this queue in all (waiting for a
        compile thread included: the time here is bounded)."""
        ready: list[Req] = []
        errors: list[ReqError] = []
        now = time.monotonic()
        still: list[_Compiling] = []
        for entry in self._compiling:
            rid, field = entry.req.rid, entry.field
            waited = now - entry.arrived
            if entry.future is None and waited <= self.wall_limit_s:
                entry.future = self.backend.compile(field, entry.spec)
            if entry.future is None:
                if waited > self.wall_limit_s:
                    message = (
                        f"{field} waited {self.wall_limit_s:g} s for a compile thread (the "
                        "server's grammar compiles are all taken); retry later"
                    )
                    errors.append(ReqError(rid, "overloaded", message))
                else:
                    still.append(entry)
            elif entry.future.done():
                error = entry.future.exception()
                if error is None:
                    req = entry.req
                    req.grammar = self.backend.matcher(entry.future.result(), req.origin_input_ids)
                    ready.append(req)
                else:
                    errors.append(ReqError(rid, "invalid_request", f"{field}: {_reason(error)}"))
            elif self.backend.cpu_seconds(entry.future) > self.timeout_s:
                message = f"{field} did not compile within {self.timeout_s:g} s of CPU time"
                errors.append(ReqError(rid, "invalid_request", message))
            elif waited > self.wall_limit_s:
                message = (
                    f"{field} did not compile within {self.wall_limit_s:g} s (the server is "
                    "busy); retry later"
                )
                errors.append(ReqError(rid, "overloaded", message))
            else:
                still.append(entry)
        self._compiling = still
        return ready, errors


def _reason(error: BaseException) -> str:
    """xgrammar's message without its C++ location prefix ("[time] path.cc:83: ...")."""
    text = str(error).strip()
    _, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.partition(": ")[2] or text
    return text


def has_grammar(reqs: list[Req]) -> bool:
    grammars = list(map(_GRAMMAR, reqs))  # C-level: no Python frame per request
    return grammars.count(None) != len(grammars)


def vocab_mask(reqs: list[Req], emits: list[bool], vocab_size: int) -> torch.Tensor | None:
    """The packed bitmask of the step's batch: each constrained row that samples a real token
    allows what its matcher allows next; every other row allows all. None: no such row. The
    matchers must have accepted every earlier token of their requests (no token in flight)."""
    if not has_grammar(reqs):
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
    for i, (req, emit) in enumerate(zip(reqs, emits)):
        if emit and req.grammar is not None:
            assert not req.future_ids, "a constrained request's last token is still in flight"
            req.grammar.fill_next_token_bitmask(mask, i)
    return mask


def grammar_decides_end(req: Req) -> bool:
    """Whether the request's grammar decides where its output ends now: not while a reasoning
    model thinks (free text, as without a grammar)."""
    grammar = req.grammar
    return grammar is not None and not (isinstance(grammar, ThinkThenGrammar) and grammar.thinking)


def accept_token(req: Req, token: int) -> None:
    """Advance the request's matcher by its new output token; a grammar that is complete, or a
    token it refuses (which the mask should make impossible), ends the request."""
    assert req.grammar is not None
    if not req.grammar.accept_token(token):
        logger.warning("request %s: token %d breaks its grammar; ending it", req.rid, token)
        req.grammar = None
        req.finished_reason = FinishReason("abort")
    elif req.grammar.is_terminated():
        req.finished_reason = FinishReason("stop", token)
