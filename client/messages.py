"""What the sync and async clients share: building requests and decoding replies (WIRE.md)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from radixserve.protocol.wire import (
    ChatMessage,
    ClientRequest,
    ErrorReply,
    GenerateRequest,
    OutputReply,
    SamplingParams,
    ServerReply,
)

DEFAULT_ADDRESS = "tcp://127.0.0.1:30000"
# Even an output with top logprobs for thousands of tokens is a few MiB; more is a broken peer.
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024


class ServerError(Exception):
    """The server answered with an `error` reply."""

    def __init__(self, code: str, message: str, rid: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (rid {rid})" if rid else ""))
        self.code = code
        self.message = message
        self.rid = rid


class ProtocolError(Exception):
    """A reply that is not a radixserve reply, or larger than the client accepts."""


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def generate_request(
    text: str | None,
    input_ids: list[int] | None,
    messages: list[dict[str, str]] | None,
    sampling_params: dict[str, Any] | None,
    rid: str | None,
    stream: bool,
    return_logprob: bool,
    top_logprobs_num: int,
) -> GenerateRequest:
    """A validated request: what the server would reject raises ValueError here, before sending."""
    return GenerateRequest(
        rid=rid if rid is not None else uuid.uuid4().hex,
        text=text,
        input_ids=input_ids,
        messages=None if messages is None else msgspec.convert(messages, list[ChatMessage]),
        sampling_params=msgspec.convert(sampling_params or {}, SamplingParams),
        stream=stream,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


def require_one_completion(request: GenerateRequest) -> None:
    if request.sampling_params.n != 1:
        raise ValueError("generate() returns one completion: use stream() for n > 1")


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

    def __init__(self, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        self.max_reply_bytes = max_reply_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ServerReply)

    def encode(self, request: ClientRequest) -> bytes:
        return self._encoder.encode(request)

    def decode(self, frame: bytes) -> ServerReply:
        if len(frame) > self.max_reply_bytes:
            raise ProtocolError(f"a {len(frame)}-byte reply exceeds {self.max_reply_bytes} bytes")
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable reply: {e}") from None
