"""The blocking client: one DEALER socket, used from one thread."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Generator
from typing import Any, TypeVar

import zmq

from radixserve.client.messages import (
    DEFAULT_ADDRESS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_TIMEOUT,
    PreparedGenerate,
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

R = TypeVar("R", HealthReply, ModelInfoReply, ServerInfoReply, FlushCacheReply)


class Client:
    """A radixserve client for scripts. Not thread-safe: use AsyncClient for concurrency.

    Several stream() iterators may be open at once: a reply for one is kept until that iterator
    asks for it. `timeout` bounds each wait for a reply, in seconds (None: wait forever); a
    generation that times out is aborted on the server. A call made while no server is
    connected raises ConnectionError ("no server at ...") after `connect_timeout` seconds. A
    refused request raises ServerError, whether the server or the client refused it.
    `api_key`: the server's --api-key, sent with every request (default: $RADIXSERVE_API_KEY).
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
        self._ctx = zmq.Context()
        self._sock = connect_dealer(self._ctx, address, connect_timeout)
        self._in_flight: dict[str, deque[ServerReply]] = {}  # rid -> replies not yet taken

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def generate(
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
        outputs = self._start(prepared)
        try:
            return next(outputs)
        finally:
            outputs.close()

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
    ) -> Generator[OutputReply, None, None]:
        """Chunks of new text as they come; closing the iterator early aborts the request."""
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
        return self._start(prepared)

    def abort(self, rid: str) -> None:
        """Asks the server to stop `rid`; its stream then ends with finish_reason "abort"."""
        self._send(self._codec.encode(AbortRequest(rid=rid)))

    def health(self) -> HealthReply:
        return self._control(HealthRequest(), HealthReply)

    def model_info(self) -> ModelInfoReply:
        return self._control(ModelInfoRequest(), ModelInfoReply)

    def server_info(self) -> ServerInfoReply:
        return self._control(ServerInfoRequest(), ServerInfoReply)

    def flush_cache(self) -> FlushCacheReply:
        return self._control(FlushCacheRequest(), FlushCacheReply)

    def _start(self, prepared: PreparedGenerate) -> Generator[OutputReply, None, None]:
        request = prepared.request
        assert request.rid is not None
        if request.rid in self._in_flight:
            raise ValueError(f"rid {request.rid!r} is already in flight")
        self._send(prepared.payload)
        self._in_flight[request.rid] = deque()
        outputs = self._outputs(request.rid, request.sampling_params.n)
        # Into its `try` now: a stream dropped before its first chunk still aborts its request
        # (a generator never started runs no `finally`; it ran on to max_new_tokens).
        next(outputs)
        return outputs

    def _outputs(self, rid: str, completions: int) -> Generator[OutputReply, None, None]:
        left = completions  # each of the n completions ends with its own finished reply
        try:
            yield None  # type: ignore[misc]  # _start's step into the try
            while left:
                reply = self._next_for(rid)
                if isinstance(reply, ErrorReply):
                    left = 0  # an error is the request's last word
                output = check_output(reply)
                left -= output.finished
                yield output
        finally:
            del self._in_flight[rid]
            if left and not self._sock.closed:
                # Best effort, never waiting: with no server there is nothing to abort.
                self._send(self._codec.encode(AbortRequest(rid=rid)), wait=False)

    def _next_for(self, rid: str) -> ServerReply:
        queue = self._in_flight[rid]
        deadline = self._deadline()
        while not queue:
            reply = self._receive(deadline)
            # An error the server could not tie to a request answers the one we wait for.
            if isinstance(reply, ErrorReply):
                return reply
        return queue.popleft()

    def _control(self, request: ClientRequest, reply_type: type[R]) -> R:
        self._send(self._codec.encode(request))
        deadline = self._deadline()
        while True:
            reply = self._receive(deadline)
            # A reply of another type answers an earlier call that gave up waiting.
            if isinstance(reply, ErrorReply):
                raise server_error(reply)
            if isinstance(reply, reply_type):
                return reply

    def _receive(self, deadline: float | None) -> ServerReply | None:
        """The next reply that has no rid; replies of requests in flight are queued."""
        left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._sock.poll(None if left_s is None else math.ceil(left_s * 1000)):
            raise TimeoutError(f"no reply from {self.address} within {self.timeout} s")
        reply = self._codec.decode(self._sock.recv())
        rid = reply_rid(reply)
        if rid is None:
            return reply
        if rid in self._in_flight:
            self._in_flight[rid].append(reply)
        return None  # or the request was aborted or timed out: nobody waits for it

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _send(self, frame: bytes, *, wait: bool = True) -> None:
        try:
            self._sock.send(frame, 0 if wait else zmq.NOBLOCK)
        except zmq.Again:
            if wait:
                raise no_server(self.address, self.connect_timeout) from None
