"""The wire as a client sees it, with every wait bounded: on the code before issue 13's fixes a
server may die or keep silent, and the test must say so rather than hang."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from radixserve.client.local_server import LaunchedServer
from radixserve.server_args import ServerArgs

CONTEXT = 64
POOL = 100  # KV tokens: two requests of 3 + 60 tokens fill it, and the rest wait
PROMPT = [10, 11, 12]  # token ids: no tokenizer in the way


def server_flags(*flags: str) -> list[str]:
    """`flags` and one thread per model process (two on two shared cores slow a tiny model's
    step 25 times). The code before issue 13's fixes calls it --torch-threads."""
    fields = ServerArgs.__struct_fields__
    threads = "--num-threads" if "num_threads" in fields else "--torch-threads"
    return [threads, "1", *flags]


def generate(rid: str, fields: dict[str, Any] | None = None, **params: Any) -> dict[str, Any]:
    """A greedy, short generate request of PROMPT; `fields` go beside `sampling_params`."""
    request = {
        "type": "generate",
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, **params},
    }
    return request | (fields or {})


class Wire:
    """A DEALER of the test's own: no client library between the test and the server."""

    def __init__(self, server: LaunchedServer):
        self.server = server
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(server.address)

    def send(self, request: dict[str, Any]) -> None:
        self.sock.send(msgspec.msgpack.encode(request))

    def receive(self, timeout: float = 30) -> dict[str, Any]:
        """The next reply; fails, saying why, when the server exits or keeps silent."""
        deadline = time.monotonic() + timeout
        while not self.sock.poll(100):
            code = self.server.proc.poll()
            if code is not None:
                pytest.fail(f"the server exited (code {code}) instead of replying")
            if time.monotonic() > deadline:
                pytest.fail(f"no reply within {timeout:.0f} s")
        return msgspec.msgpack.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def ask(wire: Wire, request: dict[str, Any]) -> dict[str, Any]:
    wire.send(request)
    return wire.receive()


def assert_refused(reply: dict[str, Any], field: str) -> None:
    assert reply["type"] == "error", f"a {field} out of its range was accepted ({reply['type']})"
    assert reply["code"] == "invalid_request" and field in reply["message"], reply


def assert_serves(wire: Wire) -> None:
    reply = ask(wire, generate("still-serving"))
    assert reply["type"] == "output" and reply["finished"], reply
