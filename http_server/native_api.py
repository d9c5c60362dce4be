"""SGLang's native endpoints: /generate (the wire's `generate` as JSON), /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache, and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.http_server.front import (
    SSE_DONE,
    Front,
    HttpError,
    error_body,
    json_response,
    sse,
)
from radixserve.http_server.lenient_json import decode_mended, without_nulls
from radixserve.protocol.internal import FlushCacheReq, HealthReq, ModelInfoReq, ServerInfoReq
from radixserve.protocol.wire import (
    FlushCacheReply,
    GenerateRequest,
    OutputReply,
    SamplingParams,
    ServerInfoReply,
)
from radixserve.tokenizer_manager.admission import SHUTTING_DOWN
from radixserve.tokenizer_manager.sampling_defaults import (
    fill_sampling_defaults,
    sent_sampling_fields_json,
)


def as_wire(raw: dict[str, Any]) -> dict[str, Any]:
    """A generate request as SGLang's clients write it, in the wire's terms: a null for one of
    our fields is its default (SGLang's fields are Optional), in the request and in its
    sampling_params, and one stop string is a list of it."""
    wire = without_nulls(raw, GenerateRequest)
    params = wire.get("sampling_params")
    if isinstance(params, dict):
        params = without_nulls(params, SamplingParams)
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        wire["sampling_params"] = params
    return wire


# What as_wire mends: a null, or one stop string where the wire has a list.
_SGLANG_SPELLINGS = ("got `null`", "got `str` - at `$.sampling_params.stop`")


class NativeApi:
    def __init__(self, front: Front):
        self.front = front
        self._generate_decoder = msgspec.json.Decoder(GenerateRequest)

    async def generate(self, request: Request) -> Response:
        self.front.authorize(request)
        body = await self.front.body(request)
        try:
            req = decode_mended(self._generate_decoder, body, as_wire, _SGLANG_SPELLINGS)
        # ValueError: a string that is not UTF-8 (UnicodeDecodeError), which msgspec lets through.
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError) as e:
            message = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise HttpError("invalid_request", message) from None
        defaults = self.front.manager.sampling_defaults
        if defaults:
            req = fill_sampling_defaults(req, sent_sampling_fields_json(body), defaults)
        outputs = self.front.outputs(request, [req])
        if req.stream:
            first = await anext(outputs, None)  # an error before any output is an HTTP status
            return StreamingResponse(_events(first, outputs), media_type="text/event-stream")
        replies = sorted([r async for r in outputs], key=lambda r: r.index or 0)
        if len(replies) == 1:
            return json_response(replies[0])
        return json_response(replies)

    async def health(self, request: Request) -> Response:
        if not self.front.manager.admission.accepting:  # a load balancer sends no more traffic
            raise HttpError("overloaded", SHUTTING_DOWN)
        await self.front.query(HealthReq)
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """SGLang's deeper health check: one token generated through the whole request path
        (tokenizer manager, scheduler, model, detokenizer); 503 when it takes past
        HEALTH_GENERATE_TIMEOUT_S."""
        probe = GenerateRequest(input_ids=[0], sampling_params=_ONE_TOKEN, log_metrics=False)

        async def one_token() -> None:
            async for _ in self.front.outputs(request, [probe]):
                pass

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            message = f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s"
            raise HttpError("overloaded", message) from None
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        self.front.authorize(request)
        return json_response(await self.front.query(ModelInfoReq))

    async def server_info(self, request: Request) -> Response:
        self.front.authorize(request)
        return json_response(await self.front.query(ServerInfoReq))

    async def flush_cache(self, request: Request) -> Response:
        self.front.authorize(request)
        reply = await self.front.query(FlushCacheReq)
        assert isinstance(reply, FlushCacheReply)
        body = {"success": reply.success, "message": reply.message}  # HTTP.md's, as it says
        return json_response(body, 200 if reply.success else 400)

    async def metrics(self, request: Request) -> Response:
        self.front.authorize(request)
        info: msgspec.Struct | None
        try:
            info = await self.front.query(ServerInfoReq)
        except HttpError as e:
            if e.code != "overloaded":  # not_ready: 503 while the model loads
                raise
            info = None  # a long step: the counters without the load gauges, not a 503
        assert info is None or isinstance(info, ServerInfoReply)
        body = self.front.manager.metrics.expose(info)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
_ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)  # not counted


async def _events(
    first: OutputReply | None, rest: AsyncIterator[OutputReply]
) -> AsyncIterator[bytes]:
    """Each output as one server-sent event, then [DONE]; an error mid-way is an event too."""
    try:
        if first is not None:
            yield sse(first)
        async for reply in rest:
            yield sse(reply)
    except HttpError as e:
        yield sse(error_body(e))
    yield SSE_DONE
