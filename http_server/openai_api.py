"""OpenAI's endpoints: /v1/models, /v1/completions, /v1/chat/completions (streamed as
server-sent events ending in `data: [DONE]`, with usage when `stream_options.include_usage`).

Prompts are tokenized here, before the generates go in as ids: max_tokens is checked against
the context with the prompt's length, chat reads the tools and template variables the wire's
messages do not carry, and echo has the prompt's text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.http_server import openai_protocol as protocol
from radixserve.http_server import openai_responses as out
from radixserve.http_server.chat_output import ChatOutput
from radixserve.http_server.front import (
    SSE_DONE,
    Front,
    HttpError,
    error_body,
    json_response,
    sse,
)
from radixserve.http_server.openai_protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    RequestT,
)
from radixserve.http_server.reasoning_parser import ReasoningParser
from radixserve.http_server.tool_parser import ForcedCalls, ToolCallParser, tool_call_parser
from radixserve.protocol.reasoning_tags import starts_thinking
from radixserve.protocol.wire import GRAMMAR_FIELDS, GenerateRequest, OutputReply
from radixserve.tokenizer_manager.sampling_defaults import fill_sampling_defaults
from radixserve.tokenizer_manager.tokenization import PromptTooLong


class _Choices:
    """How one HTTP request's choices are written: completions' text (the prompt first with
    echo), or chat's message through a ChatOutput per choice."""

    def __init__(
        self, n: int, echoes: list[str] | None, chat_output: Callable[[], ChatOutput] | None
    ):
        self.n = n
        self.echoes = echoes
        self.chat_output = chat_output
        self.outputs: dict[int, ChatOutput] = {}

    def whole(self, reply: OutputReply, logprobs: Any) -> dict[str, Any]:
        reason = out.finish_reason(reply)
        if self.chat_output is None:
            return out.choice(
                reply, self.n, {"text": self.echo(reply) + reply.text}, logprobs, reason
            )
        output = self.chat_output()
        message = output.message(reply.text)
        return out.choice(
            reply, self.n, {"message": message}, logprobs, output.finish_reason(reason)
        )

    def piece(self, reply: OutputReply, first: bool, logprobs: Any) -> dict[str, Any]:
        reason = out.finish_reason(reply)
        if self.chat_output is None:
            text = (self.echo(reply) if first else "") + reply.text
            return out.choice(reply, self.n, {"text": text}, logprobs, reason)
        index = out.choice_index(reply, self.n)
        output = self.outputs.get(index)
        if output is None:
            output = self.outputs[index] = self.chat_output()
        delta = output.delta(reply.text, reply.finished)
        if first:
            delta = {"role": "assistant", **delta}
        return out.choice(reply, self.n, {"delta": delta}, logprobs, output.finish_reason(reason))

    def echo(self, reply: OutputReply) -> str:
        return "" if self.echoes is None else self.echoes[out.prompt_index(reply)]


class OpenAIApi:
    def __init__(self, front: Front, model_name: str, context_length: int):
        self.front = front
        self.model_name = model_name
        self.context_length = context_length
        self.created = int(time.time())
        args = front.manager.args
        self.tool_call_parser = args.tool_call_parser
        self.reasoning_parser = args.reasoning_parser

    async def models(self, request: Request) -> Response:
        """vLLM's model card; 503 until the model is loaded (vLLM is not listening by then)."""
        self.front.authorize(request)
        self.front.check_ready()
        return json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """One model's card by its name (OpenAI's `models.retrieve`)."""
        self.front.authorize(request)
        self.front.check_ready()
        name = request.path_params["model"]
        if name != self.model_name:
            raise HttpError("not_found", f"the model {name!r} does not exist", "model")
        return json_response(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixserve",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.context_length,
        }

    async def completions(self, request: Request) -> Response:
        req = await self._decode(request, CompletionRequest)
        tokenization = self.front.manager.tokenization
        prompts = _checked(protocol.prompts, req.prompt)
        # Each prompt is a request of this client's: past its cap, a 503 would come every time.
        cap = self.front.manager.args.max_pending_requests_per_client
        if len(prompts) > cap:
            message = f"{len(prompts)} prompts: at most {cap} in one request (the server's "
            raise HttpError(
                "invalid_request", message + "--max-pending-requests-per-client)", "prompt"
            )

        async def ids(prompt: Any) -> list[int]:
            text = prompt if isinstance(prompt, str) else None
            ids = None if isinstance(prompt, str) else prompt
            return await tokenization.input_ids_async(GenerateRequest(text=text, input_ids=ids))

        prompt_ids = await _tokenized(asyncio.gather(*map(ids, prompts)))
        head = out.new_head(self.model_name, chat=False)
        generates, sent = _checked(
            protocol.completion_generates, req, prompt_ids, self._limits(), head.id
        )
        echoes = None
        if req.echo:
            echoes = await asyncio.gather(
                *(
                    _as_text(p) if isinstance(p, str) else tokenization.decode_async(p)
                    for p in prompts
                )
            )
        choices = _Choices(req.n, echoes, None)
        return await self._respond(request, req, head, generates, sent, choices)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._decode(request, ChatCompletionRequest)
        _checked(protocol.check_tool_choice, req)
        messages = _checked(protocol.template_messages, req)
        kwargs = _checked(protocol.template_kwargs, req)
        tools = protocol.template_tools(req)
        tokenization = self.front.manager.tokenization
        input_ids = await _tokenized(tokenization.chat_ids_async(messages, tools, kwargs))
        head = out.new_head(self.model_name, chat=True)
        generate, sent = _checked(protocol.chat_generate, req, input_ids, self._limits(), head.id)
        reasoning = self._reasoning(req, input_ids, generate.sampling_params.grammar is not None)
        tool_parser = self._tool_calls(req)
        choices = _Choices(req.n, None, lambda: ChatOutput(reasoning(), tool_parser()))
        return await self._respond(request, req, head, [generate], sent, choices)

    def _limits(self) -> tuple[int, int]:
        """(context length, the KV pool's tokens): what an output's length must fit."""
        return self.context_length, self.front.manager.kv_tokens

    def _reasoning(
        self, req: ChatCompletionRequest, prompt_ids: list[int], constrained: bool
    ) -> Callable[[], ReasoningParser | None]:
        """What splits each choice's thinking off (--reasoning-parser), where the scheduler puts
        it: a grammar (response_format, regex, a forced call) shapes the answer after it, so
        that the split is the same with one as without; where the tags are not one token each,
        no grammar waits for a thinking, and a constrained output is all answer."""
        parser = self.reasoning_parser
        if parser is None or not req.separate_reasoning:
            return lambda: None
        tags = self.front.manager.tokenization.think_tags
        if constrained and tags is None:
            return lambda: None
        thinks_first = starts_thinking(parser, prompt_ids, tags)
        return lambda: ReasoningParser(parser, thinks_first)

    def _tool_calls(self, req: ChatCompletionRequest) -> Callable[[], ToolCallParser | None]:
        """What reads each choice's tool calls: the forced call's JSON when tool_choice forces
        one (constrained decoding wrote it), else --tool-call-parser when tools may be called."""
        choice = req.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            function = None if isinstance(choice, str) else choice.function.name
            return lambda: ForcedCalls(function)
        parser = self.tool_call_parser
        if parser is None or not req.parses_tools:
            return lambda: None
        return lambda: tool_call_parser(parser)

    async def _decode(self, request: Request, kind: type[RequestT]) -> RequestT:
        req = await self._decoded(request, kind)
        _checked(protocol.check_stream_options, req)
        _checked(protocol.check_token_ids, req, self.front.manager.tokenization.vocab_size)
        return req

    async def _decoded(self, request: Request, kind: type[RequestT]) -> RequestT:
        self.front.authorize(request)
        body = await self.front.body(request)
        try:
            req = protocol.decode_request(body, kind)
        except msgspec.ValidationError as e:
            raise HttpError("invalid_request", str(e), protocol.field_of(e)) from None
        # ValueError: a string that is not UTF-8 (UnicodeDecodeError), which msgspec lets through.
        except (msgspec.DecodeError, ValueError, RecursionError) as e:
            message = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise HttpError("invalid_request", message) from None
        # No model named: the one served, as vLLM takes it.
        if req.model is not None and req.model != self.model_name:
            raise HttpError("not_found", f"the model {req.model!r} does not exist", "model")
        return req

    async def _respond(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        head: out.Head,
        generates: list[GenerateRequest],
        sent: set[str],
        choices: _Choices,
    ) -> Response:
        defaults = self.front.manager.sampling_defaults
        generates = [fill_sampling_defaults(g, sent, defaults) for g in generates]
        outputs = _naming(self.front.outputs(request, generates), protocol.constraint_field(req))
        chat = head.chat
        if req.stream:
            first = await anext(outputs, None)  # an error before any output is an HTTP status
            events = self._events(head, choices, req.include_usage, first, outputs)
            return StreamingResponse(events, media_type="text/event-stream")
        usage, bodies = out.Usage(), []
        async for reply in outputs:
            usage.add_final(reply)
            logprobs = await self._logprobs(reply, chat, len(choices.echo(reply)))
            bodies.append(choices.whole(reply, logprobs))
        bodies.sort(key=lambda c: c["index"])
        return json_response(out.completion_body(head, bodies, usage))

    async def _events(
        self,
        head: out.Head,
        choices: _Choices,
        include_usage: bool,
        first: OutputReply | None,
        rest: AsyncIterator[OutputReply],
    ) -> AsyncIterator[bytes]:
        usage, started = out.Usage(), set()
        text_offsets: dict[int, int] = {}  # each completion choice's text so far, as vLLM counts
        try:
            replies = rest if first is None else _chain(first, rest)
            async for reply in replies:
                index = out.choice_index(reply, choices.n)
                start = text_offsets.get(index, len(choices.echo(reply)))
                logprobs = await self._logprobs(reply, head.chat, start)
                if logprobs is not None and not head.chat:
                    prompt = len(reply.meta_info.input_token_logprobs or [])
                    text_offsets[index] = start + sum(map(len, logprobs["tokens"][prompt:]))
                piece = choices.piece(reply, index not in started, logprobs)
                started.add(index)
                if _says_nothing(piece):
                    continue  # a parser holds the text back (a tool call being written)
                yield sse(out.chunk_body(head, [piece]))
                if reply.finished:
                    usage.add_final(reply)
        except HttpError as e:
            yield sse(error_body(e))
        else:
            if include_usage:
                yield sse(out.chunk_body(head, [], usage))
        yield SSE_DONE

    async def _logprobs(
        self, reply: OutputReply, chat: bool, output_offset: int
    ) -> dict[str, Any] | None:
        """The reply's logprobs in the API's shape; `output_offset`: where its output's text
        begins in its choice's (completions' text_offset)."""
        ids = out.logprob_token_ids(reply)
        if reply.meta_info.output_token_logprobs is None:
            return None
        unique = list(dict.fromkeys(ids))
        texts = dict(zip(unique, await self.front.manager.tokenization.token_texts_async(unique)))
        if chat:
            return out.chat_logprobs(reply, texts)
        return out.completion_logprobs(reply, texts, output_offset)


def _says_nothing(piece: dict[str, Any]) -> bool:
    """A chat chunk's choice with no delta, no logprobs and no finish: vLLM sends none."""
    return piece.get("delta") == {} and piece["finish_reason"] is None and not piece["logprobs"]


def _checked(convert: Callable[..., Any], *args: Any) -> Any:
    """`convert(*args)`, a BadField (or ValueError) as a 400 naming the field."""
    try:
        return convert(*args)
    except BadField as e:
        raise HttpError(e.code, str(e), e.param) from None
    except ValueError as e:
        raise HttpError("invalid_request", str(e)) from None


async def _tokenized(ids: Awaitable[Any]) -> Any:
    """The tokenizer's answer; its refusals as the wire's errors."""
    try:
        return await ids
    except PromptTooLong as e:
        raise HttpError("too_long", str(e)) from None
    except ValueError as e:
        raise HttpError("invalid_request", str(e)) from None


async def _naming(
    outputs: AsyncIterator[OutputReply], constraint: str | None
) -> AsyncIterator[OutputReply]:
    """`outputs`, an error from the scheduler naming as its `param` the field the request's
    grammar came from (the compile's errors are the scheduler's, and name the wire's field)."""
    try:
        async for reply in outputs:
            yield reply
    except HttpError as e:
        grammar = e.code == "invalid_request" and e.message.startswith(GRAMMAR_FIELDS)
        if e.param is None and constraint is not None and grammar:
            e.param = constraint
        raise


async def _as_text(text: str) -> str:
    return text


async def _chain(
    first: OutputReply, rest: AsyncIterator[OutputReply]
) -> AsyncIterator[OutputReply]:
    yield first
    async for reply in rest:
        yield reply
