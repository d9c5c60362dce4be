"""A client inside the tokenizer manager's process (one HTTP request): it takes the same request
path as a ZMQ client (validation, in-flight tracking, abort when it leaves), but its replies are
structs on a queue rather than msgpack frames on the ROUTER.

Its peer id starts with a zero byte and is longer than libzmq's own (5 bytes): a ZMQ client may
not pick an id starting with zero, so none can pose as a local client or reach its requests.
"""

from __future__ import annotations

import asyncio

import msgspec

from radixserve.protocol.wire import OutputReply


class LocalClient:
    def __init__(self, number: int, max_backlog_bytes: int):
        self.peer = b"\x00local" + number.to_bytes(8, "big")
        self.max_backlog_bytes = max_backlog_bytes
        self._replies: asyncio.Queue[msgspec.Struct | None] = asyncio.Queue()
        self._backlog_bytes = 0
        self.closed = False

    def put(self, reply: msgspec.Struct) -> bool:
        """Queue a reply; False once unread replies pass the bound (a reader too slow)."""
        self._replies.put_nowait(reply)
        self._backlog_bytes += _size(reply)
        return self._backlog_bytes <= self.max_backlog_bytes

    async def get(self) -> msgspec.Struct | None:
        """The next reply; None once the client is closed."""
        reply = await self._replies.get()
        if reply is not None:
            self._backlog_bytes -= _size(reply)
        return reply

    def close(self) -> None:
        self.closed = True
        self._replies.put_nowait(None)  # wakes a reader waiting for a reply that will not come


def _size(reply: msgspec.Struct) -> int:
    """About what the reply costs held here: its text and ids, and a fixed part."""
    if isinstance(reply, OutputReply):
        return 128 + len(reply.text) + 8 * len(reply.output_ids)
    return 128
