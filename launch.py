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
from radixserve.process_setup import (
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    bound_onednn_caches,
    free_port,
)
from radixserve.protocol.internal import ProcessReady
from radixserve.protocol.wire import MAX_API_KEY_CHARS
from radixserve.server_args import (
    RankPlacement,
    ServerArgs,
    check_speculative_args,
    parse_server_args,
)

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
        """This node's model processes (every TP rank it hosts, of every replica); on node 0 also
        the data-parallel controller (with several replicas), the detokenizer and the tokenizer
        manager."""
        readers: dict[Connection, mp.Process] = {}
        for placement in local_placements(self.args):
            target = _run_scheduler if placement.tp_rank == 0 else _run_tp_follower
            self._start(placement.process_name, target, readers, placement)
        if self.args.node_rank == 0:
            if self.args.dp_size > 1:
                self._start("dp_controller", _run_dp_controller, readers)
            self._start("detokenizer", _run_detokenizer, readers)
            self._start("tokenizer_manager", _run_tokenizer_manager, readers)
        self._wait_ready(readers)

    def _start(
        self, name: str, target: Any, readers: dict[Connection, mp.Process], *extra: Any
    ) -> None:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        heartbeat = Heartbeat(ctx)
        proc = ctx.Process(
            target=target,
            name=name,
            daemon=True,
            args=(self.args, self.model_path, self.ipc_dir, writer, heartbeat, *extra),
        )
        with _sigint_ignored():
            proc.start()
            self.procs.append(proc)
        writer.close()
        self.heartbeats.append(heartbeat)
        readers[reader] = proc

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
            # A hung TP rank soon stops the others too, waiting in a collective: name the one
            # silent longest, the one that stopped first.
            proc, heartbeat = max(
                zip(self.procs, self.heartbeats), key=lambda pair: pair[1].silence()
            )
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


def _run_tp_follower(*args: Any) -> None:
    from radixserve.scheduler.process import run_tp_follower

    run_tp_follower(*args)


def _run_dp_controller(*args: Any) -> None:
    from radixserve.scheduler.dp_controller import run_dp_controller_process

    run_dp_controller_process(*args)


def _run_detokenizer(*args: Any) -> None:
    from radixserve.detokenizer.process import run_detokenizer_process

    run_detokenizer_process(*args)


def _run_tokenizer_manager(*args: Any) -> None:
    from radixserve.tokenizer_manager.process import run_tokenizer_manager_process

    run_tokenizer_manager_process(*args)


def local_placements(args: ServerArgs) -> list[RankPlacement]:
    """The model processes this node runs: each node hosts an equal, consecutive share of every
    replica's TP ranks. Replica i's ranks meet at --dist-init-addr's port + i."""
    if args.dist_init_addr is not None:
        host, port = args.dist_init_addr.rsplit(":", 1)
        addrs = [f"{host}:{int(port) + i}" for i in range(args.dp_size)]
    else:
        addrs = [f"127.0.0.1:{free_port()}" for _ in range(args.dp_size)]
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    return [
        RankPlacement(dp_rank=dp, tp_rank=tp, dist_init_addr=addrs[dp])
        for dp in range(args.dp_size)
        for tp in range(first, first + per_node)
    ]


def check_parallel_args(args: ServerArgs) -> str | None:
    """Why the parallel flags do not fit together, or None."""
    if min(args.tp_size, args.dp_size, args.nnodes) < 1:
        return "--tp-size, --dp-size and --nnodes must be at least 1"
    if args.tp_size % args.nnodes:
        return f"--tp-size {args.tp_size} does not split over --nnodes {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}"
    if args.nnodes > 1 and args.dist_init_addr is None:
        return "--nnodes above 1 needs --dist-init-addr (node 0's host:port)"
    if args.dist_init_addr is not None and not args.dist_init_addr.rpartition(":")[2].isdigit():
        return f"--dist-init-addr {args.dist_init_addr!r} is not host:port"
    return None


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
    # An empty key would turn authentication off in silence; a longer one could never match,
    # since a request's api_key is refused past that length.
    if args.api_key is not None and not 0 < len(args.api_key) <= MAX_API_KEY_CHARS:
        logger.error("--api-key must have 1 to %d characters", MAX_API_KEY_CHARS)
        return 2
    if args.enable_overlap_schedule and args.disable_overlap_schedule:
        logger.error("--enable-overlap-schedule and --disable-overlap-schedule contradict")
        return 2
    mistake = check_parallel_args(args) or check_speculative_args(args)
    if mistake is not None:
        logger.error("%s", mistake)
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
    bound_onednn_caches()
    server = Server(args, model_path)
    logger.info("IPC directory %s", server.ipc_dir)
    try:
        server.start()
        if args.node_rank == 0:
            http = f" and http://{args.host}:{args.http_port}" if args.http_port else ""
            address = f"tcp://{args.host}:{args.port}{http}"
            logger.info("radixserve ready on %s (model %s)", address, model_path)
        else:
            logger.info("radixserve node %d of %d ready", args.node_rank, args.nnodes)
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
