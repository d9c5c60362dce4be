"""Req: one generation request as the scheduler sees it.

The vLLM v1 view: a request is `num_computed_tokens` (tokens whose KV is in the pool) racing
`num_tokens` (prompt + outputs so far). Far behind = prefill (maybe in chunks); one behind = decode.

    tokens:   [ prompt ........................ | outputs ...... ]
    KV:       [ tree's prefix | own ....... ]        ^ num_tokens
                  kv.cached_len ^           ^ num_computed_tokens

While it runs it holds a KVHandle from KVManager: its row, whose first `kv.cached_len` slots
belong to the prefix cache; the rest, up to `num_computed_tokens`, are the request's own.
Who writes what: KVManager `kv`; the scheduler the progress (`num_computed_tokens`, outputs,
`future_ids`, `seen`, `grammar`) and the end (`finished_reason`); output.py `num_sent_tokens`.

A step counts as done when it is launched: its emitted token joins the request at once as a
placeholder in `future_ids` (negative, FutureMap's), and becomes a real token in `output_ids`
when the step's result comes back. So the next step can be planned, and its input built, while
this one still runs (overlap scheduling); without overlap the result comes back at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from radixserve.protocol.internal import ReqError, TokenizedGenerateReq
from radixserve.protocol.wire import (
    FinishReason,
    SamplingParams,
    check_output_top_logprobs,
    check_prompt_top_logprobs,
)
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_handle import KVHandle
from radixserve.scheduler.ngram import SpecState
from radixserve.scheduler.seen_tokens import SeenTokens

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from radixserve.scheduler.reasoning_grammar import ThinkThenGrammar


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) plus the client's stop_token_ids
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)  # real tokens only
    future_ids: list[int] = field(default_factory=list)  # placeholders of outputs in flight
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv: KVHandle | None = None  # while it runs
    seen: SeenTokens | None = None  # what its penalties read; None without penalties
    finished_reason: FinishReason | None = None
    num_sent_tokens: int = 0  # outputs already handed to the detokenizer
    # Prompt tokens whose KV came from the prefix cache, counted at its first admission: a
    # recompute after a retraction finds its own KV there, which is no cache hit.
    cached_tokens: int = 0
    retracted: bool = False  # ever sent back to the waiting queue
    # Prompt logprobs (logprob_start_len >= 0): those of prompt tokens start.. so far, in order.
    logprob_start_len: int = -1
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt_only: bool = False  # max_new_tokens 0 with prompt logprobs: its one sample is dropped

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still missing: its prompt must then be computed, not
        matched in the prefix cache (SGLang does the same)."""
        start = self.logprob_start_len
        return start >= 0 and start + len(self.input_token_logprobs) < len(self.origin_input_ids)

    # Its grammar's matcher (constrained decoding, scheduler/grammar.py), from when its grammar
    # compiled: it has accepted exactly `output_ids` (the thinking's, with --reasoning-parser).
    grammar: GrammarMatcher | ThinkThenGrammar | None = None
    spec: SpecState | None = None  # its drafting state, once it has drafted (speculation.py)

    @property
    def num_outputs(self) -> int:
        """Outputs so far, those still in flight included."""
        return len(self.output_ids) + len(self.future_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.origin_input_ids) + self.num_outputs

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_outputs > 0

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - self.num_outputs

    def reached_length(self, context_len: int) -> bool:
        """Whether its outputs (in flight included) already end it by max_new_tokens or the
        context: it needs no more steps."""
        return self.remaining_new_tokens <= 0 or self.num_tokens >= context_len

    @property
    def last_token(self) -> int:
        """The input of its next decode step: a placeholder while the last output is in flight."""
        return (self.future_ids or self.output_ids or self.origin_input_ids)[-1]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def streams_steps(self) -> bool:
        """Whether its tokens go to the detokenizer every step: to stream them, or to let the
        detokenizer match stop strings while there is still something to stop."""
        return self.stream or bool(self.sampling_params.stop)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs (placeholders of those in flight last),
        without building the whole list."""
        n_in = len(self.origin_input_ids)
        if end <= n_in:
            return self.origin_input_ids[start:end]
        outputs = self.output_ids + self.future_ids if self.future_ids else self.output_ids
        if start >= n_in:
            return outputs[start - n_in : end - n_in]
        return self.origin_input_ids[start:] + outputs[: end - n_in]

    def resolve_output(self, token: int) -> None:
        """The oldest output in flight came back: it is `token`."""
        del self.future_ids[0]
        self.output_ids.append(token)

    def check_finished(self, last: int, context_len: int) -> None:
        """After a new real output token `last`: stop token, max_new_tokens, or the context
        limit."""
        n_out = len(self.output_ids)
        if last in self.stop_token_ids:
            self.finished_reason = FinishReason("stop", last)
        elif (
            n_out >= self.sampling_params.max_new_tokens
            or len(self.origin_input_ids) + n_out >= context_len
        ):
            self.finished_reason = FinishReason("length")


def make_req(msg: TokenizedGenerateReq, config: SchedulerConfig) -> Req | ReqError:
    """The first conversion of the data path: the request as the scheduler keeps it, or the error
    that refuses it at once (it could never fit the context or the whole KV pool)."""
    params = msg.sampling_params
    n_prompt = len(msg.input_ids)
    if n_prompt == 0:  # nothing to prefill: admission would take it and stop, again and again
        return ReqError(msg.rid, "invalid_request", "the prompt has no tokens")
    if n_prompt >= config.context_len:
        return ReqError(
            msg.rid,
            "too_long",
            f"This model's maximum context length is {config.context_len} tokens. However, "
            f"the prompt has {n_prompt}, which leaves no room for a new token",
        )
    # Clipped to the context, as SGLang and vLLM do: admission reserves KV for max_new_tokens,
    # so an unclipped one could be accepted here and never admitted, blocking the queue.
    max_new = min(params.max_new_tokens, config.context_len - n_prompt)
    if max_new != params.max_new_tokens:
        min_new = min(params.min_new_tokens, max_new)
        params = msgspec.structs.replace(params, max_new_tokens=max_new, min_new_tokens=min_new)
    peak = n_prompt + max_new
    if peak > config.max_total_tokens:
        return ReqError(
            msg.rid,
            "too_long",
            f"prompt + max_new_tokens needs {peak} KV tokens; the whole KV pool holds "
            f"{config.max_total_tokens} (--max-total-tokens)",
        )
    start = min(msg.logprob_start_len, n_prompt - 1)
    if msg.return_logprob:
        top = msg.top_logprobs_num
        try:
            if start >= 0:
                check_prompt_top_logprobs("top_logprobs_num", top, n_prompt - start)
            check_output_top_logprobs("top_logprobs_num", top, max_new, "max_new_tokens")
        except ValueError as e:
            return ReqError(msg.rid, "invalid_request", str(e))
    prompt_only = start >= 0 and params.max_new_tokens == 0
    if prompt_only:  # the prompt must run: one token is sampled, and not returned
        params = msgspec.structs.replace(params, max_new_tokens=1, min_new_tokens=0)
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= config.eos_token_ids
    return Req(
        msg.rid,
        msg.input_ids,
        params,
        msg.stream,
        frozenset(stop_ids),
        return_logprob=msg.return_logprob,
        top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
        seen=SeenTokens.of(msg.input_ids, []) if params.has_penalties else None,
        logprob_start_len=start,
        # The first token of a prompt has no logprob: nothing came before it.
        input_token_logprobs=[(None, msg.input_ids[0])] if start == 0 else [],
        input_top_logprobs=[[]] if start == 0 else [],
        prompt_only=prompt_only,
    )
