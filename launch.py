"""Start radixserve: the scheduler (with the model), the detokenizer and the tokenizer manager.

    python launch.py [--model DIR_OR_HF_ID] [--port 30000] ...

Waits until every process reports ready, then watches them: if any one exits, or on SIGINT /
SIGTERM, all are stopped and the private IPC directory is removed. Never leaves orphans.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait

import msgspec

from radixserve.model_worker.model_source import ModelNotFound, resolve_model_path
from radixserve.protocol.internal import ProcessReady
from radixserve.server_args import ServerArgs, parse_server_args

logger = logging.getLogger("radixserve")

READY_TIMEOUT_S = 600  # a large model on a slow disk takes minutes to load
STOP_GRACE_S = 5


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

    def start(self) -> None:
        # Imported here, after the arguments are parsed: they pull in torch and transformers,
        # which would make `--help` take seconds.
        from radixserve.detokenizer.process import run_detokenizer_process
        from radixserve.scheduler.process import run_scheduler_process
        from radixserve.tokenizer_manager.process import run_tokenizer_manager_process

        ctx = mp.get_context("spawn")
        readers: dict[Connection, mp.Process] = {}
        for name, target in (
            ("scheduler", run_scheduler_process),
            ("detokenizer", run_detokenizer_process),
            ("tokenizer_manager", run_tokenizer_manager_process),
        ):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=target,
                name=name,
                daemon=True,
                args=(self.args, self.model_path, self.ipc_dir, writer),
            )
            with _sigint_ignored():
                proc.start()
                self.procs.append(proc)
            writer.close()
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
                logger.info("%s is ready", msg.name)
                del pending[item]

    def watch(self) -> str:
        """Block until a child exits; returns its description."""
        sentinels = {p.sentinel: p for p in self.procs}
        done = wait(list(sentinels))
        proc = sentinels[done[0]]
        proc.join()
        return f"{proc.name} exited with code {proc.exitcode}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


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
    server = Server(args, model_path)
    try:
        server.start()
        logger.info("radixserve ready on tcp://%s:%d (model %s)", args.host, args.port, model_path)
        reason = server.watch()
        logger.error("%s; shutting down", reason)
        return 1
    except Shutdown as sig:
        logger.info("%s received; shutting down", sig)
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
