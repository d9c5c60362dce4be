"""Incremental, UTF-8-safe detokenization of a batch of requests (SGLang's and vLLM's offsets).

A byte-level BPE token can hold part of a multi-byte character (one emoji is often three or four
tokens), and a SentencePiece token's leading space depends on the token before it. So a request's
new tokens are decoded together with a few already-emitted tokens as context, and the new text is
the difference of the two decodes, held back while it ends in half a character.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from radixserve.detokenizer.stop_matcher import StopMatcher
from radixserve.detokenizer.tokenizer_handoff import Decoder
from radixserve.protocol.internal import ReqStart, ReqStrOut, ReqTokenOut, StopReq
from radixserve.protocol.wire import FinishReason

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Stopped:
    """A request whose stop string matched, until the scheduler's final output for it."""

    matched: str
    completion_tokens: int  # what the client was sent: the tokens up to the match's step


@dataclass(slots=True)
class DecodeState:
    """One live request, from its first output (which carries `start`) to its final one: its
    output ids, after the prompt's last few (start.context), and where its emitted text ends.

        ids:  [ emitted, no longer needed | emitted, context | not emitted yet ]
                                          ^ prefix_offset   ^ read_offset

    Both offsets sit on character boundaries: they only move when the text up to the end of the
    ids decoded to whole characters.
    """

    start: ReqStart
    stop_matcher: StopMatcher | None  # for a request with stop strings
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    held: str = ""  # decoded text not sent yet because it may begin a stop string
    stopped: Stopped | None = None

    @classmethod
    def of(cls, start: ReqStart, context: list[int]) -> DecodeState:
        """`context`, the prompt's last ids, counts as text already sent: the first output's
        text is what it and the output decode to beyond what it alone does (as SGLang and vLLM
        decode it)."""
        matcher = StopMatcher(start.stop) if start.stop else None
        return cls(start, matcher, context, prefix_offset=0, read_offset=len(context))

    def windows(self, end: int) -> tuple[list[int], list[int]]:
        """The emitted context alone, and the context followed by the new ids up to `end`."""
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset : end]


class IncrementalDetokenizer:
    """Turns each step's new token ids into new text, keeping per-request state until finish.

    A request's state (`states`, its one owner here) begins with its first output, which carries
    what stays the same for its whole life, and ends with its final output: the scheduler sends
    exactly one of each for every request, whether it finishes, is aborted or stopped. An output
    that breaks this is a bug between our own processes, and raises.

    It also matches stop strings: text that may begin one is held back, so a stop string split
    across steps is still found and never half sent. A match sends the text before it and asks
    the scheduler (StopReq) to end the request; the scheduler alone ends requests, so the
    request's final output is the one the scheduler sends next for it, which goes out as
    finished by that stop string. What the scheduler sent in between is dropped.
    """

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.states: dict[str, DecodeState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def step(self, outs: list[ReqTokenOut]) -> tuple[list[ReqStrOut], list[StopReq]]:
        """Text for each output (it may be empty while a character or a stop string is split),
        and the requests the scheduler must stop. A request may have two outputs in one batch
        (with speculation, a step processes the step in flight and then its own): they are
        decoded in turn, each after the one before."""
        strs: list[ReqStrOut] = []
        stops: list[StopReq] = []
        start, rids = 0, set()
        for i, out in enumerate(outs):
            if out.rid in rids:
                done = self._step_distinct(outs[start:i])
                strs += done[0]
                stops += done[1]
                start, rids = i, set()
            rids.add(out.rid)
        done = self._step_distinct(outs[start:])
        return strs + done[0], stops + done[1]

    def _step_distinct(self, outs: list[ReqTokenOut]) -> tuple[list[ReqStrOut], list[StopReq]]:
        """`step` for outputs of distinct requests: their texts are decoded in one batch."""
        strs: list[ReqStrOut] = []
        live, states = [], []
        for out in outs:
            state = self._state(out)
            if state.stopped is None:
                state.ids.extend(out.new_token_ids)
                live.append(out)
                states.append(state)
            elif out.finished_reason is not None:  # what came between match and final is dropped
                strs.append(self._final_after_stop(out, state.start, state.stopped))
        new_texts = self._decode_new_texts(live, states)
        stops = []
        for out, state, text in zip(live, states, new_texts):
            str_out, stop = self._emit(out, state, text)
            strs.append(str_out)
            if stop is not None:
                stops.append(stop)
        return strs, stops

    def _whole_characters(self, start: ReqStart) -> list[int]:
        """The prompt's last ids, less those at its end that stop inside a character: decoded
        alone they may make more replacement characters than the output's completed character
        takes (a SentencePiece byte fallback writes one a byte), which would cut text off."""
        context = list(start.context)
        skip = start.skip_special_tokens
        while context and self._batch_decode([context], skip)[0].endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _state(self, out: ReqTokenOut) -> DecodeState:
        """The request's state: made from its first output, ended with its final one."""
        state = self.states.get(out.rid)
        if out.start is not None:
            if state is not None:
                raise ValueError(f"request {out.rid} started twice")
            context = self._whole_characters(out.start)
            state = self.states[out.rid] = DecodeState.of(out.start, context)
        elif state is None:
            raise ValueError(f"output for request {out.rid}, which has not started or has ended")
        if out.finished_reason is not None:
            del self.states[out.rid]
        return state

    def _final_after_stop(self, out: ReqTokenOut, start: ReqStart, stopped: Stopped) -> ReqStrOut:
        """The scheduler's final for a request whose stop string matched: it ends the request as
        the stop string did, with no more text or tokens."""
        return ReqStrOut(
            rid=out.rid,
            text="",
            new_token_ids=[],
            finished_reason=FinishReason("stop", stopped.matched),
            prompt_tokens=start.prompt_tokens,
            completion_tokens=stopped.completion_tokens,
            cached_tokens=start.cached_tokens,
            output_token_logprobs=None if out.output_token_logprobs is None else [],
            output_top_logprobs=None if out.output_top_logprobs is None else [],
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
        )

    def _decode_new_texts(self, outs: list[ReqTokenOut], states: list[DecodeState]) -> list[str]:
        texts = [""] * len(outs)
        # decode_batch takes one skip_special_tokens for the whole call; batches rarely mix them.
        for skip in {state.start.skip_special_tokens for state in states}:
            rows = [i for i, state in enumerate(states) if state.start.skip_special_tokens == skip]
            windows = [states[i].windows(_text_end(outs[i], states[i])) for i in rows]
            prefixes = self._batch_decode([prefix for prefix, _ in windows], skip)
            fulls = self._batch_decode([full for _, full in windows], skip)
            for i, prefix, full in zip(rows, prefixes, fulls):
                texts[i] = full[len(prefix) :]
        return texts

    def _batch_decode(self, sequences: list[list[int]], skip: bool) -> list[str]:
        return self.decoder.decode_batch(sequences, skip_special_tokens=skip)

    def _emit(
        self, out: ReqTokenOut, state: DecodeState, new_text: str
    ) -> tuple[ReqStrOut, StopReq | None]:
        """The text to send now; a StopReq when a stop string matched in it."""
        reason = out.finished_reason
        before = (state.held, state.prefix_offset, state.read_offset)
        if reason is None and (not new_text or new_text.endswith(REPLACEMENT_CHAR)):
            new_text = ""  # half a character: wait for the rest
        elif reason is None:
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)
        # else: nothing follows, so whatever is left goes out, even half a character
        text, state.held = state.held + new_text, ""
        stop_req = None
        matcher = state.stop_matcher
        found = matcher is not None and matcher.feed(new_text)
        # A request with min_new_tokens never speculates (scheduler/speculation.py): its outputs
        # are a token each, so the minimum ends between two of them.
        if found and out.completion_tokens > state.start.min_new_tokens:
            cut, matched = _find_stop(text, state.start.stop, len(text) - len(new_text))
            text = text[:cut]
            out = self._through_stop(out, state, *before)
            if reason is None:
                state.stopped = Stopped(matched, out.completion_tokens)
                stop_req = StopReq(out.rid, matched)
            else:
                reason = FinishReason("stop", matched)
        elif matcher is not None and reason is None:
            keep = matcher.pending
            text, state.held = text[: len(text) - keep], text[len(text) - keep :]
        str_out = ReqStrOut(
            rid=out.rid,
            text=text,
            new_token_ids=out.new_token_ids,
            finished_reason=reason,
            prompt_tokens=state.start.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=state.start.cached_tokens,
            output_token_logprobs=out.output_token_logprobs,
            output_top_logprobs=out.output_top_logprobs,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
        )
        return str_out, stop_req

    def _through_stop(
        self, out: ReqTokenOut, state: DecodeState, held: str, prefix: int, read: int
    ) -> ReqTokenOut:
        """`out` without its tokens after the one that completes the stop string: with
        speculation one output carries several (vLLM drops them too). Each shorter run of its
        tokens is decoded after the context and held text that `out` came to, until one holds
        a stop string."""
        count = len(out.new_token_ids)
        if count <= 1:
            return out
        first = len(state.ids) - count
        runs = [state.ids[prefix:read]] + [state.ids[prefix : first + k] for k in range(1, count)]
        context, *texts = self._batch_decode(runs, state.start.skip_special_tokens)
        kept = count
        for k, full in enumerate(texts, 1):
            text = held + full[len(context) :]
            if any(stop in text for stop in state.start.stop):
                kept = k
                break
        if kept == count:
            return out
        return msgspec.structs.replace(
            out,
            new_token_ids=out.new_token_ids[:kept],
            completion_tokens=out.completion_tokens - (count - kept),
            output_token_logprobs=_first(out.output_token_logprobs, kept),
            output_top_logprobs=_first(out.output_top_logprobs, kept),
        )


def _first(values: list[T] | None, n: int) -> list[T] | None:
    return None if values is None else values[:n]


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str]:
    """The stop string ending in text[new_from:] (there is one) that ends first, as one streamed
    a character at a time meets it, whatever the outputs' sizes: where it starts, and which.
    ("\n\nHuman:" and "Human" in "yes\n\nHuman:": "Human", at the same text with speculation as
    without.) One ending before new_from went by under min_new_tokens."""
    found = [
        (pos, stop)
        for stop in stops
        if (pos := text.find(stop, max(0, new_from - len(stop) + 1))) != -1
    ]
    return min(found, key=lambda match: (match[0] + len(match[1]), match[0]))


def _text_end(out: ReqTokenOut, state: DecodeState) -> int:
    """Where the ids that make text end: a matched stop token is reported but not shown."""
    reason = out.finished_reason
    ends_in_stop_token = (
        reason is not None
        and isinstance(reason.matched, int)
        and len(state.ids) > state.read_offset
        and state.ids[-1] == reason.matched
    )
    return len(state.ids) - 1 if ends_in_stop_token else len(state.ids)
