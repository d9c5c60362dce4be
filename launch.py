"""Start radixserve: the scheduler (with the model), the detokenizer and the tokenizer manager.

    python launch.py [--model DIR_OR_HF_ID] [--port 30000] ...

Flags that do not fit each other, the model or this machine are refused before any process
starts (one line, exit code 2). Waits until every process reports ready (one that fails first
is named in one line, with why), then watches them: if any one exits, or stops beating for
--watchdog-timeout seconds (hung), all are stopped and it exits non-zero. SIGINT / SIGTERM /
SIGHUP drain: the tokenizer manager stops accepting requests and answers those in flight
(finished within --shutdown-timeout, or aborted), then all stop and it exits 0. The private IPC
directory is removed either way. Never leaves orphans. The last line it logs is "stopped (exit
code N)".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import importlib
import ipaddress
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import msgspec

from radixserve.model_worker.model_source import ModelNotFound, resolve_model_path
from radixserve.process_setup import (
    Heartbeat,
    bound_onednn_caches,
    free_port,
    has_reported_ready,
)
from radixserve.protocol.internal import LauncherInput, ProcessFailed, ProcessReady
from radixserve.server_args import (
    RankPlacement,
    ServerArgs,
    parse_server_args,
    usable_cores,
    usage_error,
)

logger = logging.getLogger("radixserve")

# As SGLang's SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN: a context past the model's positions.
ALLOW_LONG_CONTEXT_ENV = "RADIXSERVE_ALLOW_LONG_CONTEXT"
READY_TIMEOUT_S = 600  # a large model on a slow disk takes minutes to load
WATCH_INTERVAL_S = 0.5  # how often the heartbeats are read
DRAIN_MARGIN_S = 15  # beyond --shutdown-timeout: aborting, and delivering the last replies


# Each drains: SIGHUP too, which a closed terminal or `systemctl reload`-style tooling sends.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# A BaseException, as KeyboardInterrupt is: a library's `except Exception` (huggingface_hub's
# retry offline, say) must not swallow a Ctrl-C and start the server anyway.
class Shutdown(BaseException):
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
        self.readers: list[Connection] = []  # each child's ready (or failed) message

    def start(self) -> None:
        """This node's model processes (every TP rank it hosts, of every replica); on node 0 also
        the data-parallel controller (with several replicas), the detokenizer and the tokenizer
        manager."""
        for placement in local_placements(self.args):
            target = _run_scheduler if placement.tp_rank == 0 else _run_tp_follower
            self._start(placement.process_name, target, placement)
        if self.args.node_rank == 0:
            if self.args.dp_size > 1:
                self._start("dp_controller", _run_dp_controller)
            self._start("detokenizer", _run_detokenizer)
            self._start("tokenizer_manager", _run_tokenizer_manager)
        self._wait_ready()

    def _start(self, name: str, target: Any, *extra: Any) -> None:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        heartbeat = Heartbeat(ctx)
        proc = ctx.Process(
            target=target,
            name=name,
            daemon=True,
            args=(self.args, self.model_path, self.ipc_dir, writer, heartbeat, *extra),
        )
        with _terminal_signals_ignored():
            proc.start()
            self.procs.append(proc)
        writer.close()
        self.heartbeats.append(heartbeat)
        self.readers.append(reader)

    def _wait_ready(self) -> None:
        pending = dict(zip(self.readers, self.procs))
        started: dict[int, mp.Process] = {}  # the sentinels of those ready: one may die meanwhile
        while pending:
            ready = wait([*pending, *started], timeout=READY_TIMEOUT_S)
            if not ready:
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S}s: {_names(pending)}")
            for item in ready:
                if isinstance(item, int):  # a ready child's end, while others were starting
                    proc = started[item]
                    raise RuntimeError(f"{proc.name} {self._why(proc)} while the others started")
                reader = item  # readable: a message, or the end of a child that died
                proc = pending.pop(reader)
                try:
                    msg = msgspec.msgpack.decode(reader.recv_bytes(), type=LauncherInput)
                except (EOFError, OSError):
                    msg = None
                if not isinstance(msg, ProcessReady):
                    reason = msg.reason if isinstance(msg, ProcessFailed) else self._why(proc)
                    raise RuntimeError(f"{proc.name} failed while starting: {reason}")
                logger.info("%s is ready (pid %d)", msg.name, proc.pid)
                started[proc.sentinel] = proc

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
                return f"{proc.name} {self._why(proc)}"
            # A hung TP rank soon stops the others too, waiting in a collective: name the one
            # silent longest, the one that stopped first.
            proc, heartbeat = max(
                zip(self.procs, self.heartbeats), key=lambda pair: pair[1].silence()
            )
            if heartbeat.silence() > timeout:
                return f"{proc.name} stopped answering for {timeout:g}s (--watchdog-timeout)"

    def _why(self, proc: mp.Process) -> str:
        """Why a child stopped, in words: its own last word, else its exit code or signal."""
        proc.join(5)  # it has closed its pipe or exited: its exit code comes at once
        reader = self.readers[self.procs.index(proc)]
        with contextlib.suppress(EOFError, OSError, msgspec.DecodeError):
            while reader.poll():
                msg = msgspec.msgpack.decode(reader.recv_bytes(), type=LauncherInput)
                if isinstance(msg, ProcessFailed):
                    return f"failed: {msg.reason}"
        code = proc.exitcode
        if code is None:
            return "closed its pipe to the launcher but is still running"
        if code < 0 and -code == signal.SIGKILL:
            return "was killed by SIGKILL (by the OOM killer if memory ran out: see dmesg)"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def drain(self) -> None:
        """Let the tokenizer manager answer every request in flight and exit (its SIGTERM)."""
        manager = next((p for p in self.procs if p.name == "tokenizer_manager"), None)
        if manager is not None and manager.is_alive():
            manager.terminate()
            manager.join(self.args.shutdown_timeout + DRAIN_MARGIN_S)

    def stop(self) -> None:
        # SIGKILL: a child that hangs, or is stopped, must go too; none keeps state to save.
        # What the children started goes too (a first start's kernel compilers, which would
        # otherwise go on compiling for a minute after the server is gone).
        # Only living children's: a reaped one's pid may be another process's by now.
        alive = [proc.pid for proc in self.procs if proc.pid and proc.exitcode is None]
        started = [pid for parent in alive for pid in _descendants(parent)]
        for pid in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
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
    _run_child("radixserve.scheduler.process", "run_scheduler_process", *args)


def _run_tp_follower(*args: Any) -> None:
    _run_child("radixserve.scheduler.process", "run_tp_follower", *args)


def _run_dp_controller(*args: Any) -> None:
    _run_child("radixserve.scheduler.dp_controller", "run_dp_controller_process", *args)


def _run_detokenizer(*args: Any) -> None:
    _run_child("radixserve.detokenizer.process", "run_detokenizer_process", *args)


def _run_tokenizer_manager(*args: Any) -> None:
    _run_child("radixserve.tokenizer_manager.process", "run_tokenizer_manager_process", *args)


def _run_child(module: str, function: str, *args: Any) -> None:
    """A child's entry point: an exception ends it with one line to the launcher, which reports
    it. While starting (a model that does not fit a flag, say), that line is all; once serving
    (a bug), the traceback is logged too."""
    ready_writer: Connection = args[3]
    name = mp.current_process().name
    try:
        getattr(importlib.import_module(module), function)(*args)
    except Exception as e:
        serving = has_reported_ready()
        logging.getLogger(name).log(
            logging.ERROR if serving else logging.DEBUG, "%s failed", name, exc_info=True
        )
        hint = "" if serving else " (--log-level debug shows the traceback)"
        with contextlib.suppress(OSError):
            said = " ".join(str(e).split())  # one line, as a library's message may not be
            reason = f"{type(e).__name__}: {said}{hint}"
            ready_writer.send_bytes(msgspec.msgpack.encode(ProcessFailed(name, reason)))
        sys.exit(1)
    _exit_unfinalized()


def _exit_unfinalized() -> None:
    """A child whose work is done (the tokenizer manager after its drain) exits at once: tearing
    down an interpreter that holds torch and transformers costs ~1 s of CPU, and every stop
    waits for it. What atexit holds still runs, and the output is flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or closed
            stream.flush()
    os._exit(0)


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


def check_fit(args: ServerArgs, model_path: str) -> str | None:
    """Why these flags do not fit the model or this machine, or None: checked before any
    process starts, so that a mistake is one line, not a traceback from each child."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"{model_path}: its config.json cannot be read ({e})"
    if not isinstance(config, dict):
        return f"{model_path}: its config.json is not a JSON object"
    longest = _trained_context(config)
    if (
        args.context_length is not None
        and longest is not None
        and args.context_length > longest
        and os.environ.get(ALLOW_LONG_CONTEXT_ENV) != "1"
    ):
        return (
            f"--context-length {args.context_length} is past the model's context ({longest}, "
            "its max_position_embeddings, times a linear RoPE scaling's factor): positions it "
            f"was never trained on give garbage (set {ALLOW_LONG_CONTEXT_ENV}=1 to allow it anyway)"
        )
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    tp = args.tp_size
    if heads % tp:
        return f"--tp-size {tp} does not divide the model's {heads} attention heads"
    if (kv_heads % tp) if kv_heads >= tp else (tp % kv_heads):
        return f"--tp-size {tp} and the model's {kv_heads} KV heads do not divide one another"
    processes = args.dp_size * args.tp_size // args.nnodes
    cores = usable_cores()
    if _on_cpu(args) and processes > cores:
        return (
            f"--dp-size {args.dp_size} x --tp-size {args.tp_size} is {processes} model processes "
            f"on this node, which has {cores} cores"
        )
    if args.node_rank > 0:
        return None  # only the first node binds the client ports and the TP groups' stores
    ports = [("--port", args.port)] + ([("--http-port", args.http_port)] if args.http_port else [])
    for flag, port in ports:
        refusal = _bind_refusal(args.host, port)
        if refusal is not None:
            return f"{flag} {port} on --host {args.host}: {refusal}"
    return _store_refusal(args)


def _store_refusal(args: ServerArgs) -> str | None:
    """Why node 0 could not host each replica's TP store at --dist-init-addr's ports, or None.
    torch's store listens on every address, whatever the host: a port in use on any of them
    failed after loading."""
    if args.dist_init_addr is None or args.tp_size == 1:  # one rank a replica: no store
        return None
    port = int(args.dist_init_addr.rsplit(":", 1)[1])
    for replica_port in range(port, port + args.dp_size):
        refusal = _listen_refusal(replica_port)
        if refusal is not None:
            where = f"node 0 hosts a TP group's store on port {replica_port}"
            return f"--dist-init-addr: {where}: {refusal}"
    return None


def _listen_refusal(port: int) -> str | None:
    """Why no socket could listen on `port` on every address, IPv4 and IPv6, or None."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        every = "::"
    except OSError:  # no IPv6 on this machine
        sock, every = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((every, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


def _trained_context(config: dict[str, Any]) -> int | None:
    """The positions a model was trained for, as SGLang and vLLM derive them: a linear RoPE
    scaling stretches max_position_embeddings by its factor (a llama3 config states the
    stretched length itself)."""
    longest = config.get("max_position_embeddings")
    if not isinstance(longest, int):
        return None
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    factor = scaling.get("factor") if kind == "linear" else None
    return int(longest * factor) if isinstance(factor, (int, float)) and factor > 1 else longest


def _bind_refusal(host: str, port: int) -> str | None:
    """Why the server could not bind host:port (in use, not an address of this machine, a
    privileged port, a host that does not resolve), or None."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        return f"the host does not resolve ({e.strerror or e})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ and uvicorn bind
        try:
            s.bind((host, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


def _on_cpu(args: ServerArgs) -> bool:
    """Whether the model runs on the CPU (the launcher does not import torch to ask)."""
    return args.device == "cpu" or (args.device == "auto" and not Path("/dev/nvidiactl").exists())


def _warn_if_oversubscribed(args: ServerArgs) -> None:
    """--num-threads past the cores: OpenMP threads that outnumber the cores wait on each other
    at every barrier, and a step runs many times slower."""
    if args.num_threads is None or not _on_cpu(args):
        return
    processes = args.dp_size * args.tp_size // args.nnodes
    cores = usable_cores()
    if args.num_threads * processes > cores:
        logger.warning(
            "--num-threads %d x %d model processes is more threads than this node's %d cores: "
            "every step will be slower than with %d threads a process (the default)",
            args.num_threads,
            processes,
            cores,
            max(1, cores // processes),
        )


def _warn_if_store_elsewhere(args: ServerArgs) -> None:
    """Node 0's ranks reach their store through --dist-init-addr's host: one that is not an
    address of this machine works only through a NAT (a container's published port, a
    Service's address); a mistyped one leaves them waiting for the start timeout."""
    if args.dist_init_addr is None or args.tp_size == 1 or args.node_rank > 0:
        return
    host = args.dist_init_addr.rsplit(":", 1)[0].strip("[]")
    if _bind_refusal(host, 0) is not None:
        logger.warning(
            "--dist-init-addr %s is not an address of this machine (node 0): its ranks reach "
            "their store there only through a NAT; if it is a mistake they wait %d s",
            args.dist_init_addr,
            READY_TIMEOUT_S,
        )


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
def _terminal_signals_ignored() -> Iterator[None]:
    """A child exec'd while SIGINT and SIGHUP are ignored starts with them ignored (Python then
    installs no KeyboardInterrupt handler), so that a Ctrl-C or a closed terminal, which reach
    the whole process group, cannot cut a child's imports short with a traceback: launch.py
    alone stops the children. They are blocked meanwhile too: Linux keeps a blocked signal
    pending even while ignored, so one that lands while a child starts reaches launch.py's own
    handler once it is back, instead of being lost."""
    signals = {signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, theirs, and so on, as /proc lists them now (Linux); none
    where it does not."""
    found: list[int] = []
    todo = [pid]
    while todo:
        tasks = Path(f"/proc/{todo.pop()}/task")
        with contextlib.suppress(OSError):  # gone meanwhile (a compiler ends every second)
            for task in os.listdir(tasks):
                new = [int(child) for child in (tasks / task / "children").read_text().split()]
                found += new
                todo += new
    return found


def _names(pending: dict[Connection, mp.Process]) -> str:
    return ", ".join(p.name for p in pending.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_server_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s launch] %(message)s", datefmt="%H:%M:%S"
    )
    code = serve(args)
    logger.info("stopped (exit code %d)", code)  # the last line, whatever happened
    return code


def serve(args: ServerArgs) -> int:
    """Start, watch and stop the server; its exit code."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _raise_shutdown)
    try:
        model_path = resolve_model_path(args.model)  # may download or convert: interruptible
        if args.speculative_draft_model_path is not None:  # the model processes read a directory
            flag = "--speculative-draft-model-path"
            draft_path = resolve_model_path(args.speculative_draft_model_path, flag)
            args = msgspec.structs.replace(args, speculative_draft_model_path=draft_path)
    except ModelNotFound as e:
        logger.error("%s", e)
        return 2
    except Shutdown as sig:
        logger.info("%s received; shutting down", sig)
        return 0
    mistake = check_fit(args, model_path)
    if mistake is not None:
        usage_error(mistake)
    _warn_if_reachable(args)
    _warn_if_oversubscribed(args)
    _warn_if_store_elsewhere(args)
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
        for signum in _STOP_SIGNALS:  # a second Ctrl-C must not cut the teardown
            signal.signal(signum, signal.SIG_IGN)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
