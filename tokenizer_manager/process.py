"""The tokenizer manager process: asyncio on uvloop, its loops over ZMQ, SIGTERM as a drain."""

from __future__ import annotations

import asyncio
import signal
from multiprocessing.connection import Connection

import uvloop

from radixserve.http_server.app import HttpServer, bind
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    configure_process,
    report_ready,
    take_torch_threads,
)
from radixserve.server_args import ServerArgs
from radixserve.tokenizer_manager.manager import TokenizerManager

HTTP_CLOSE_S = 3.0  # at shutdown, how long the HTTP server may take to close its connections


async def _serve(
    manager: TokenizerManager,
    http: HttpServer | None,
    ready_writer: Connection,
    heartbeat: Heartbeat,
    stopped_early: list[int],
) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if stopped_early:
        stop.set()
    loops = [
        asyncio.create_task(manager.client_loop()),
        asyncio.create_task(manager.output_loop()),
        asyncio.create_task(manager.replies.flush_loop()),
        asyncio.create_task(_beat(heartbeat)),
    ]
    if http is not None:
        loops.append(asyncio.create_task(http.run_on_loop()))
    reporting = asyncio.create_task(report_when_ready(manager, ready_writer))
    stopping = asyncio.create_task(stop.wait())
    # A loop ending means a bug; let it take the process, and so the server, down.
    done, _ = await asyncio.wait([*loops, stopping], return_when=asyncio.FIRST_COMPLETED)
    if stopping in done:
        await manager.shutdown()  # the loops keep running meanwhile: replies must still go out
        if http is not None:
            http.should_exit = True  # its responses are complete: it closes its connections
            await asyncio.wait([loops[-1]], timeout=HTTP_CLOSE_S)
    for task in loops:
        if task.done():
            task.result()
        task.cancel()
    reporting.cancel()
    await asyncio.gather(*loops, reporting, return_exceptions=True)
    manager.close()


async def report_when_ready(manager: TokenizerManager, ready_writer: Connection) -> None:
    # Only once every scheduler has said its model is loaded, and the detokenizer that it has its
    # tokenizer: launch.py's "radixserve ready" follows this, and a client that starts on that
    # line must not meet `not_ready`.
    await manager.model_ready.wait()
    report_ready(ready_writer, "tokenizer_manager")


async def _beat(heartbeat: Heartbeat) -> None:
    # On the event loop: a loop stuck in one callback stops beating, and the watchdog sees it.
    while True:
        heartbeat.beat()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def run_tokenizer_manager_process(
    args: ServerArgs,
    model_path: str,
    ipc_dir: str,
    ready_writer: Connection,
    heartbeat: Heartbeat,
) -> None:
    # launch.py's drain is a SIGTERM to this process. One that comes while it starts, before the
    # event loop takes the signal over, must start the drain once the loop runs, not be lost. A
    # list, not a threading.Event: a second signal's handler may run inside the first's.
    stopped_early: list[int] = []
    configure_process(
        "tokenizer_manager", args, on_sigterm=lambda signum, _: stopped_early.append(signum)
    )
    take_torch_threads(1)
    manager = TokenizerManager(args, model_path, ipc_dir)
    http = HttpServer(manager, bind(args.host, args.http_port)) if args.http_port else None
    uvloop.run(_serve(manager, http, ready_writer, heartbeat, stopped_early))
