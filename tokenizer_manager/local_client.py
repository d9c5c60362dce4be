"""A client inside the tokenizer manager's process (one HTTP request): it takes the same request
path as a ZMQ client (validation, in-flight tracking, abort when it leaves), but its replies are
structs on a queue rather than msgpack frames on the ROUTER.

Its peer id starts with a zero byte and is longer than libzmq's own (5 bytes): a ZMQ client may
not pick an id starting with zero, so none can pose as a local client or reach its requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import msgspec

from radixserve.protocol.wire import ErrorReply, OutputReply
from radixserve.tokenizer_manager.backlog_meter import BacklogMeter


class LocalClient:
    def __init__(
        self, number: int, max_backlog_bytes: int, meter: BacklogMeter, owner: Hashable = None
    ):
        self.peer = b"\x00local" + number.to_bytes(8, "big")
        # Who the admission caps count it against: its HTTP client's address; else itself.
        self.owner = owner if owner is not None else self.peer
        self.max_backlog_bytes = max_backlog_bytes
        self.meter = meter
        self._replies: asyncio.Queue[msgspec.Struct | None] = asyncio.Queue()
        self.backlog_bytes = 0  # of the replies not read yet
        self.closed = False

    def put(self, reply: msgspec.Struct) -> bool:
        """Queue a reply; False once unread replies pass the bound (a reader too slow)."""
        self._replies.put_nowait(reply)
        self._held(_size(reply))
        return self.backlog_bytes <= self.max_backlog_bytes

    async def get(self) -> msgspec.Struct | None:
        """The next reply; None once the client is closed."""
        reply = await self._replies.get()
        if reply is not None:
            self._held(-_size(reply))
        return reply

    def fail(self, error: ErrorReply) -> None:
        """The client reads too slowly: its unread replies are thrown away, `error` comes next
        (one error ends an HTTP request)."""
        self._discard()
        self.put(error)

    def close(self) -> None:
        self.closed = True
        self._discard()  # nobody reads them now
        self._replies.put_nowait(None)  # wakes a reader waiting for a reply that will not come

    def _discard(self) -> None:
        while not self._replies.empty():
            self._replies.get_nowait()
        self._held(-self.backlog_bytes)

    def _held(self, nbytes: int) -> None:
        self.backlog_bytes += nbytes
        self.meter.add(nbytes)


# A (logprob, token id) pair held as Python objects: a tuple, a float and an int.
LOGPROB_PAIR_BYTES = 120


def _size(reply: msgspec.Struct) -> int:
    """About what the reply costs held here: its text and ids, its logprobs (256 top ones a
    token make a streamed token's reply ~30 KB, a prompt's 2^20 ~100 MB), and a fixed part."""
    if not isinstance(reply, OutputReply):
        return 128
    meta = reply.meta_info
    pairs = len(meta.output_token_logprobs or ()) + len(meta.input_token_logprobs or ())
    for tops in (meta.output_top_logprobs, meta.input_top_logprobs):
        pairs += sum(map(len, tops or ()))
    return 128 + len(reply.text) + 8 * len(reply.output_ids) + LOGPROB_PAIR_BYTES * pairs
