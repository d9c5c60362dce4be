"""What every HTTP endpoint shares: the request body under its size limit, the API key, errors
in OpenAI's JSON shape, and the one request path into the tokenizer manager.

An HTTP request is a local client of the manager (tokenizer_manager/local_client.py): its
`generate`s are validated, tokenized, tracked and aborted exactly as a ZMQ client's are. When the
HTTP client disconnects, the manager is told at once, and aborts what it had in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from radixserve.protocol.wire import ErrorReply, GenerateRequest, OutputReply
from radixserve.tokenizer_manager.intake import Ticket
from radixserve.tokenizer_manager.local_client import LocalClient
from radixserve.tokenizer_manager.manager import TokenizerManager
from radixserve.tokenizer_manager.request_decoder import ClientError

# The wire's error codes as HTTP statuses (OpenAI's: 400 bad request, 401 bad key, 404 not found,
# 503 overloaded or not ready yet).
STATUS = {
    "invalid_request": 400,
    "too_long": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "too_large": 413,
    "unsupported_media_type": 415,
    "overloaded": 503,
    "not_ready": 503,
    "internal": 500,
}
RETRY_AFTER_S = 1  # told to a client refused with 503, as vLLM tells it
# OpenAI's error `type` for each status.
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}

_json = msgspec.json.Encoder()


class HttpError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, *, relayed: bool = False):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.relayed = relayed  # the tokenizer manager's error reply: logged there already

    @classmethod
    def of(cls, reply: ErrorReply) -> HttpError:
        return cls(reply.code, reply.message, relayed=True)


# The wire's codes that OpenAI names otherwise (clients trim a conversation on this one).
_OPENAI_CODE = {"too_long": "context_length_exceeded"}


def error_body(error: HttpError) -> dict[str, Any]:
    status = STATUS[error.code]
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = _OPENAI_CODE.get(error.code, error.code)
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def error_response(error: HttpError) -> Response:
    response = json_response(error_body(error), STATUS[error.code])
    if response.status_code == 503:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    if error.code == "request_timeout":  # the connection is mid-body: not fit for another request
        response.headers["Connection"] = "close"
    return response


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def sse(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Front:
    def __init__(self, manager: TokenizerManager):
        self.manager = manager
        self.max_body_bytes = manager.args.max_request_bytes

    def authorize(self, request: Request) -> None:
        """`Authorization: Bearer KEY` when the server runs with --api-key."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        try:
            self.manager.decoder.authorize(key if scheme.lower() == "bearer" else None, None)
        except ClientError as e:
            raise HttpError(e.code, "missing or wrong API key (Authorization: Bearer)") from None

    def check_ready(self) -> None:
        try:
            self.manager.check_ready()
        except ClientError as e:
            raise HttpError(e.code, e.message) from None

    async def body(self, request: Request) -> bytes:
        """The body, refused past --max-request-bytes before it is held whole, and unless it says
        it is JSON: a web page can POST a form or text/plain to 127.0.0.1 without the browser
        asking first, never application/json.

        Its bytes count against the intake's caps as they arrive (a declared length alone, from
        a client that then sends nothing, must not hold room that others are refused for), and
        go on counting until the request's generates are submitted (`outputs`) or it is
        refused (`release_body`): the OpenAI API tokenizes before it submits, and a flood of
        large bodies in the tokenizer must be bounded as the ZMQ path's prompts are."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise HttpError(
                "unsupported_media_type", "the body must be JSON (Content-Type: application/json)"
            )
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            raise HttpError("too_large", f"request body over {self.max_body_bytes} bytes")
        try:
            ticket = self.manager.intake.take(_client_address(request), 0)
        except ClientError as e:
            raise HttpError(e.code, e.message) from None
        request.state.intake_ticket = ticket
        timeout = self.manager.args.http_body_timeout
        try:
            body = await asyncio.wait_for(self._read_body(request, ticket), timeout)
        except asyncio.TimeoutError:
            message = f"the body did not arrive within {timeout:g} s (--http-body-timeout)"
            raise HttpError("request_timeout", message) from None
        except ClientDisconnect:  # nobody reads the answer: not worth a traceback in the log
            raise HttpError("invalid_request", "the client left before its body ended") from None
        # Its clock starts here, whole, as vLLM's and SGLang's do: the OpenAI API's tokenizing,
        # before its generates are submitted, counts in its TTFT and latency.
        request.state.arrived = time.monotonic()
        return body

    async def _read_body(self, request: Request, ticket: Ticket) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise HttpError("too_large", f"request body over {self.max_body_bytes} bytes")
            try:
                ticket.grow(len(chunk))
            except ClientError as e:
                raise HttpError(e.code, e.message) from None
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def release_body(request: Request) -> None:
        """The body's place in the intake, given back (once the request is submitted or
        refused; again is a no-op)."""
        ticket: Ticket | None = getattr(request.state, "intake_ticket", None)
        if ticket is not None:
            ticket.release()

    async def query(self, query_type: type) -> msgspec.Struct:
        """A control query (health, model_info, server_info, flush_cache) and its answer;
        HttpError (503) before the model is ready, or when the scheduler does not answer in
        time."""
        self.check_ready()
        client = self.manager.open_local_client()
        try:
            await self.manager.forward_query([client.peer], query_type)
            reply = await client.get()
            assert reply is not None
            if isinstance(reply, ErrorReply):
                raise HttpError.of(reply)
            return reply
        finally:
            await self.manager.close_local_client(client)

    async def outputs(
        self, request: Request, generates: list[GenerateRequest]
    ) -> AsyncIterator[OutputReply]:
        """The replies to `generates` (one HTTP request's), until each completion's final. Ends
        early when the HTTP client disconnects (its requests aborted); HttpError for an error."""
        client = self.manager.open_local_client(_client_address(request))
        watch = asyncio.create_task(self._abort_on_disconnect(request, client))
        # The generates take their own places as they are admitted (nothing awaits in between).
        self.release_body(request)
        try:
            arrived = getattr(request.state, "arrived", None)  # none for /health_generate's
            for generate in generates:
                await self.manager.submit([client.peer], generate, arrived)
            unfinished = sum(g.sampling_params.n for g in generates)
            while unfinished:
                reply = await client.get()
                if reply is None:  # the HTTP client is gone
                    return
                if isinstance(reply, ErrorReply):
                    raise HttpError.of(reply)
                assert isinstance(reply, OutputReply)
                unfinished -= reply.finished
                yield reply
        finally:
            watch.cancel()
            await self.manager.close_local_client(client)

    async def _abort_on_disconnect(self, request: Request, client: LocalClient) -> None:
        # The body is read: what the server sends next is http.disconnect, when the client
        # closes the connection (or after the response ends).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        await self.manager.close_local_client(client)


def _client_address(request: Request) -> str:
    """The HTTP client, as the intake's per-client caps count it: its address."""
    return request.client.host if request.client is not None else ""
