"""Issue 13, "no watchdog": the launcher saw a child exit, but not a child that hangs. Here one
stops (SIGSTOP: there, its pipes open, its loop still): the launcher must notice, and exit
non-zero within 10 s, leaving nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from regression_wire import server_flags

from radixserve.client.local_server import launched_server
from radixserve.server_args import ServerArgs

WATCHDOG_S = 2


def _cmdline(pid: int) -> bytes:
    """Empty once the process is gone (or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_hung_server_process_takes_the_server_down(tiny_served_model: Path) -> None:
    # Before issue 13 there was no flag, and no watchdog whatever its timeout.
    has_flag = "watchdog_timeout" in ServerArgs.__struct_fields__
    watchdog = ["--watchdog-timeout", str(WATCHDOG_S)] if has_flag else []
    with launched_server("--model", str(tiny_served_model), *server_flags(*watchdog)) as server:
        processes = server.server_processes()
        assert len(processes) == 3, processes
        hung = processes[0]  # the first one launch.py starts: the scheduler
        os.kill(hung, signal.SIGSTOP)
        try:
            try:
                code = server.proc.wait(10)
            except subprocess.TimeoutExpired:
                pytest.fail("the server is still up 10 s after a process hung: no watchdog")
            assert code != 0
            assert not [pid for pid in processes if _cmdline(pid)], "a server process was left"
        finally:
            if _cmdline(hung):  # a stopped process takes no SIGTERM: leave none behind
                os.kill(hung, signal.SIGKILL)
