"""The tokenizer manager's one way to the scheduler: a PUSH socket of typed messages.

pyzmq queues a send when it is called, so the order of the calls is the order the scheduler
sees, whenever (and whether) their results are awaited: a caller that must keep two messages in
order makes both calls without awaiting in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, cast

import msgspec
import zmq.asyncio

from radixserve.protocol import transport
from radixserve.protocol.internal import AbortReq


class SchedulerLink:
    def __init__(self, ctx: zmq.asyncio.Context, ipc_dir: str):
        self._push = transport.connect_push(ctx, ipc_dir, transport.SCHEDULER_INPUT)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> Awaitable[Any]:
        return cast(Awaitable[Any], self._push.send(self._encoder.encode(msg)))

    async def abort(self, ids: list[str]) -> None:
        await asyncio.gather(*[self.send(AbortReq(cid)) for cid in ids])
