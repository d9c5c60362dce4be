"""Issue 22, "a failed first start poisons every later start" and "two environments rebuild each
other's kernels", from the command line, on a kernel cache of this module's own: a server killed
(SIGKILL, launcher and children at once) in the middle of its first kernel build, then started
again, must come up and say why it builds again; a second environment (the same torch at another
install path, as a venv of its own would have it) must not build over the first's kernels.

Before issue 22 the restart waits forever on the lock the killed build left: the replay's
version says so once nothing has been built nor logged for HANG_S. The module builds the kernels
twice per test (the killed build is stopped as soon as a compiler runs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from regression_wire import server_flags

from radixserve.client.local_server import LaunchedServer, free_port, wait_healthy

HANG_S = 60  # not ready, no compiler running and nothing logged for this long: a hang
# Four full builds: the suite checks the same faster (tests/test_kernel_cache.py).
pytestmark = pytest.mark.replay_only
START_BOUND_S = 600  # a full build on two loaded cores takes a few minutes
COMPILERS = (b"cc1plus", b"ninja", b"c++", b"g++")


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def compiling(pid: int) -> bool:
    """Whether a compiler runs under `pid`."""
    for child in descendants(pid):
        try:
            argv0 = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name.encode() in COMPILERS:
            return True
    return False


@dataclass
class Start:
    server: LaunchedServer

    def stop(self, gently: bool = True) -> None:
        """SIGTERM first if `gently`, then all of it at once, compilers too: its process group."""
        if gently and self.server.proc.poll() is None:
            self.server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait()


def start(model: Path, cache: Path, pythonpath: str | None = None) -> Start:
    """`python -m radixserve.launch` on `cache`, in a process group of its own, not waited for."""
    env = {**os.environ, "RADIXSERVE_KERNEL_CACHE": str(cache)}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    port, http_port = free_port(), free_port()
    log_path = Path(tempfile.mkstemp(prefix="radixserve-kernel-build-", suffix=".log")[1])
    command = [sys.executable, "-m", "radixserve.launch", "--model", str(model)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, "--port", str(port), "--http-port", str(http_port), *server_flags()],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Start(LaunchedServer(proc, f"tcp://127.0.0.1:{port}", log_path, http_port))


def ready(started: Start) -> str:
    """Waits until it serves, and gives its log; fails the test on a hang or an exit."""
    server, began = started.server, time.monotonic()
    last_busy, last_log = began, ""
    while time.monotonic() - began < START_BOUND_S:
        try:
            wait_healthy(server, 5)
            return server.log()
        except RuntimeError:
            pass
        log = server.log()
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited ({server.proc.returncode}) while starting:\n{log}")
        if log != last_log or compiling(server.proc.pid):
            last_busy, last_log = time.monotonic(), log
        if time.monotonic() - last_busy > HANG_S:
            pytest.fail(
                f"the start hangs: not ready, no compiler running and nothing logged for "
                f"{HANG_S} s (the lock of a killed build?); its log ends:\n{log[-2000:]}"
            )
    pytest.fail(f"not ready after {START_BOUND_S} s:\n{server.log()[-2000:]}")


def builds(cache: Path) -> dict[Path, int]:
    """Every built library in the cache, with its modification time."""
    return {so: so.stat().st_mtime_ns for so in cache.rglob("*.so")}


def serve_once(model: Path, cache: Path, pythonpath: str | None = None) -> str:
    """Starts a server on `cache`, waits until it serves, stops it: its log."""
    started = start(model, cache, pythonpath)
    try:
        return ready(started)
    finally:
        started.stop()
        started.server.log_path.unlink()


def test_a_start_killed_mid_build_is_followed_by_one_that_serves_and_says_why(
    tiny_served_model: Path, tmp_path: Path
):
    cache = tmp_path / "kernel-cache"
    first = start(tiny_served_model, cache)
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not compiling(first.server.proc.pid):
            assert first.server.proc.poll() is None, first.server.log()
            assert time.monotonic() < deadline, "no compiler ran: " + first.server.log()
            time.sleep(0.1)
        time.sleep(2)  # into the compile
    finally:
        first.stop(gently=False)  # as the launcher stopped its children when a port was taken
        first.server.log_path.unlink()
    log = serve_once(tiny_served_model, cache)
    assert builds(cache), "nothing was built"
    assert "interrupted" in log, f"the restart does not say why it builds again:\n{log}"


def test_two_environments_on_one_cache_do_not_rebuild_each_others_kernels(
    tiny_served_model: Path, tmp_path: Path
):
    cache = tmp_path / "kernel-cache"
    serve_once(tiny_served_model, cache)
    first_env = builds(cache)
    other_env = tmp_path / "site-packages"  # the same torch at another install path
    other_env.mkdir()
    (other_env / "torch").symlink_to(Path(torch.__file__).parent)
    for pythonpath in (str(other_env), None):  # the second environment, then the first again
        serve_once(tiny_served_model, cache, pythonpath)
        rebuilt = {so for so in builds(cache) if so.parent in {p.parent for p in first_env}}
        changed = {so for so in rebuilt if first_env.get(so) != so.stat().st_mtime_ns}
        assert not changed, f"the other environment's start rebuilt the kernels: {changed}"
