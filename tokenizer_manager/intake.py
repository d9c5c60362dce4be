"""What waits before the scheduler: generates received and not yet handed to it (in the
tokenizer, or queued for it), and HTTP bodies being read. Counted per client and in all, in
requests and in bytes; past a cap a new one is refused at once with `overloaded`, so a flood
costs the server bounded memory and every request one reply.

One request is always let in when its client (or the server) has none waiting, however large:
--max-request-bytes bounds it, and a cap below one request must not refuse everything.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from radixserve.protocol.wire import GenerateRequest
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.request_decoder import ClientError

# What a request costs held here beyond its prompt (its struct, sampling parameters, task).
_REQUEST_OVERHEAD_BYTES = 1024
_BYTES_PER_INPUT_ID = 32  # a Python int in a list


@dataclass(slots=True)
class _Count:
    requests: int = 0
    nbytes: int = 0

    def fits(self, nbytes: int, max_requests: int, max_bytes: int) -> bool:
        if self.requests == 0:
            return True
        return self.requests < max_requests and self.nbytes + nbytes <= max_bytes

    def can_grow(self, nbytes: int, max_bytes: int) -> bool:
        return self.requests == 1 or self.nbytes + nbytes <= max_bytes

    def add(self, nbytes: int, sign: int) -> None:
        self.requests += sign
        self.nbytes += sign * nbytes


class Ticket:
    """One request's place in the intake, given back once (release is idempotent)."""

    def __init__(self, intake: Intake, client: Hashable, nbytes: int):
        self._intake: Intake | None = intake
        self.client = client
        self.nbytes = nbytes

    def grow(self, nbytes: int) -> None:
        """`nbytes` more for this request (an HTTP body of no declared length, as it arrives);
        ClientError `overloaded` past a bytes cap."""
        assert self._intake is not None, "grow after release"
        self._intake.grow(self, nbytes)

    def release(self) -> None:
        if self._intake is not None:
            self._intake.give_back(self)
            self._intake = None


class Intake:
    def __init__(self, args: ServerArgs):
        self.max_requests = args.max_pending_requests
        self.max_bytes = args.max_pending_bytes
        self.max_requests_per_client = args.max_pending_requests_per_client
        self.max_bytes_per_client = args.max_pending_bytes_per_client
        self.total = _Count()
        self.by_client: dict[Hashable, _Count] = {}

    def take(self, client: Hashable, nbytes: int, rid: str | None = None) -> Ticket:
        """A place for `nbytes` from `client`; ClientError `overloaded` past a cap."""
        mine = self.by_client.get(client, _Count())
        if not mine.fits(nbytes, self.max_requests_per_client, self.max_bytes_per_client):
            raise ClientError("overloaded", _refusal("this client's", mine, "-per-client"), rid)
        if not self.total.fits(nbytes, self.max_requests, self.max_bytes):
            raise ClientError("overloaded", _refusal("all clients'", self.total, ""), rid)
        mine.add(nbytes, +1)
        self.by_client[client] = mine
        self.total.add(nbytes, +1)
        return Ticket(self, client, nbytes)

    def grow(self, ticket: Ticket, nbytes: int) -> None:
        mine = self.by_client[ticket.client]
        if not mine.can_grow(nbytes, self.max_bytes_per_client):
            raise ClientError("overloaded", _refusal("this client's", mine, "-per-client"))
        if not self.total.can_grow(nbytes, self.max_bytes):
            raise ClientError("overloaded", _refusal("all clients'", self.total, ""))
        ticket.nbytes += nbytes
        mine.nbytes += nbytes
        self.total.nbytes += nbytes

    def give_back(self, ticket: Ticket) -> None:
        mine = self.by_client[ticket.client]
        mine.add(ticket.nbytes, -1)
        if mine.requests == 0:
            del self.by_client[ticket.client]
        self.total.add(ticket.nbytes, -1)


def held_bytes(req: GenerateRequest) -> int:
    """About what a generate costs held here until it reaches the scheduler."""
    prompt = len(req.text or "")
    if req.messages is not None:
        prompt = sum(len(m.content) for m in req.messages)
    if req.input_ids is not None:
        prompt = _BYTES_PER_INPUT_ID * len(req.input_ids)
    return _REQUEST_OVERHEAD_BYTES + prompt


def _refusal(whose: str, count: _Count, flag_suffix: str) -> str:
    return (
        f"{count.requests} of {whose} requests ({count.nbytes} bytes) wait for the scheduler "
        f"already (--max-pending-requests{flag_suffix}, --max-pending-bytes{flag_suffix}); "
        "retry later"
    )
