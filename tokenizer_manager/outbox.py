"""Replies to clients through the ROUTER: never blocking the loop, never dropped in silence.

With ROUTER_MANDATORY a send fails instead of vanishing: EHOSTUNREACH when the client is gone,
EAGAIN when its queue (SNDHWM messages, then the kernel's socket buffers) is full because it reads
slower than its requests produce. What cannot go yet waits here in order, up to a bound in bytes
per client; past it, the manager gives up on that client.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from radixserve.tokenizer_manager.backlog_meter import BacklogMeter


class Delivery(enum.Enum):
    SENT = "sent"
    QUEUED = "queued"  # waits for room in the client's queue
    GONE = "gone"  # the client is not connected any more
    OVERFLOW = "overflow"  # queued, and the client's backlog is now over the bound


@dataclass(slots=True)
class _Backlog:
    # Each message with what it answers (the manager's request), so that a drop can say whose
    # replies were lost.
    messages: deque[tuple[list[bytes], object]] = field(default_factory=deque)
    nbytes: int = 0


class Outbox:
    def __init__(self, router: zmq.asyncio.Socket, max_backlog_bytes: int, meter: BacklogMeter):
        self.router = router
        self.max_backlog_bytes = max_backlog_bytes
        self.meter = meter
        self.backlogs: dict[bytes, _Backlog] = {}  # by the client's routing id
        self.waiting = asyncio.Event()  # set while some backlog is not empty
        self.new_backlog = asyncio.Event()  # set when a client's backlog begins
        self.sent = 0  # messages sent from the backlogs (so that a flush that sent none shows)

    def send(self, envelope: list[bytes], data: bytes, owner: object = None) -> Delivery:
        frames = [*envelope, data]
        backlog = self.backlogs.get(envelope[0])
        if backlog is None:
            sent = self._try_send(frames)
            if sent is not None:
                return sent
            backlog = self.backlogs[envelope[0]] = _Backlog()
            self.waiting.set()
            self.new_backlog.set()
        # Behind older ones: a client gets its replies in order.
        backlog.messages.append((frames, owner))
        self._held(backlog, len(data))
        return Delivery.OVERFLOW if backlog.nbytes > self.max_backlog_bytes else Delivery.QUEUED

    def flush(self) -> list[bytes]:
        """Send what waits, oldest first, until each client's queue is full again. Returns the
        clients found gone; their backlogs are dropped."""
        gone = []
        for peer, backlog in list(self.backlogs.items()):
            if self._drain(backlog) is Delivery.GONE:
                gone.append(peer)
                self._forget(peer)
            elif not backlog.messages:
                del self.backlogs[peer]
        if not self.backlogs:
            self.waiting.clear()
        return gone

    def _drain(self, backlog: _Backlog) -> Delivery | None:
        while backlog.messages:
            sent = self._try_send(backlog.messages[0][0])
            if sent is not Delivery.SENT:
                return sent
            frames, _ = backlog.messages.popleft()
            self._held(backlog, -len(frames[-1]))
            self.sent += 1
        return Delivery.SENT

    def drop(self, peer: bytes) -> list[object]:
        """Forget what waits for `peer`; returns the owners of what was thrown away."""
        backlog = self._forget(peer)
        if not self.backlogs:
            self.waiting.clear()
        if backlog is None:
            return []
        return list(dict.fromkeys(o for _, o in backlog.messages if o is not None))  # each once

    def _forget(self, peer: bytes) -> _Backlog | None:
        backlog = self.backlogs.pop(peer, None)
        if backlog is not None:
            self.meter.add(-backlog.nbytes)
        return backlog

    def _held(self, backlog: _Backlog, nbytes: int) -> None:
        backlog.nbytes += nbytes
        self.meter.add(nbytes)

    def _try_send(self, frames: list[bytes]) -> Delivery | None:
        """SENT or GONE; None when the client's queue is full."""
        # With NOBLOCK, pyzmq's asyncio socket tries the send at once: the future is done.
        done = self.router.send_multipart(frames, flags=zmq.NOBLOCK)
        assert isinstance(done, asyncio.Future) and done.done()
        error = done.exception()
        if error is None:
            return Delivery.SENT
        if isinstance(error, zmq.Again):
            return None
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            return Delivery.GONE
        raise error
