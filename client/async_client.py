"""The asyncio client: many concurrent calls over one DEALER socket, routed by one reader task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from radixserve.client.messages import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_TIMEOUT,
    PreparedGenerate,
    ProtocolError,
    WireCodec,
    check_output,
    connect_dealer,
    no_server,
    prepare_generate,
    reply_rid,
    require_one_completion,
    server_error,
)
from radixserve.protocol.wire import (
    AbortRequest,
    ClientRequest,
    ErrorReply,
    FlushCacheReply,
    FlushCacheRequest,
    HealthReply,
    HealthRequest,
    ModelInfoReply,
    ModelInfoRequest,
    OutputReply,
    ServerInfoReply,
    ServerInfoRequest,
    ServerReply,
)

logger = logging.getLogger(__name__)

R = TypeVar("R", HealthReply, ModelInfoReply, ServerInfoReply, FlushCacheReply)
T = TypeVar("T")


class AsyncClient:
    """A radixserve client for asyncio: any number of generate/stream/control calls at once.

    One reader task takes every reply off the socket: a generation's replies go to its rid's
    queue; a control reply (no rid) to the oldest waiting call of its type, and an error without
    a rid to the oldest control call, else the oldest generation not yet answered.

    `timeout` bounds each wait for a reply, in seconds (None: wait forever); a generation that
    times out, or whose stream is closed early, is aborted on the server. A call made while no
    server is connected raises ConnectionError ("no server at ...") after `connect_timeout`
    seconds. A refused request raises ServerError, whether the server or the client refused it.
    `api_key`: the server's --api-key, sent with every request (default: $RADIXSERVE_API_KEY).
    Use one event loop.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        api_key: str | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._codec = WireCodec(max_reply_bytes, api_key)
        self._ctx = zmq.asyncio.Context()
        self._sock = connect_dealer(self._ctx, address, connect_timeout)
        self._calls: dict[str, asyncio.Queue[ServerReply | BaseException]] = {}
        self._unanswered: dict[str, None] = {}  # rids still waiting for a first reply, oldest first
        self._controls: deque[tuple[type, asyncio.Future[ServerReply]]] = deque()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._sock.close(linger=0)
        self._ctx.term()

    async def generate(
        self,
        text: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> OutputReply:
        prepared = prepare_generate(
            text,
            input_ids,
            messages,
            sampling_params,
            rid,
            False,
            return_logprob,
            top_logprobs_num,
            self._codec.api_key,
        )
        require_one_completion(prepared.request)
        outputs = self._outputs(prepared)
        try:
            return await anext(outputs)
        finally:
            await outputs.aclose()

    def stream(
        self,
        text: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> AsyncGenerator[OutputReply, None]:
        """Chunks of new text as they come (`async for`); the request is sent on the first one.

        Leaving the loop early aborts the request once the iterator is closed: wrap it in
        `contextlib.aclosing` to close it at once.
        """
        prepared = prepare_generate(
            text,
            input_ids,
            messages,
            sampling_params,
            rid,
            True,
            return_logprob,
            top_logprobs_num,
            self._codec.api_key,
        )
        return self._outputs(prepared)

    async def abort(self, rid: str) -> None:
        """Asks the server to stop `rid`; its stream then ends with finish_reason "abort"."""
        await self._send(self._codec.encode(AbortRequest(rid=rid)))

    async def health(self) -> HealthReply:
        return await self._control(HealthRequest(), HealthReply)

    async def model_info(self) -> ModelInfoReply:
        return await self._control(ModelInfoRequest(), ModelInfoReply)

    async def server_info(self) -> ServerInfoReply:
        return await self._control(ServerInfoRequest(), ServerInfoReply)

    async def flush_cache(self) -> FlushCacheReply:
        return await self._control(FlushCacheRequest(), FlushCacheReply)

    async def _outputs(self, prepared: PreparedGenerate) -> AsyncGenerator[OutputReply, None]:
        request = prepared.request
        rid = request.rid
        assert rid is not None
        if rid in self._calls:
            raise ValueError(f"rid {rid!r} is already in flight")
        self._start_reader()
        queue: asyncio.Queue[ServerReply | BaseException] = asyncio.Queue()
        self._calls[rid] = queue
        self._unanswered[rid] = None
        left = request.sampling_params.n  # each of the n completions ends with its own finished
        try:
            await self._send(prepared.payload)
            while left:
                reply = await self._wait(queue.get())
                if isinstance(reply, BaseException):
                    raise reply
                if isinstance(reply, ErrorReply):
                    left = 0  # an error is the request's last word
                output = check_output(reply)
                left -= output.finished
                yield output
        finally:
            del self._calls[rid]
            self._unanswered.pop(rid, None)
            if left and not self._sock.closed:
                # Best effort, never waiting: with no server there is nothing to abort.
                await self._send(self._codec.encode(AbortRequest(rid=rid)), wait=False)

    async def _control(self, request: ClientRequest, reply_type: type[R]) -> R:
        self._start_reader()
        waiter: asyncio.Future[ServerReply] = asyncio.get_running_loop().create_future()
        entry = (reply_type, waiter)
        self._controls.append(entry)
        try:
            await self._send(self._codec.encode(request))
            reply = await self._wait(waiter)
        finally:
            if entry in self._controls:
                self._controls.remove(entry)
        if isinstance(reply, ErrorReply):
            raise server_error(reply)
        assert isinstance(reply, reply_type)
        return reply

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await self._sock.recv()
                try:
                    reply = self._codec.decode(frame)
                except ProtocolError as e:
                    # Whose reply it was is unknown, so that call can only time out.
                    logger.warning("dropping a reply: %s", e)
                    continue
                self._route(reply)
        except asyncio.CancelledError:
            self._fail_all(ConnectionError("the client was closed"))
            raise
        except Exception as e:
            self._fail_all(e)
            raise

    def _route(self, reply: ServerReply) -> None:
        rid = reply_rid(reply)
        if rid is None:
            for entry in self._controls:
                reply_type, waiter = entry
                if isinstance(reply, (reply_type, ErrorReply)) and not waiter.done():
                    self._controls.remove(entry)
                    waiter.set_result(reply)
                    return
            # The server could not tie this error to a request (it could not read it): it
            # answers the oldest generation that has heard nothing yet.
            if isinstance(reply, ErrorReply) and self._unanswered:
                rid = next(iter(self._unanswered))
        if rid in self._calls:
            self._unanswered.pop(rid, None)
            self._calls[rid].put_nowait(reply)
        # Otherwise its call gave up (timed out, aborted, closed): nobody waits for it.

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._calls.values():
            queue.put_nowait(error)
        for _, waiter in self._controls:
            if not waiter.done():
                waiter.set_exception(error)

    async def _wait(self, awaitable: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply from {self.address} within {self.timeout} s") from None

    async def _send(self, frame: bytes, *, wait: bool = True) -> None:
        try:
            await self._sock.send(frame, 0 if wait else zmq.NOBLOCK)
        except zmq.Again:
            if wait:
                raise no_server(self.address, self.connect_timeout) from None
