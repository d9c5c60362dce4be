"""Start radixserve: the scheduler (with the model), the detokenizer and the tokenizer manager.

    python launch.py [--model DIR_OR_HF_ID] [--port 30000] ...

Waits until every process reports ready, then watches them: if any one exits, or stops beating
for --watchdog-timeout seconds (hung), all are stopped and it exits non-zero. SIGINT / SIGTERM
drain: the tokenizer manager stops accepting requests and answers those in flight (finished
within --shutdown-timeout, or aborted), then all stop and it exits 0. The private IPC directory
is removed either way. Never leaves orphans.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from radixserve.model_worker.model_source import ModelNotFound, resolve_model_path
from radixserve.process_setup import HEARTBEAT_INTERVAL_S, Heartbeat
from radixserve.protocol.internal import ProcessReady
from radixserve.server_args import ServerArgs, parse_server_args

logger = logging.getLogger("radixserve")

READY_TIMEOUT_S = 600  # a large model on a slow disk takes minutes to load
WATCH_INTERVAL_S = 0.5  # how often the heartbeats are read
DRAIN_MARGIN_S = 15  # beyond --shutdown-timeout: aborting, and delivering the last replies


class Shutdown(Exception):
    pass


def _raise_shutdown(signum: int, _frame: object) -> None:
    raise Shutdown(signal.Signals(signum).name)


class Server:
    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        self.model_path = model_path
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-")  # mode 0700: ours alone
        self.procs: list[mp.Process] = []
        self.heartbeats: list[Heartbeat] = []

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        readers: dict[Connection, mp.Process] = {}
        for name, target in (
            ("scheduler", _run_scheduler),
            ("detokenizer", _run_detokenizer),
            ("tokenizer_manager", _run_tokenizer_manager),
        ):
            reader, writer = ctx.Pipe(duplex=False)
            heartbeat = Heartbeat(ctx)
            proc = ctx.Process(
                target=target,
                name=name,
                daemon=True,
                args=(self.args, self.model_path, self.ipc_dir, writer, heartbeat),
            )
            with _sigint_ignored():
                proc.start()
                self.procs.append(proc)
            writer.close()
            self.heartbeats.append(heartbeat)
            readers[reader] = proc
        self._wait_ready(readers)

    def _wait_ready(self, readers: dict[Connection, mp.Process]) -> None:
        pending = dict(readers)
        while pending:
            sentinels = {p.sentinel: p for p in pending.values()}
            ready = wait([*pending, *sentinels], timeout=READY_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S}s: {_names(pending)}")
            for item in ready:
                if item in sentinels:
                    raise RuntimeError(f"{sentinels[item].name} exited while starting")
                msg = msgspec.msgpack.decode(item.recv_bytes(), type=ProcessReady)
                logger.info("%s is ready (pid %d)", msg.name, pending[item].pid)
                del pending[item]

    def watch(self) -> str:
        """Block until a child exits or stops beating (hung); returns which, and how."""
        sentinels = {p.sentinel: p for p in self.procs}
        for heartbeat in self.heartbeats:
            heartbeat.beat()  # silence counts from now: each child has just reported ready
        timeout = self.args.watchdog_timeout
        while True:
            done = wait(list(sentinels), timeout=WATCH_INTERVAL_S)
            if done:
                proc = sentinels[done[0]]
                proc.join()
                return f"{proc.name} exited with code {proc.exitcode}"
            for proc, heartbeat in zip(self.procs, self.heartbeats):
                if heartbeat.silence() > timeout:
                    return f"{proc.name} stopped answering for {timeout:g}s (--watchdog-timeout)"

    def drain(self) -> None:
        """Let the tokenizer manager answer every request in flight and exit (its SIGTERM)."""
        manager = next((p for p in self.procs if p.name == "tokenizer_manager"), None)
        if manager is not None and manager.is_alive():
            manager.terminate()
            manager.join(self.args.shutdown_timeout + DRAIN_MARGIN_S)

    def stop(self) -> None:
        # SIGKILL: a child that hangs, or is stopped, must go too; none keeps state to save.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


# Each child's entry point imports its process module in the child. Every spawned child imports
# this module again (as its __main__), and only the scheduler needs torch and the model code:
# imported here, they would cost the launcher and each child ~5 s of CPU (and `--help` seconds).


def _run_scheduler(*args: Any) -> None:
    from radixserve.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


def _run_detokenizer(*args: Any) -> None:
    from radixserve.detokenizer.process import run_detokenizer_process

    run_detokenizer_process(*args)


def _run_tokenizer_manager(*args: Any) -> None:
    from radixserve.tokenizer_manager.process import run_tokenizer_manager_process

    run_tokenizer_manager_process(*args)


def _warn_if_reachable(args: ServerArgs) -> None:
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a host name
        loopback = args.host == "localhost"
    if not loopback:
        logger.warning(
            "Listening on %s: any machine that reaches it can use the server%s. The wire is not "
            "encrypted; keep it on a trusted network.",
            args.host,
            "" if args.api_key else " (no --api-key)",
        )


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """A child exec'd while SIGINT is ignored starts with it ignored (Python then installs no
    KeyboardInterrupt handler), so that a Ctrl-C in the terminal, which reaches the whole
    process group, cannot cut a child's imports short with a traceback: launch.py alone stops
    the children. SIGINT is blocked meanwhile too: Linux keeps a blocked signal pending even
    while ignored, so a Ctrl-C that lands while a child starts reaches launch.py's own handler
    once it is back, instead of being lost."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _names(pending: dict[Connection, mp.Process]) -> str:
    return ", ".join(p.name for p in pending.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_server_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s launch] %(message)s", datefmt="%H:%M:%S"
    )
    if args.watchdog_timeout < 2 * HEARTBEAT_INTERVAL_S:
        logger.error("--watchdog-timeout must be at least %gs", 2 * HEARTBEAT_INTERVAL_S)
        return 2
    signal.signal(signal.SIGINT, _raise_shutdown)
    signal.signal(signal.SIGTERM, _raise_shutdown)
    try:
        model_path = resolve_model_path(args.model)  # may download or convert: interruptible
    except ModelNotFound as e:
        logger.error("%s", e)
        return 2
    except Shutdown as sig:
        logger.info("%s received; shutting down", sig)
        return 0
    _warn_if_reachable(args)
    server = Server(args, model_path)
    logger.info("IPC directory %s", server.ipc_dir)
    try:
        server.start()
        http = f" and http://{args.host}:{args.http_port}" if args.http_port else ""
        logger.info(
            "radixserve ready on tcp://%s:%d%s (model %s)", args.host, args.port, http, model_path
        )
        reason = server.watch()
        logger.error("%s; shutting down", reason)
        return 1
    except Shutdown as sig:
        logger.info("%s received; answering the requests in flight, then shutting down", sig)
        with contextlib.suppress(Shutdown):  # a second signal cuts the drain short
            server.drain()
        return 0
    except RuntimeError as e:
        logger.error("%s; shutting down", e)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
