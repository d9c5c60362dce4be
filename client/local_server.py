"""Start a real local server (`python launch.py ...`) on a free port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from radixserve.client.messages import ServerError
from radixserve.client.sync_client import Client
from radixserve.protocol.transport import allow_ipv6

REPO_ROOT = Path(__file__).resolve().parent.parent

# Run ahead of the server's command on Linux: the kernel sends it SIGTERM (launch.py then stops
# the whole server) when the thread that started it is gone, so a test run or benchmark killed
# outright leaves no server holding the cores and ports. A parent already gone by then: exit.
_DIE_WITH_STARTER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_this_thread(command: Sequence[str]) -> list[str]:
    """`command`, run so that on Linux the kernel sends it SIGTERM when the thread that starts it
    is gone (_DIE_WITH_STARTER): any server a test or benchmark starts, ours or a peer's."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-c", _DIE_WITH_STARTER, str(os.getpid()), *command]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    address: str
    log_path: Path
    http_port: int = 0  # 0: the server has no HTTP front

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """pids of launch.py's child processes now (multiprocessing's resource tracker too)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def server_processes(self) -> list[int]:
        """The children that are server processes (spawned by multiprocessing)."""
        # Named "radixserve: <role>" once started (process_setup.configure_process).
        return [
            pid
            for pid in self.children()
            if b"spawn_main" in _cmdline(pid) or _cmdline(pid).startswith(b"radixserve: ")
        ]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextmanager
def launched_server(
    *args: str,
    start_timeout: float = 300,
    command: Sequence[str] = (sys.executable, "-m", "radixserve.launch"),
    cwd: Path | None = None,
    wait: bool = True,
) -> Iterator[LaunchedServer]:
    """`command` starts the server (an installed `radixserve` entry point, say); `args` follow
    its `--port` and `--http-port` (free ports: servers started at once never collide). With
    `wait` False it comes back at once, before the server is ready: see `wait_healthy`. The
    server lives as long as the thread that started it (on Linux), so start it from one that
    outlives it; there a command that cannot be run shows as a server that exited while starting."""
    port, http_port = free_port(), free_port()
    log_path = Path(tempfile.mkstemp(prefix="radixserve-test-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            dying_with_this_thread(
                [*command, "--port", str(port), "--http-port", str(http_port), *args]
            ),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = LaunchedServer(proc, f"tcp://127.0.0.1:{port}", log_path, http_port)
    try:
        if wait:
            wait_healthy(server, start_timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        os.unlink(log_path)


def wait_healthy(server: LaunchedServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    # A send waits for the server to bind, and goes the moment it does; the short timeouts are
    # how often a server that died while starting is noticed.
    with Client(server.address, timeout=2, connect_timeout=1) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited while starting:\n{server.log()[-4000:]}")
            try:
                client.health()
                return
            except (TimeoutError, ConnectionError):
                continue
            except ServerError as e:  # up, but its model is still loading
                if e.code != "not_ready":
                    raise
                time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{server.log()[-4000:]}")


def raw_round_trip(address: str, payload: bytes, timeout_ms: int = 30_000) -> dict:
    """Send raw bytes as one request over a fresh DEALER and decode the one reply: for tests of
    what the server does with malformed or invalid requests that Client would refuse to build."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    allow_ipv6(sock, address)
    sock.connect(address)
    try:
        sock.send(payload)
        if not sock.poll(timeout_ms):
            raise TimeoutError(f"no reply within {timeout_ms} ms")
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
