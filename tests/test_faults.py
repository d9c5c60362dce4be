"""A server process that dies or hangs takes the whole server down, at once and completely: the
launcher names it, stops the rest, removes the IPC directory and exits non-zero within 10 s."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from live_server import child_pids, ipc_dir, wait_gone

from radixserve.client.local_server import launched_server

WATCHDOG_S = 2


FAULTS = [
    ("scheduler", signal.SIGKILL, "scheduler was killed by SIGKILL"),
    ("detokenizer", signal.SIGKILL, "detokenizer was killed by SIGKILL"),
    ("tokenizer_manager", signal.SIGKILL, "tokenizer_manager was killed by SIGKILL"),
    # A hang: the process is there, its pipes open, its main loop stopped.
    ("scheduler", signal.SIGSTOP, f"scheduler stopped answering for {WATCHDOG_S}s"),
]


@pytest.mark.parametrize("child, sig, named", FAULTS)
def test_a_dead_or_hung_child_stops_the_server(tiny_served_model, child, sig, named):
    with launched_server(
        "--model",
        str(tiny_served_model),
        "--num-threads",
        "1",
        "--watchdog-timeout",
        str(WATCHDOG_S),
    ) as s:
        pids, ipc = child_pids(s), ipc_dir(s)
        assert sorted(pids) == ["detokenizer", "scheduler", "tokenizer_manager"]
        assert os.stat(ipc).st_mode & 0o777 == 0o700  # the server's alone
        children = s.children()
        start = time.monotonic()
        os.kill(pids[child], sig)
        assert s.proc.wait(10) == 1
        print(
            f"\n{child} {signal.Signals(sig).name}: server down in {time.monotonic() - start:.1f} s"
        )
        assert named in s.log()
        assert wait_gone(children) == []
        assert not os.path.exists(ipc)
        assert s.log().splitlines()[-1].endswith("stopped (exit code 1)")


def test_sighup_drains_like_sigterm_and_ps_names_each_process(tiny_served_model):
    """A closed terminal sends SIGHUP: the server drains and stops, exit 0, leaving nothing."""
    with launched_server("--model", str(tiny_served_model), "--num-threads", "1") as s:
        pids, ipc = child_pids(s), ipc_dir(s)
        for name, pid in pids.items():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert f.read().rstrip(b"\0") == f"radixserve: {name}".encode()
        children = s.children()
        s.proc.send_signal(signal.SIGHUP)
        assert s.proc.wait(30) == 0
        log = s.log()
        assert "SIGHUP received; answering the requests in flight" in log
        assert log.splitlines()[-1].endswith("stopped (exit code 0)")
        assert "Traceback" not in log
        assert wait_gone(children) == []
        assert not os.path.exists(ipc)


def test_a_sigterm_while_the_tokenizer_manager_starts_is_not_lost(tiny_served_model):
    """launch.py drains by sending the tokenizer manager SIGTERM. Sent while the manager loads its
    tokenizer (its title set, its event loop not yet running), it was ignored: the manager went
    on to take requests, and 15 s later launch.py killed it under them."""
    with launched_server("--model", str(tiny_served_model), wait=False) as s:
        deadline = time.monotonic() + 120
        while not any(_title(pid) == "radixserve: tokenizer_manager" for pid in s.children()):
            assert time.monotonic() < deadline and s.proc.poll() is None, s.log()
            time.sleep(0.01)
        # Titled, it loads its tokenizer for a second or more before its loop runs.
        s.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        answers = set()
        while s.proc.poll() is None and time.monotonic() - sent < 30:
            with contextlib.suppress(httpx.HTTPError):  # not listening (yet, or any more)
                answers.add(httpx.get(f"{s.http_url}/health", timeout=1).status_code)
            time.sleep(0.1)
        took = time.monotonic() - sent
        assert s.proc.wait(30) == 0
        print(f"\nSIGTERM while the tokenizer manager starts: stopped in {took:.1f} s")
        assert took < 13, s.log()  # the drain's kill came after 15 s
        assert "Shutting down" in s.log(), "the manager never drained"
        assert 200 not in answers, "a server told to stop took requests"


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    except OSError:
        return ""
