"""Incremental, UTF-8-safe detokenization of a batch of requests (SGLang's and vLLM's offsets).

A byte-level BPE token can hold part of a multi-byte character (one emoji is often three or four
tokens), and a SentencePiece token's leading space depends on the token before it. So a request's
new tokens are decoded together with a few already-emitted tokens as context, and the new text is
the difference of the two decodes, held back while it ends in half a character.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from protocol.internal import ReqStrOut, ReqTokenOut
from protocol.wire import FinishReason

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

    def windows(self, end: int) -> tuple[list[int], list[int]]:
        """The emitted context alone, and the context followed by the new ids up to `end`."""
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset : end]


class IncrementalDetokenizer:
    """Turns each step's new token ids into new text, keeping per-request state until finish."""

    def __init__(self, tokenizer: BatchDecoder):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def step(self, outs: list[ReqTokenOut]) -> list[ReqStrOut]:
        """One ReqStrOut per ReqTokenOut, in order; its text may be empty while a char is split."""
        states = [self._extend(out) for out in outs]
        new_texts = self._decode_new_texts(outs, states)
        return [self._emit(out, s, text) for out, s, text in zip(outs, states, new_texts)]

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

    def _emit(self, out: ReqTokenOut, state: DecodeState, new_text: str) -> ReqStrOut:
        if out.finished_reason is not None:
            # Nothing follows, so whatever is left goes out, even half a character.
            del self.states[out.rid]
            new_text = _trim_stop_str(new_text, out.finished_reason, state.read_offset > 0)
        elif new_text and not new_text.endswith(REPLACEMENT_CHAR):
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)
        else:
            new_text = ""
        return ReqStrOut(
            rid=out.rid,
            text=new_text,
            new_token_ids=out.new_token_ids,
            finished_reason=out.finished_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
        )


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


def _trim_stop_str(text: str, reason: FinishReason, streamed_before: bool) -> str:
    """Cut a matched stop string, and anything decoded after it, from a request's last text.

    The scheduler stops at the token that completes the stop string, so the string ends in this
    text. When earlier text was already streamed, the string may have begun there: that head is
    gone, and only its tail at the start of this text can still be cut.
    """
    stop = reason.matched
    if not isinstance(stop, str) or not stop:
        return text
    pos = text.find(stop)
    if pos != -1:
        return text[:pos]
    if streamed_before and any(text.startswith(stop[k:]) for k in range(1, len(stop))):
        return ""
    return text
