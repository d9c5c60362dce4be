"""What the sync and async clients share: building requests and decoding replies (WIRE.md)."""

from __future__ import annotations

import os
import uuid
from typing import Any, NamedTuple

import msgspec
import zmq

from radixserve.protocol.transport import allow_ipv6
from radixserve.protocol.wire import (
    API_KEY_ENV,
    ClientRequest,
    ErrorReply,
    GenerateRequest,
    OutputReply,
    ServerReply,
)

DEFAULT_ADDRESS = "tcp://127.0.0.1:30000"
# Even an output with top logprobs for thousands of tokens is a few MiB; more is a broken peer.
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
# Each wait for a reply (OpenAI's client waits as long): a long non-streamed generation on a CPU
# takes minutes, a dead server must not hang a script forever.
DEFAULT_TIMEOUT = 600.0
# How long a send waits for a connection to the server before saying there is none.
DEFAULT_CONNECT_TIMEOUT = 5.0


class ServerError(Exception):
    """A refused request: the server's `error` reply, or the client's own check before sending,
    which gives the code and message the server would."""

    def __init__(self, code: str, message: str, rid: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (rid {rid})" if rid else ""))
        self.code = code
        self.message = message
        self.rid = rid


class ProtocolError(Exception):
    """A reply that is not a radixserve reply, or larger than the client accepts."""


def connect_dealer(ctx: zmq.Context, address: str, connect_timeout: float | None) -> zmq.Socket:
    """A DEALER that queues nothing while no server is connected (IMMEDIATE), so that a send
    fails after `connect_timeout` (zmq.Again) instead of waiting forever for a dead address.
    ZMQ itself knows whether a server completed the handshake: unlike a health probe, this
    cannot mistake a busy server for a missing one."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, -1 if connect_timeout is None else int(connect_timeout * 1000))
    allow_ipv6(sock, address)
    sock.connect(address)
    return sock


def no_server(address: str, connect_timeout: float | None) -> ConnectionError:
    return ConnectionError(
        f"no server at {address}: nothing accepted a connection within {connect_timeout} s "
        "(is radixserve running there?)"
    )


class PreparedGenerate(NamedTuple):
    request: GenerateRequest  # as the server will decode it: its rid and n
    payload: bytes  # the one frame to send


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)


def prepare_generate(
    text: str | None,
    input_ids: list[int] | None,
    messages: list[dict[str, str]] | None,
    sampling_params: dict[str, Any] | None,
    rid: str | None,
    stream: bool,
    return_logprob: bool,
    top_logprobs_num: int,
    api_key: str | None = None,
) -> PreparedGenerate:
    """The request's frame, checked by decoding it as the server will: what the server would
    refuse raises ServerError here, before sending, with the server's own message.

    Only the fields the caller gave go on the wire, sampling parameters included: the server
    fills the others from the model's defaults, and a decoded struct would drop a given value
    equal to SGLang's default."""
    rid = rid if rid is not None else uuid.uuid4().hex
    given = {
        "text": text,
        "input_ids": input_ids,
        "messages": messages,
        "sampling_params": sampling_params or None,
        "stream": stream or None,
        "return_logprob": return_logprob or None,
        "top_logprobs_num": top_logprobs_num or None,
        "api_key": api_key,
    }
    wire: dict[str, Any] = {"type": "generate", "rid": rid}
    wire.update((name, value) for name, value in given.items() if value is not None)
    try:
        payload = _request_encoder.encode(wire)
        return PreparedGenerate(_request_decoder.decode(payload), payload)
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError, OverflowError) as e:
        raise ServerError("invalid_request", str(e), rid) from None


def require_one_completion(request: GenerateRequest) -> None:
    # The server would serve it, but generate() returns one reply: refused before sending.
    if request.sampling_params.n != 1:
        message = "generate() returns one completion: use stream() for n > 1"
        raise ServerError("invalid_request", message, request.rid)


def server_error(reply: ErrorReply) -> ServerError:
    return ServerError(reply.code, reply.message, reply.rid)


def check_output(reply: ServerReply) -> OutputReply:
    if isinstance(reply, ErrorReply):
        raise server_error(reply)
    if not isinstance(reply, OutputReply):
        raise ProtocolError(f"expected an output reply, got {type(reply).__name__}")
    return reply


def reply_rid(reply: ServerReply) -> str | None:
    return reply.rid if isinstance(reply, (OutputReply, ErrorReply)) else None


class WireCodec:
    """One msgpack map per frame, as WIRE.md says; replies are decoded straight into structs."""

    def __init__(self, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, api_key: str | None = None):
        """api_key: sent with every request (default: $RADIXSERVE_API_KEY, else none)."""
        self.max_reply_bytes = max_reply_bytes
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerReply)

    def encode(self, request: ClientRequest) -> bytes:
        if self.api_key is not None and request.api_key is None:
            request = msgspec.structs.replace(request, api_key=self.api_key)
        return self._encoder.encode(request)

    def decode(self, frame: bytes) -> ServerReply:
        if len(frame) > self.max_reply_bytes:
            raise ProtocolError(f"a {len(frame)}-byte reply exceeds {self.max_reply_bytes} bytes")
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable reply: {e}") from None
