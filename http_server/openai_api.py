"""OpenAI's endpoints: /v1/models, /v1/completions, /v1/chat/completions (streamed as
server-sent events ending in `data: [DONE]`, with usage when `stream_options.include_usage`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.http_server import openai_responses as out
from radixserve.http_server.front import (
    SSE_DONE,
    Front,
    HttpError,
    error_body,
    json_response,
    sse,
)
from radixserve.http_server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_generate,
    completion_generates,
)
from radixserve.protocol.wire import GenerateRequest, OutputReply
from radixserve.tokenizer_manager.sampling_defaults import fill_sampling_defaults


class OpenAIApi:
    def __init__(self, front: Front, model_name: str, context_length: int):
        self.front = front
        self.model_name = model_name
        self.context_length = context_length
        self.created = int(time.time())
        self._completion = msgspec.json.Decoder(CompletionRequest)
        self._chat = msgspec.json.Decoder(ChatCompletionRequest)

    async def models(self, request: Request) -> Response:
        """vLLM's model card; 503 until the model is loaded (vLLM is not listening by then)."""
        self.front.authorize(request)
        self.front.check_ready()
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixserve",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.context_length,
        }
        return json_response({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        req = await self._decode(request, self._completion)
        assert isinstance(req, CompletionRequest)
        generates, sent = _converted(completion_generates, req)
        return await self._respond(request, req, generates, sent, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._decode(request, self._chat)
        assert isinstance(req, ChatCompletionRequest)
        generate, sent = _converted(chat_generate, req)
        return await self._respond(request, req, [generate], sent, chat=True)

    async def _decode(self, request: Request, decoder: msgspec.json.Decoder) -> Any:
        self.front.authorize(request)
        body = await self.front.body(request)
        try:
            req = decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
            message = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise HttpError("invalid_request", message) from None
        if req.model != self.model_name:
            raise HttpError("not_found", f"the model {req.model!r} does not exist", "model")
        return req

    async def _respond(
        self,
        request: Request,
        req: CompletionRequest | ChatCompletionRequest,
        generates: list[GenerateRequest],
        sent: set[str],
        chat: bool,
    ) -> Response:
        defaults = self.front.manager.sampling_defaults
        generates = [fill_sampling_defaults(g, sent, defaults) for g in generates]
        outputs = self.front.outputs(request, generates)
        rid = out.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            first = await anext(outputs, None)  # an error before any output is an HTTP status
            events = self._events(rid, req.n, chat, req.include_usage, first, outputs)
            return StreamingResponse(events, media_type="text/event-stream")
        usage, choices = out.Usage(), []
        async for reply in outputs:
            usage.add_final(reply)
            logprobs = await self._logprobs(reply, chat)
            choices.append(out.choice(reply, req.n, reply.text, chat, logprobs))
        choices.sort(key=lambda c: c["index"])
        return json_response(out.completion_body(rid, self.model_name, choices, usage, chat))

    async def _events(
        self,
        rid: str,
        n: int,
        chat: bool,
        include_usage: bool,
        first: OutputReply | None,
        rest: AsyncIterator[OutputReply],
    ) -> AsyncIterator[bytes]:
        usage, started = out.Usage(), set()
        try:
            replies = rest if first is None else _chain(first, rest)
            async for reply in replies:
                index = out.choice_index(reply, n)
                logprobs = await self._logprobs(reply, chat)
                piece = out.chunk_choice(reply, n, chat, index not in started, logprobs)
                started.add(index)
                yield sse(out.chunk_body(rid, self.model_name, [piece], chat))
                if reply.finished:
                    usage.add_final(reply)
        except HttpError as e:
            yield sse(error_body(e))
        else:
            if include_usage:
                yield sse(out.chunk_body(rid, self.model_name, [], chat, usage))
        yield SSE_DONE

    async def _logprobs(self, reply: OutputReply, chat: bool) -> dict[str, Any] | None:
        ids = out.logprob_token_ids(reply)
        if reply.meta_info.output_token_logprobs is None:
            return None
        unique = list(dict.fromkeys(ids))
        texts = dict(zip(unique, await self.front.manager.tokenization.token_texts_async(unique)))
        return out.chat_logprobs(reply, texts) if chat else out.completion_logprobs(reply, texts)


def _converted(convert: Any, req: Any) -> Any:
    try:
        return convert(req)
    except ValueError as e:
        raise HttpError("invalid_request", str(e)) from None


async def _chain(
    first: OutputReply, rest: AsyncIterator[OutputReply]
) -> AsyncIterator[OutputReply]:
    yield first
    async for reply in rest:
        yield reply
