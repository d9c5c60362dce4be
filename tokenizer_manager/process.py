"""The tokenizer manager process: asyncio on uvloop, two loops over ZMQ."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

import msgspec
import uvloop

from radixserve.process_setup import configure_process
from radixserve.protocol.internal import ProcessReady
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.manager import TokenizerManager


async def _serve(manager: TokenizerManager, ready_writer: Connection) -> None:
    ready_writer.send_bytes(msgspec.msgpack.encode(ProcessReady("tokenizer_manager")))
    # Either loop ending means a bug; let it take the process, and so the server, down.
    tasks = [asyncio.create_task(manager.client_loop()), asyncio.create_task(manager.output_loop())]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


def run_tokenizer_manager_process(
    args: ServerArgs, model_path: str, ipc_dir: str, ready_writer: Connection
) -> None:
    configure_process("tokenizer_manager", args)
    manager = TokenizerManager(args, model_path, ipc_dir)
    uvloop.run(_serve(manager, ready_writer))
