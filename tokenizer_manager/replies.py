"""Replies to clients: ZMQ clients' through the ROUTER (outbox.py), local (HTTP) clients' on
their queues (local_client.py). Each reply goes to the client that asked, and only to it; a
client found gone (by a reply to it: ZMQ tells of no peer sooner, so a request that is not
streamed runs to its end) or reading too slowly has its requests aborted, their KV freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Hashable
from dataclasses import dataclass

import msgspec
import zmq.asyncio

from radixserve.protocol.wire import ErrorReply
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager import request_log
from radixserve.tokenizer_manager.backlog_meter import BacklogMeter
from radixserve.tokenizer_manager.inflight import Envelope, InFlight, InFlightRequest
from radixserve.tokenizer_manager.local_client import LocalClient
from radixserve.tokenizer_manager.outbox import Delivery, Outbox
from radixserve.tokenizer_manager.request_decoder import ClientError
from radixserve.tokenizer_manager.scheduler_link import SchedulerLink

logger = logging.getLogger("radixserve.tokenizer_manager")

FLUSH_INTERVAL_S = 0.01  # how often replies waiting for a slow client are tried again
# Clients that read nothing for a while are tried less often, down to this (a new backlog, of
# any client, brings the short interval back): a stalled client cost 100 tries a second.
MAX_FLUSH_INTERVAL_S = 0.32
_CLIENT_BOUND = "--max-reply-backlog-bytes"
_TOTAL_BOUND = "--max-total-reply-backlog-bytes (all clients together; this one had the most)"


@dataclass(frozen=True, slots=True, eq=False)  # each one itself (the outbox keeps owners once)
class _ErrorFor:
    """An error reply for a rid that no registered request answers (a refusal before one was
    registered, an abort of an unknown rid): the outbox's owner of it."""

    envelope: Envelope
    rid: str


class Replies:
    def __init__(
        self, args: ServerArgs, router: zmq.asyncio.Socket, inflight: InFlight, link: SchedulerLink
    ):
        self.args = args
        self.inflight = inflight
        self.link = link
        self.backlog_meter = BacklogMeter(args.max_total_reply_backlog_bytes)
        self.outbox = Outbox(router, args.max_reply_backlog_bytes, self.backlog_meter)
        self.local_clients: dict[bytes, LocalClient] = {}
        self._local_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()

    async def answer_errors(
        self, envelope: Envelope, work: Awaitable[None], rid: str | None = None
    ) -> None:
        """Do `work` (for request `rid`, if it has one) for the client at `envelope`; a refusal,
        or a bug, costs it one error."""
        try:
            await work
        except ClientError as e:
            await self.reply_error(envelope, e)
        except Exception as e:  # a bug must cost this client its request, not the server
            logger.exception("request %r failed", rid)  # repr: a rid cannot forge a line
            bug = ClientError("internal", f"{type(e).__name__}: {e}", rid)
            await self.reply_error(envelope, bug)

    async def reply_error(
        self, envelope: Envelope, error: ClientError, request: InFlightRequest | None = None
    ) -> None:
        """One error, the last reply for `request` (or for `error.rid`, where no request was
        registered): if it waits for a slow client and is thrown away, the client is still owed
        a last reply for that rid."""
        if self.args.log_requests:
            request_log.failed(error.rid, error.code, error.message)
        owner: object = request
        if request is None and error.rid is not None:
            owner = _ErrorFor(envelope, error.rid)
        await self.reply(envelope, ErrorReply(error.code, error.message, rid=error.rid), owner)

    async def reply(self, envelope: Envelope, reply: msgspec.Struct, owner: object = None) -> None:
        """`owner`: what the reply answers (an InFlightRequest, or an error's _ErrorFor)."""
        match self._deliver(envelope, reply, owner):
            case Delivery.GONE:
                await self.drop_client(envelope[0])
            case Delivery.OVERFLOW:
                await self.drop_client(envelope[0], too_slow_for=_CLIENT_BOUND)
        if self.backlog_meter.over:
            await self._drop_largest_backlog()

    def _deliver(self, envelope: Envelope, reply: msgspec.Struct, owner: object = None) -> Delivery:
        local = self.local_clients.get(envelope[0])
        if local is not None:
            return Delivery.SENT if local.put(reply) else Delivery.OVERFLOW
        return self.outbox.send(envelope, self._encoder.encode(reply), owner)

    async def drop_client(self, peer: bytes, too_slow_for: str | None = None) -> None:
        """Abort every request of a client that is gone, or that reads too slowly (past the
        bound named by `too_slow_for`): then each of them gets one `overloaded` error in place
        of the replies it did not read."""
        if too_slow_for is not None:
            logger.warning(
                "A client reads too slowly: %d bytes of replies wait for it, past %s. "
                "Aborting its %d requests.",
                self.backlog_bytes(peer),
                too_slow_for,
                len(self.inflight.of_peer(peer)),
            )
        lost = self.outbox.drop(peer)
        requests = self.inflight.of_peer(peer)
        # A request already answered whose last replies were among those thrown away (an error
        # among them) is owed an error too: every request ends with exactly one final reply.
        owed: list[InFlightRequest | _ErrorFor] = [*requests]
        owed += [r for r in lost if isinstance(r, _ErrorFor)]
        owed += [r for r in lost if isinstance(r, InFlightRequest) and r.answered]
        if too_slow_for is None and requests:
            logger.info("A client went away. Aborting its %d requests.", len(requests))
        for request in requests:  # all answered first: a concurrent drop finds none of them
            self.inflight.answer(request)
        # Every abort sent before the first await: the task may be cancelled at it (an HTTP
        # handler stops its disconnect watch once woken), which cut off the requests after one.
        # Shielded: a send the full pipe holds back must not be cancelled with this task.
        aborts = self.link.abort([cid for r in requests for cid in self.inflight.live_ids(r)])
        await asyncio.shield(aborts)
        if too_slow_for is None:
            return
        message = f"replies to this client went unread past {too_slow_for}: request aborted"
        local = self.local_clients.get(peer)
        if local is not None:  # an HTTP request, which one error ends
            local.fail(ErrorReply("overloaded", message))
            return
        for request in owed:
            self._deliver(request.envelope, ErrorReply("overloaded", message, rid=request.rid))

    async def _drop_largest_backlog(self) -> None:
        """Replies held for all clients together passed --max-total-reply-backlog-bytes: the
        client that has the most of them waiting is dropped."""
        largest = max([*self.outbox.backlogs, *self.local_clients], key=self.backlog_bytes)
        await self.drop_client(largest, too_slow_for=_TOTAL_BOUND)

    def backlog_bytes(self, peer: bytes) -> int:
        local = self.local_clients.get(peer)
        if local is not None:
            return local.backlog_bytes
        backlog = self.outbox.backlogs.get(peer)
        return 0 if backlog is None else backlog.nbytes

    async def flush_loop(self) -> None:
        """Retry the replies that wait for room in a slow client's queue."""
        interval = FLUSH_INTERVAL_S
        while True:
            await self.outbox.waiting.wait()
            sent = self.outbox.sent
            self.outbox.new_backlog.clear()
            for peer in self.outbox.flush():
                await self.drop_client(peer)
            stalled = self.outbox.sent == sent
            interval = min(2 * interval, MAX_FLUSH_INTERVAL_S) if stalled else FLUSH_INTERVAL_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.outbox.new_backlog.wait(), interval)
                interval = FLUSH_INTERVAL_S

    async def flush_last(self, timeout: float) -> None:
        """At shutdown: what waits for slow clients gets `timeout` seconds to leave."""
        deadline = time.monotonic() + timeout
        while self.outbox.backlogs and time.monotonic() < deadline:
            self.outbox.flush()
            await asyncio.sleep(FLUSH_INTERVAL_S)

    # ---- in-process clients (the HTTP front) ---------------------------------------------------

    def open_local_client(self, owner: Hashable = None) -> LocalClient:
        client = LocalClient(
            next(self._local_ids), self.args.max_reply_backlog_bytes, self.backlog_meter, owner
        )
        self.local_clients[client.peer] = client
        return client

    def client_of(self, peer: bytes) -> Hashable:
        """Who a request from `peer` counts against: a ZMQ connection, or an HTTP address."""
        local = self.local_clients.get(peer)
        return local.owner if local is not None else peer

    async def close_local_client(self, client: LocalClient) -> None:
        """The client is done or gone: what it still has in flight is aborted."""
        if self.local_clients.pop(client.peer, None) is not None:
            client.close()
            await self.drop_client(client.peer)
