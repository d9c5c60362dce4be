"""client/local_server.launched_server, which every served test and benchmark starts its server
with: a process that holds a server and is killed outright takes the server down with it (SIGTERM,
so launch.py stops every child and removes its IPC directory; tests/test_faults.py shows that)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Stands in for launch.py: writes its pid, and on SIGTERM a file saying so, then exits.
SERVER = (
    "import os, signal, sys, time\n"
    "from pathlib import Path\n"
    "d = Path(sys.argv[1])\n"
    "signal.signal(signal.SIGTERM, lambda *_: (d.joinpath('terminated').touch(), sys.exit(0)))\n"
    "d.joinpath('pid.part').write_text(str(os.getpid()))\n"
    "os.replace(d / 'pid.part', d / 'pid')\n"
    "time.sleep(600)\n"
)

# Starts it through launched_server, says what it started (pid, log) and waits to be killed.
HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from radixserve.client.local_server import launched_server\n"
    "command = (sys.executable, '-c', sys.argv[1], sys.argv[2])\n"
    "with launched_server(command=command, wait=False) as s:\n"
    "    Path(sys.argv[2], 'started.part').write_text(f'{s.proc.pid} {s.log_path}')\n"
    "    Path(sys.argv[2], 'started.part').rename(Path(sys.argv[2], 'started'))\n"
    "    time.sleep(600)\n"
)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie left to a parent that does not reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_whose_starter_is_killed_outright_gets_sigterm(tmp_path: Path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, SERVER, str(tmp_path)])
    server, log = None, None
    try:
        started = tmp_path / "started"
        assert wait_for(lambda: (tmp_path / "pid").exists() and started.exists(), 60), (
            "the stand-in server never started"
        )
        server = int((tmp_path / "pid").read_text())
        launched, log = started.read_text().split(" ", 1)
        assert int(launched) == server, "launched_server's proc is not the server's process"
        assert not gone(server)
        holder.kill()  # SIGKILL: launched_server's own clean-up never runs
        holder.wait()
        assert wait_for(lambda: gone(server), 30), "the server outlived its starter"
        assert (tmp_path / "terminated").exists(), "the server was not sent SIGTERM"
    finally:
        holder.kill()
        holder.wait()
        if server is not None and not gone(server):
            os.kill(server, signal.SIGKILL)
        if log is not None:
            Path(log).unlink(missing_ok=True)  # launched_server's clean-up, killed, did not
