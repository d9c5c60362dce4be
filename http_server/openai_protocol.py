"""OpenAI's request bodies (/v1/completions, /v1/chat/completions), and their conversion to the
wire's `generate` requests: one per prompt, its `n` completions under it.

Field names and defaults are OpenAI's; the extras are those SGLang and vLLM accept. An unknown
field, or a value out of its range, is refused with a message naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from radixserve.http_server.tool_grammar import tool_call_schema
from radixserve.protocol.wire import (
    MAX_INPUT_IDS,
    MAX_MESSAGES,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    GenerateRequest,
    GrammarSpec,
    SamplingParams,
    StopStrings,
    StopTokenIds,
    check_grammar,
)

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (SGLang's and vLLM's too)
MAX_TOOLS = 128  # OpenAI's limit
MAX_NAME_CHARS = 256
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
# `json_object` output: any JSON object (SGLang's schema for it).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # accepted; the output always follows the schema


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: Name


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


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
    # Constrained decoding: OpenAI's response_format, and SGLang's extras regex and ebnf.
    response_format: ResponseFormat | None = None
    regex: GrammarSpec | None = None
    ebnf: GrammarSpec | None = None

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
    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


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
    given |= grammar_params(req)
    try:
        params = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as e:
        raise ValueError(str(e).replace("max_new_tokens", "max_tokens")) from None
    return params, set(given)


def grammar_params(req: _OpenAIRequest) -> dict[str, str]:
    """The wire's grammar field ({"json_schema" | "regex" | "ebnf": spec}, or nothing) of the
    request's constraint: response_format, regex, ebnf, or a tool_choice that forces a call.
    ValueError names the fields when more than one is given, or the one at fault."""
    constraints: dict[str, tuple[str, str]] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        constraints["response_format"] = ("json_schema", JSON_OBJECT_SCHEMA)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError("response_format: type json_schema needs its json_schema")
        schema = fmt.json_schema.schema
        text = JSON_OBJECT_SCHEMA if schema is None else msgspec.json.encode(schema).decode()
        constraints["response_format"] = ("json_schema", text)
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            constraints[name] = (name, getattr(req, name))
    if isinstance(req, ChatCompletionRequest):
        tool_schema = forced_tool_schema(req)
        if tool_schema is not None:
            constraints["tool_choice"] = ("json_schema", tool_schema)
    if len(constraints) > 1:
        raise ValueError(f"only one of {', '.join(constraints)} may be given")
    for name, (field, spec) in constraints.items():
        try:
            check_grammar(field, spec)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        return {field: spec}
    return {}


def forced_tool_schema(req: ChatCompletionRequest) -> str | None:
    """The JSON schema that enforces a tool call when tool_choice is "required" or names a
    function (tool_grammar.py); None otherwise."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    functions = {tool.function.name: tool.function.parameters for tool in req.tools or []}
    name = None if isinstance(choice, str) else choice.function.name
    return tool_call_schema(functions, name)


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
