"""The tokenizer manager alone, over its real sockets: a test plays the scheduler and the
detokenizer by the internal protocol, so that it can order their messages as a race would, and
see exactly what reaches the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixserve.client.local_server import free_port
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    BatchStrOut,
    DetokenizerReady,
    ReqStrOut,
    SchedulerInput,
    SchedulerReady,
)
from radixserve.protocol.wire import FinishReason
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.manager import TokenizerManager


@dataclass
class Harness:
    manager: TokenizerManager
    address: str
    ctx: zmq.asyncio.Context
    scheduler: zmq.asyncio.Socket  # what the manager sends to the scheduler arrives here
    backend: zmq.asyncio.Socket  # what the test sends here reaches the manager as the detokenizer's

    def client(self, **options: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(self.address)
        return sock

    async def to_scheduler(self, timeout: float = 10) -> Any:
        data = await asyncio.wait_for(self.scheduler.recv(), timeout)
        return msgspec.msgpack.decode(data, type=SchedulerInput)

    async def announce_ready(self) -> None:
        """What the detokenizer sends once it has its tokenizer, and the scheduler once its model
        is loaded; back once the manager has both."""
        await self.backend.send(msgspec.msgpack.encode(DetokenizerReady()))
        await self.backend.send(msgspec.msgpack.encode(SchedulerReady(0, max_total_tokens=1 << 20)))
        while not self.manager.ready:
            await asyncio.sleep(0.01)

    async def output(
        self, cid: str, ids: list[int], reason: FinishReason | None = None, text: str = "t"
    ) -> None:
        out = ReqStrOut(cid, text, ids, reason, 3, len(ids), 0)
        await self.backend.send(msgspec.msgpack.encode(BatchStrOut([out])))


@contextlib.asynccontextmanager
async def tokenizer_manager(
    model_dir: Path, ready: bool = True, **overrides: Any
) -> AsyncIterator[Harness]:
    """The manager and the test's ends of its sockets; `ready`: the scheduler has said its model
    is loaded (else the test says so, with `announce_ready`)."""
    ipc_dir = tempfile.mkdtemp(prefix="rs-tm-")
    args = ServerArgs(model=str(model_dir), port=free_port(), **overrides)
    manager = TokenizerManager(args, str(model_dir), ipc_dir)
    ctx = zmq.asyncio.Context()
    harness = Harness(
        manager,
        f"tcp://127.0.0.1:{args.port}",
        ctx,
        transport.bind_pull(ctx, ipc_dir, transport.SCHEDULER_INPUT),
        transport.connect_push(ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT),
    )
    # The manager before issue 13's fixes had no flush_loop and no close(): tests/replay_issue13.py
    # runs some of these tests on it, to show them red there.
    loops = [
        asyncio.create_task(loop())
        for loop in (manager.client_loop, manager.output_loop, _flush_loop(manager))
        if loop is not None
    ]
    try:
        if ready and hasattr(manager, "ready"):
            await harness.announce_ready()
        yield harness
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if hasattr(manager, "close"):
            manager.close()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _flush_loop(manager: TokenizerManager) -> Any:
    """The reply flusher: on the manager's `replies` today, on the manager itself when it came
    (issue 13), absent before."""
    return getattr(getattr(manager, "replies", manager), "flush_loop", None)


async def send(sock: zmq.asyncio.Socket, **request: Any) -> None:
    await sock.send(msgspec.msgpack.encode(request))


async def receive(sock: zmq.asyncio.Socket, timeout: float = 10) -> dict:
    return msgspec.msgpack.decode(await asyncio.wait_for(sock.recv(), timeout))


def generate(rid: str, stream: bool = True, **params: Any) -> dict:
    return {
        "type": "generate",
        "rid": rid,
        "text": "hi",
        "stream": stream,
        "sampling_params": params,
    }
