"""uvicorn's httptools protocol with a bound on a request's head (its request line and headers).

httptools has none, and builds a header's value with `bytes +=` as its pieces arrive: one header
of 160 MiB held the event loop, which the ZMQ endpoint shares, for seconds, and health checks
timed out meanwhile. A head past MAX_HEAD_BYTES (counted by whole reads: it may pass by up to
one read, 256 KiB) is answered 431 and the connection closed, as nginx and uvicorn's h11
protocol refuse one (h11 parses in Python: slower on every request).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
# How long what a refused client still sends is read and dropped before the socket closes: one
# closed with unread data is reset, and the client's unread 431 lost with it.
LINGER_S = 1.0

_BODY = msgspec.json.encode(
    {
        "error": {
            "message": f"the request's line and headers are over {MAX_HEAD_BYTES} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "too_large",
        }
    }
)
_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _BODY
)


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a connection begins with a request's head
        self._head_bytes = 0  # of the request's head so far
        self._message_ended = False  # within the read being parsed
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        in_head, self._message_ended = self._in_head, False
        super().data_received(data)
        # Counted by reads that are head from end to end: none that ends a head and begins a
        # body counts.
        if in_head and self._in_head and not self._message_ended:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse()

    def _refuse(self) -> None:
        self._refused = True
        self.transport.write(_REFUSAL)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        # The next request on this connection begins with its head.
        self._in_head, self._head_bytes, self._message_ended = True, 0, True
        super().on_message_complete()
