"""What tests read of a server started by `launched_server`: its processes and its IPC directory,
from launch.py's log."""

from __future__ import annotations

import re
import time

from radixserve.client.local_server import LaunchedServer


def child_pids(server: LaunchedServer) -> dict[str, int]:
    """Each server process's pid, by name."""
    # A client may be served a moment before launch.py has logged the last child ready.
    deadline = time.monotonic() + 30
    while "radixserve ready" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    ready = re.findall(r"(\w+) is ready \(pid (\d+)\)", server.log())
    return {name: int(pid) for name, pid in ready}


def ipc_dir(server: LaunchedServer) -> str:
    match = re.search(r"IPC directory (\S+)", server.log())
    assert match is not None
    return match.group(1)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    """The pids still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)  # multiprocessing's resource tracker leaves once launch.py is gone
    return [pid for pid in pids if alive(pid)]
