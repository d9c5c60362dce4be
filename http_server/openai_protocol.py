"""OpenAI's request bodies (/v1/completions, /v1/chat/completions), and their conversion to the
wire's `generate` requests: one per prompt, its `n` completions under it.

Field names and defaults are OpenAI's; the extras are those SGLang and vLLM accept. An unknown
field, or a value out of its range, is refused with a message naming it.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from radixserve.http_server.lenient_json import decode_mended, without_nulls
from radixserve.http_server.tool_grammar import tool_call_schema
from radixserve.protocol.wire import (
    MAX_INPUT_IDS,
    MAX_MESSAGES,
    MAX_OUTPUT_TOP_LOGPROBS,
    MAX_TOP_LOGPROBS,
    GenerateRequest,
    GrammarSpec,
    LogitBias,
    SamplingParams,
    StopStrings,
    StopTokenIds,
    check_grammar,
    check_in_vocabulary,
    check_output_top_logprobs,
    check_prompt_top_logprobs,
)

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (SGLang's and vLLM's too)
MAX_TOOLS = 128  # OpenAI's limit
MAX_NAME_CHARS = 256
# OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA = 16
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
# `json_object` output: any JSON object (SGLang's schema for it).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=MAX_METADATA),
]


class BadField(ValueError):
    """A request the server cannot honour, naming the field at fault (OpenAI's `param`)."""

    def __init__(self, param: str, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


_AT_PATH = re.compile(r"at (?:`key` in )?`\$\.(\w+)")  # a map's key: "at `key` in `$.f`"
_UNKNOWN_FIELD = re.compile(r"unknown field `(\w+)`")


def field_of(error: msgspec.ValidationError) -> str | None:
    """The top-level field a decoding error is about, from msgspec's message: its path's first
    step where it has one (an error inside `messages` names `messages`)."""
    match = _AT_PATH.search(str(error)) or _UNKNOWN_FIELD.search(str(error))
    return None if match is None else match.group(1)


RequestT = TypeVar("RequestT", bound="_OpenAIRequest")


def decode_request(body: bytes, kind: type[RequestT]) -> RequestT:
    """A request body as `kind`. A null for one of the request's own fields is its default:
    OpenAI's fields are "... or null", and its SDKs send an argument given as None as an
    explicit null."""
    return decode_mended(_decoder(kind), body, lambda raw: without_nulls(raw, kind), _NULL)


_NULL = ("got `null`",)


@functools.cache
def _decoder(kind: type[RequestT]) -> msgspec.json.Decoder[RequestT]:
    return msgspec.json.Decoder(kind)


# A message, its tool calls and stream_options take fields beyond ours, as vLLM's and SGLang's
# do: OpenAI's own (a message's `refusal`, `audio`, `annotations`, which its SDKs write back into
# the history), or a later API's. The request's own fields, and what describes tools and output
# formats, are checked by name.
class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # accepted; the output always follows the schema


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _OpenAIRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
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
    logit_bias: LogitBias | None = None
    # OpenAI's fields about the request rather than its output: accepted, unused.
    user: Name | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
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


class FunctionCall(msgspec.Struct):
    name: Name
    arguments: str  # JSON text, as OpenAI's


class ToolCall(msgspec.Struct):
    id: Name
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct, omit_defaults=True):
    """A message of the conversation: `content` a text or a list of parts (text only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
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


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# chat_template_kwargs: variables for the template, plain values only (a template of the
# client's own, or a tokenizer option, would run through apply_chat_template's own arguments).
TemplateKwargs = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], str | int | float | bool | None],
    msgspec.Meta(max_length=32),
]


@functools.cache
def _template_own_arguments() -> frozenset[str]:
    """The arguments apply_chat_template takes itself (chat_template, tokenize, ...): a
    request's chat_template_kwargs cannot set them."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in parameters.items() if p.kind != p.VAR_KEYWORD)


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's and vLLM's extras.
    chat_template_kwargs: TemplateKwargs | None = None
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart

    @property
    def parses_tools(self) -> bool:
        """Whether a tool call parser reads the output: tools given, and not turned off."""
        return bool(self.tools) and self.tool_choice != "none"


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


def sampling_params(req: _OpenAIRequest, max_tokens: int) -> tuple[SamplingParams, set]:
    """The wire's sampling parameters, and the names of those the request gave (the model's
    defaults fill the others). BadField names a bad field."""
    given: dict[str, Any] = {
        name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None
    }
    given["max_new_tokens"] = max_tokens
    if req.min_tokens:
        given["min_new_tokens"] = req.min_tokens
    if req.logit_bias:
        given["logit_bias"] = req.logit_bias
    if req.stop is not None:
        given["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    given |= grammar_params(req)
    try:
        params = msgspec.convert(given, SamplingParams)
    except msgspec.ValidationError as e:
        message = str(e).replace("min_new_tokens", "min_tokens")
        message = message.replace("max_new_tokens", "max_tokens")
        raise BadField(field_of(e) or _first_named(message), message) from None
    return params, set(given)


def _first_named(message: str) -> str:
    """The OpenAI field a SamplingParams check's message begins with."""
    return message.split(" ", 1)[0].replace("max_new_tokens", "max_tokens")


def check_stream_options(req: _OpenAIRequest) -> None:
    """stream_options only with stream: true (OpenAI's 400, and vLLM's)."""
    if req.stream_options is not None and not req.stream:
        raise BadField("stream_options", "stream_options is only allowed with stream: true")


def check_token_ids(req: _OpenAIRequest, vocab_size: int) -> None:
    """Token ids the request names (logit_bias, stop_token_ids) are in the vocabulary."""
    for field, ids in (
        ("logit_bias", req.logit_bias or {}),
        ("stop_token_ids", req.stop_token_ids or []),
    ):
        try:
            check_in_vocabulary(field, ids, vocab_size)
        except ValueError as e:
            raise BadField(field, str(e)) from None


def max_new_tokens(
    requested: int | None,
    default: int | None,
    prompt: int,
    limits: tuple[int, int],
    field: str = "max_tokens",
) -> int:
    """The output's length limit: `requested` (the request's `field`) when given, and then
    prompt + it must fit the context (a 400, in vLLM's words); else `default`, else what the
    context and the KV pool leave (as vLLM and SGLang do for chat). `limits`: (context length,
    KV pool tokens)."""
    context, kv_tokens = limits
    room = max(context - prompt, 0)  # none: the scheduler refuses the prompt (too_long)
    if requested is None:
        return max(min(context, kv_tokens) - prompt, 0) if default is None else default
    if requested > room:
        raise BadField(
            field,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt + requested} tokens ({prompt} in the prompt, {requested} in the "
            f"completion: {field}). Please reduce the length of the prompt or the completion.",
            "too_long",
        )
    return requested


def grammar_params(req: _OpenAIRequest) -> dict[str, str]:
    """The wire's grammar field ({"json_schema" | "regex" | "ebnf": spec}, or nothing) of the
    request's constraint: response_format, regex, ebnf, or a tool_choice that forces a call.
    ValueError names the fields when more than one is given, or the one at fault."""
    constraints = _constraints(req)
    if len(constraints) > 1:
        raise BadField(
            next(iter(constraints)), f"only one of {', '.join(constraints)} may be given"
        )
    for name, (field, spec) in constraints.items():
        try:
            check_grammar(field, spec)
        except ValueError as e:
            raise BadField(name, f"{name}: {e}") from None
        return {field: spec}
    return {}


def constraint_field(req: _OpenAIRequest) -> str | None:
    """The request's field that its grammar comes from (grammar_params allows one), if any:
    what a compile error names as its `param`."""
    return next(iter(_constraints(req)), None)


def _constraints(req: _OpenAIRequest) -> dict[str, tuple[str, str]]:
    """The request's constraints: its field's name -> (the wire's grammar field, its spec)."""
    constraints: dict[str, tuple[str, str]] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        constraints["response_format"] = ("json_schema", JSON_OBJECT_SCHEMA)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise BadField(
                "response_format", "response_format: type json_schema needs its json_schema"
            )
        schema = fmt.json_schema.schema
        text = JSON_OBJECT_SCHEMA if schema is None else msgspec.json.encode(schema).decode()
        constraints["response_format"] = ("json_schema", text)
    for name in ("regex", "ebnf"):
        if getattr(req, name) is not None:
            constraints[name] = (name, getattr(req, name))
    if isinstance(req, ChatCompletionRequest):
        try:
            tool_schema = forced_tool_schema(req)
        except ValueError as e:
            raise BadField("tool_choice", str(e)) from None
        if tool_schema is not None:
            constraints["tool_choice"] = ("json_schema", tool_schema)
    return constraints


def forced_tool_schema(req: ChatCompletionRequest) -> str | None:
    """The JSON schema that enforces a tool call when tool_choice is "required" or names a
    function (tool_grammar.py); None otherwise."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    functions = {tool.function.name: tool.function.parameters for tool in req.tools or []}
    name = None if isinstance(choice, str) else choice.function.name
    return tool_call_schema(functions, name, parallel=req.parallel_tool_calls is not False)


def completion_generates(
    req: CompletionRequest, prompt_ids: list[list[int]], limits: tuple[int, int], response_id: str
) -> tuple[list[GenerateRequest], set]:
    """One generate per prompt (its ids tokenized already), prompt i's rid `{response_id}-{i}`
    (as vLLM names them: the id the client has is in the server's log)."""
    top = _logprobs_count("logprobs", req.logprobs)
    generates: list[GenerateRequest] = []
    sent: set[str] = set()
    for i, ids in enumerate(prompt_ids):
        if req.echo and req.logprobs is not None:
            try:
                check_prompt_top_logprobs("logprobs", top, len(ids))
            except ValueError as e:
                raise BadField("logprobs", str(e)) from None
        limit = max_new_tokens(req.max_tokens, COMPLETIONS_MAX_TOKENS, len(ids), limits)
        completions = max(1, req.n) * len(prompt_ids)  # each prompt's limit is the same
        _check_output_top_logprobs("logprobs", top, limit, "max_tokens", completions)
        params, sent = sampling_params(req, limit)
        generate = GenerateRequest(
            rid=f"{response_id}-{i}",
            input_ids=ids,
            sampling_params=params,
            stream=req.stream,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=top,
            # Echoed with logprobs: the prompt's too (lm-eval's loglikelihood requests).
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        )
        generates.append(generate)
    return generates, sent


def chat_generate(
    req: ChatCompletionRequest, input_ids: list[int], limits: tuple[int, int], response_id: str
) -> tuple[GenerateRequest, set]:
    top = _logprobs_count("top_logprobs", req.top_logprobs)
    if top and not req.logprobs:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    # OpenAI's newer name first, as vLLM reads them.
    field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    requested = getattr(req, field)
    limit = max_new_tokens(requested, None, len(input_ids), limits, field)
    if requested is None and top:  # what the context leaves, within the logprobs' bound
        limit = min(limit, max(1, MAX_OUTPUT_TOP_LOGPROBS // (top * max(1, req.n))))
    _check_output_top_logprobs("top_logprobs", top, limit, field, max(1, req.n))
    params, sent = sampling_params(req, limit)
    generate = GenerateRequest(
        rid=f"{response_id}-0",
        input_ids=input_ids,
        sampling_params=params,
        stream=req.stream,
        return_logprob=req.logprobs,
        top_logprobs_num=top,
    )
    return generate, sent


def check_tool_choice(req: ChatCompletionRequest) -> None:
    """Any tool_choice but `none` needs tools (a named one among them: forced_tool_schema)."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise BadField("tool_choice", f"tool_choice {shown} needs tools")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as transformers' chat templates read it: text content (parts joined),
    tool calls with their arguments as objects (as vLLM hands them to templates)."""
    messages = []
    for i, message in enumerate(req.messages):
        entry: dict[str, Any] = {"role": message.role, "content": _text(i, message.content)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            if message.role != "assistant":
                raise BadField("messages", f"messages[{i}]: only an assistant makes tool_calls")
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        messages.append(entry)
    return messages


def _text(i: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadField(
                "messages",
                f"messages[{i}].content[{j}]: a {kind!r} part is not supported: this server "
                "reads text parts only",
            )
        texts.append(part["text"])
    return "".join(texts)


def _template_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    return None if not req.tools else msgspec.to_builtins(req.tools)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = req.chat_template_kwargs or {}
    clash = sorted(_template_own_arguments() & kwargs.keys())
    if clash:
        raise BadField("chat_template_kwargs", f"chat_template_kwargs cannot set {clash[0]}")
    return kwargs


def prompts(prompt: str | list[Any]) -> list[Any]:
    """The prompts of a `prompt` field: a text, token ids, a list of texts or of id lists; none
    of them empty (as vLLM refuses one)."""
    found = _prompts(prompt)
    if not found or not all(found):
        raise BadField("prompt", "prompt must not be empty")
    return found


def _prompts(prompt: str | list[Any]) -> list[Any]:
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
            raise BadField("prompt", f"prompt: at most {MAX_PROMPTS} prompts in one request")
        return converted
    raise BadField("prompt", "prompt must be a string, a list of token ids, or a list of either")


def _check_output_top_logprobs(
    field: str, top: int, limit: int, length_field: str, completions: int
) -> None:
    try:
        check_output_top_logprobs(field, top, limit, length_field, completions)
    except ValueError as e:
        raise BadField(field, str(e)) from None


def _logprobs_count(field: str, value: int | None) -> int:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadField(field, f"{field} must be in [0, {MAX_TOP_LOGPROBS}]")
    return value or 0
