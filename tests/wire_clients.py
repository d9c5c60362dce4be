"""Raw wire-format clients for tests: a DEALER that keeps every reply it gets, by rid, so that a
test can count them (the Python client drops what nobody waits for)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio


@dataclass
class Replies:
    """Every reply one socket got, by rid."""

    by_rid: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    finals: dict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))

    def add(self, reply: dict) -> None:
        rid = reply.get("rid")  # None for control replies
        self.by_rid[rid].append(reply)
        if rid is None or reply["type"] == "error" or reply.get("finished"):
            self.finals[rid].set()


class WireClient:
    """One DEALER and a reader task that keeps every reply."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.replies = Replies()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            reply = msgspec.msgpack.decode(await self.sock.recv())
            self.replies.add(reply)  # the current Replies: a test may swap them meanwhile

    async def send(self, **request: Any) -> None:
        await self.sock.send(msgspec.msgpack.encode(request))

    async def chunks(self, rid: str, count: int) -> None:
        """Until `count` replies for rid came, or its last."""
        while len(self.replies.by_rid[rid]) < count and not self.replies.finals[rid].is_set():
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        self.sock.close(linger=0)


def generate(rid: str, prompt: str, max_new: int, stream: bool, **params: Any) -> dict:
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0, **params}
    return {
        "type": "generate",
        "rid": rid,
        "text": prompt,
        "stream": stream,
        "sampling_params": params,
    }


def output_ids(replies: list[dict]) -> list[int]:
    return [t for r in replies if r["type"] == "output" for t in r["output_ids"]]


def finals(replies: list[dict]) -> list[dict]:
    return [r for r in replies if r["type"] == "output" and r["finished"]]
