"""OpenAI's request bodies (/v1/completions, /v1/chat/completions), and their conversion to the
wire's `generate` requests: one per prompt, its `n` completions under it.

Field names and defaults are OpenAI's; the extras are those SGLang and vLLM accept. An unknown
field, or a value out of its range, is refused with a message naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from radixserve.protocol.wire import (
    MAX_INPUT_IDS,
    MAX_MESSAGES,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    StopStrings,
    StopTokenIds,
)

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (SGLang's and vLLM's too)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _OpenAIRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, msgspec.Meta(min_length=1)] | StopStrings | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # OpenAI's end-user label: accepted, unused
    # SGLang's and vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int = 0
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest):
    # A text, token ids, or a list of either: checked by `prompts()`, since a msgspec union
    # holds one array type only.
    prompt: str | Annotated[list[Any], msgspec.Meta(min_length=1, max_length=MAX_INPUT_IDS)]
    logprobs: int | None = None  # the top tokens to list at each position (0: only the chosen)
    echo: bool = False


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
)


def sampling_params(req: _OpenAIRequest, max_tokens: int | None) -> tuple[SamplingParams, set]:
    """The wire's sampling parameters, and the names of those the request gave (the model's
    defaults fill the others). ValueError names a bad field."""
    if req.min_tokens:
        raise ValueError("min_tokens is not supported by this server")
    given: dict[str, Any] = {
        name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None
    }
    if max_tokens is not None:
        given["max_new_tokens"] = max_tokens
    if req.stop is not None:
        given["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        params = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as e:
        raise ValueError(str(e).replace("max_new_tokens", "max_tokens")) from None
    return params, set(given)


def completion_generates(req: CompletionRequest) -> tuple[list[GenerateRequest], set]:
    if req.echo:
        raise ValueError("echo is not supported by this server")
    top = _logprobs_count("logprobs", req.logprobs)
    max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params, sent = sampling_params(req, max_tokens)
    generates = [
        GenerateRequest(
            rid=str(i),
            text=prompt if isinstance(prompt, str) else None,
            input_ids=None if isinstance(prompt, str) else list(prompt),
            sampling_params=params,
            stream=req.stream,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=top,
        )
        for i, prompt in enumerate(prompts(req.prompt))
    ]
    return generates, sent


def chat_generate(req: ChatCompletionRequest) -> tuple[GenerateRequest, set]:
    top = _logprobs_count("top_logprobs", req.top_logprobs)
    if top and not req.logprobs:
        raise ValueError("top_logprobs needs logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params, sent = sampling_params(req, max_tokens)
    generate = GenerateRequest(
        rid="0",
        messages=req.messages,
        sampling_params=params,
        stream=req.stream,
        return_logprob=req.logprobs,
        top_logprobs_num=top,
    )
    return generate, sent


def prompts(prompt: str | list[Any]) -> list[Any]:
    """The prompts of a `prompt` field: a text, token ids, a list of texts or of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    kinds: tuple[tuple[bool, Any], ...] = (
        (True, list[int]),
        (False, list[str]),
        (False, list[list[int]]),
    )
    for single, kind in kinds:
        try:
            converted: list[Any] = msgspec.convert(prompt, kind, strict=True)
        except msgspec.ValidationError:
            continue
        if single:
            return [converted]
        if len(converted) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts in one request")
        return converted
    raise ValueError("prompt must be a string, a list of token ids, or a list of either")


def _logprobs_count(field: str, value: int | None) -> int:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{field} must be in [0, {MAX_TOP_LOGPROBS}]")
    return value or 0
