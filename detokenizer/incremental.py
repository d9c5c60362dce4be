"""Incremental, UTF-8-safe detokenization of a batch of requests (SGLang's and vLLM's offsets).

A byte-level BPE token can hold part of a multi-byte character (one emoji is often three or four
tokens), and a SentencePiece token's leading space depends on the token before it. So a request's
new tokens are decoded together with a few already-emitted tokens as context, and the new text is
the difference of the two decodes, held back while it ends in half a character.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from radixserve.protocol.internal import ReqStrOut, ReqTokenOut, StopReq
from radixserve.protocol.wire import FinishReason

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class BatchDecoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def batch_decode(
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]: ...


@dataclass(slots=True)
class DecodeState:
    """One unfinished request's output ids and where its emitted text ends.

        ids:  [ emitted, no longer needed | emitted, context | not emitted yet ]
                                          ^ prefix_offset   ^ read_offset

    Both offsets sit on character boundaries: they only move when the text up to the end of the
    ids decoded to whole characters.
    """

    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    held: str = ""  # decoded text not sent yet because it may begin a stop string

    def windows(self, end: int) -> tuple[list[int], list[int]]:
        """The emitted context alone, and the context followed by the new ids up to `end`."""
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset : end]


class IncrementalDetokenizer:
    """Turns each step's new token ids into new text, keeping per-request state until finish.

    It also matches stop strings: text that may begin one is held back, so a stop string split
    across steps is still found and never half sent. A match ends the request here, at once, and
    asks the scheduler (StopReq) to stop generating; what the scheduler sends for it after that
    is dropped.
    """

    def __init__(self, tokenizer: BatchDecoder):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        self.stopped: set[str] = set()  # ended on a stop string; the scheduler's final is pending

    def __len__(self) -> int:
        return len(self.states)

    def step(self, outs: list[ReqTokenOut]) -> tuple[list[ReqStrOut], list[StopReq]]:
        """Text for each output (it may be empty while a character or a stop string is split),
        and the requests the scheduler must stop."""
        live = [out for out in outs if not self._drop_after_stop(out)]
        states = [self._extend(out) for out in live]
        new_texts = self._decode_new_texts(live, states)
        strs, stops = [], []
        for out, state, text in zip(live, states, new_texts):
            str_out, stop = self._emit(out, state, text)
            strs.append(str_out)
            if stop is not None:
                stops.append(stop)
        return strs, stops

    def _drop_after_stop(self, out: ReqTokenOut) -> bool:
        if out.rid not in self.stopped:
            return False
        if out.finished_reason is not None:
            self.stopped.discard(out.rid)
        return True

    def _extend(self, out: ReqTokenOut) -> DecodeState:
        state = self.states.setdefault(out.rid, DecodeState())
        state.ids.extend(out.new_token_ids)
        return state

    def _decode_new_texts(self, outs: list[ReqTokenOut], states: list[DecodeState]) -> list[str]:
        texts = [""] * len(outs)
        # batch_decode takes one skip_special_tokens for the whole call; batches rarely mix them.
        for skip in {out.skip_special_tokens for out in outs}:
            rows = [i for i, out in enumerate(outs) if out.skip_special_tokens == skip]
            windows = [states[i].windows(_text_end(outs[i], states[i])) for i in rows]
            prefixes = self._batch_decode([prefix for prefix, _ in windows], skip)
            fulls = self._batch_decode([full for _, full in windows], skip)
            for i, prefix, full in zip(rows, prefixes, fulls):
                texts[i] = full[len(prefix) :]
        return texts

    def _batch_decode(self, sequences: list[list[int]], skip: bool) -> list[str]:
        # Clean-up rewrites spaces around punctuation across chunk borders, so a streamed text
        # would no longer equal the same ids decoded at once.
        return self.tokenizer.batch_decode(
            sequences, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )

    def _emit(
        self, out: ReqTokenOut, state: DecodeState, new_text: str
    ) -> tuple[ReqStrOut, StopReq | None]:
        reason = out.finished_reason
        if reason is None and (not new_text or new_text.endswith(REPLACEMENT_CHAR)):
            new_text = ""  # half a character: wait for the rest
        elif reason is None:
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)
        # else: nothing follows, so whatever is left goes out, even half a character
        text, state.held = state.held + new_text, ""
        stop_req = None
        if out.stop:
            cut, matched = _find_stop(text, out.stop)
            if matched is not None:
                text = text[:cut]
                if reason is None:
                    self.stopped.add(out.rid)
                    stop_req = StopReq(out.rid, matched)
                reason = FinishReason("stop", matched)
            elif reason is None:
                keep = _stop_prefix_len(text, out.stop)
                text, state.held = text[: len(text) - keep], text[len(text) - keep :]
        if reason is not None:
            del self.states[out.rid]
        str_out = ReqStrOut(
            rid=out.rid,
            text=text,
            new_token_ids=out.new_token_ids,
            finished_reason=reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_token_logprobs=out.output_token_logprobs,
            output_top_logprobs=out.output_top_logprobs,
        )
        return str_out, stop_req


def _find_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """The earliest stop string in text: (where it starts, which), or (-1, None)."""
    best, matched = -1, None
    for stop in stops:
        pos = text.find(stop)
        if pos != -1 and (best == -1 or pos < best):
            best, matched = pos, stop
    return best, matched


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that a stop string begins with: held back."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


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
