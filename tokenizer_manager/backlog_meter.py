"""Bytes of replies held for clients that read slower than they ask, all clients together
(--max-total-reply-backlog-bytes). Each client's backlog (outbox.py for ZMQ clients,
local_client.py for HTTP ones) adds what it takes in and takes off what leaves it."""

from __future__ import annotations


class BacklogMeter:
    def __init__(self, limit: int):
        self.limit = limit
        self.nbytes = 0

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes

    @property
    def over(self) -> bool:
        return self.nbytes > self.limit
