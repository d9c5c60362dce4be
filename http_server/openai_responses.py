"""OpenAI's response bodies, built from the wire's `output` replies: whole completions, stream
chunks, usage and logprobs. Plain dicts, encoded by msgspec's JSON encoder."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.wire import OutputReply


@dataclass(frozen=True, slots=True)
class Head:
    """What a response's body, or each of its chunks, repeats: one id and one creation time
    for the whole stream, as OpenAI's."""

    id: str
    created: int
    model: str
    chat: bool


def new_head(model: str, chat: bool) -> Head:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return Head(rid, int(time.time()), model, chat)


@dataclass(slots=True)
class Usage:
    """Token counts of one HTTP request: each prompt once, every completion's output."""

    prompt: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (tokens, cached)
    completion_tokens: int = 0

    def add_final(self, reply: OutputReply) -> None:
        meta = reply.meta_info
        self.completion_tokens += meta.completion_tokens
        # The n completions of a prompt share it; the first to finish tells its counts.
        self.prompt.setdefault(reply.rid, (meta.prompt_tokens, meta.cached_tokens))

    def as_json(self) -> dict[str, Any]:
        prompt_tokens = sum(tokens for tokens, _ in self.prompt.values())
        cached = sum(cached for _, cached in self.prompt.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def prompt_index(reply: OutputReply) -> int:
    """Which of the HTTP request's prompts `reply` answers: its rid ends `-{index}`."""
    return int(reply.rid.rpartition("-")[2])


def choice_index(reply: OutputReply, n: int) -> int:
    """Choices count prompt by prompt, each prompt's n completions in a row (as OpenAI)."""
    return prompt_index(reply) * n + (reply.index or 0)


def finish_reason(reply: OutputReply) -> str | None:
    reason = reply.meta_info.finish_reason
    return None if reason is None else reason.type


# What a logprob of -inf (a token a grammar, logit_bias or min_tokens ruled out) is sent as: JSON
# has no infinity (it was null), OpenAI's logprob is always a number, and vLLM sends this.
MIN_LOGPROB = -9999.0


def _number(logprob: float | None) -> float | None:
    return logprob if logprob is None else max(logprob, MIN_LOGPROB)


def completion_logprobs(
    reply: OutputReply, texts: dict[int, str], output_offset: int
) -> dict[str, Any] | None:
    """/v1/completions' logprobs: parallel lists over the reply's tokens, after the prompt's
    when it is echoed (its first token has no logprob: null, as OpenAI's). `output_offset`:
    where the reply's output tokens begin in its choice's text (after the echoed prompt's text,
    and in a stream after its earlier chunks); the prompt's tokens begin at 0."""
    meta = reply.meta_info
    if meta.output_token_logprobs is None:
        return None
    prompt = meta.input_token_logprobs or []
    prompt_top: list[list[tuple[float, int]] | None] = list(meta.input_top_logprobs or [])
    entries = [*prompt, *meta.output_token_logprobs]
    offsets, offset = [], 0
    for i, (_, token) in enumerate(entries):
        if i == len(prompt):
            offset = output_offset
        offsets.append(offset)
        offset += len(texts[token])
    top: list[list[tuple[float, int]] | None] | None = None
    if meta.output_top_logprobs is not None:
        top = [p if lp is not None else None for p, (lp, _) in zip(prompt_top, prompt)]
        top += meta.output_top_logprobs
    return {
        "tokens": [texts[token] for _, token in entries],
        "token_logprobs": [_number(logprob) for logprob, _ in entries],
        "top_logprobs": None
        if top is None
        else [None if p is None else {texts[t]: _number(lp) for lp, t in p} for p in top],
        "text_offset": offsets,
    }


def chat_logprobs(reply: OutputReply, texts: dict[int, str]) -> dict[str, Any] | None:
    """/v1/chat/completions' logprobs: one entry per token, with its top alternatives."""
    meta = reply.meta_info
    if meta.output_token_logprobs is None:
        return None
    top = meta.output_top_logprobs or [[] for _ in meta.output_token_logprobs]

    def entry(logprob: float, token: int) -> dict[str, Any]:
        text = texts[token]
        return {"token": text, "logprob": _number(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp, token), "top_logprobs": [entry(*alt) for alt in alts]}
            for (lp, token), alts in zip(meta.output_token_logprobs, top)
        ]
    }


def logprob_token_ids(reply: OutputReply) -> list[int]:
    """Every token id the reply's logprobs name: their texts are looked up at once."""
    meta = reply.meta_info
    ids = [
        token
        for _, token in [*(meta.input_token_logprobs or []), *(meta.output_token_logprobs or [])]
    ]
    for position in [*(meta.input_top_logprobs or []), *(meta.output_top_logprobs or [])]:
        ids += [token for _, token in position]
    return ids


def completion_body(
    head: Head, choices: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion" if head.chat else "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage.as_json()
    return body


def chunk_body(
    head: Head, choices: list[dict[str, Any]], usage: Usage | None = None
) -> dict[str, Any]:
    body = completion_body(head, choices, usage)
    body["object"] = "chat.completion.chunk" if head.chat else "text_completion"
    return body


def choice(
    reply: OutputReply, n: int, fields: dict[str, Any], logprobs: Any, reason: str | None
) -> dict[str, Any]:
    """A choice, whole or a streamed piece of it: `fields` are its `text`, `message` or
    `delta`. `matched_stop` (SGLang's): what ended it at a stop, the stop string or the token
    id (EOS too); else null."""
    ended = reply.meta_info.finish_reason
    return {
        "index": choice_index(reply, n),
        **fields,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": ended.matched if ended is not None and ended.type == "stop" else None,
    }
