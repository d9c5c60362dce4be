"""Issue 22, "security and operations" and "first hour", from the command line and the wire:
control queries that wait on a stuck scheduler for ever, SIGHUP not handled, children that show
in `ps` as `python3 -B -c from multiprocessing.spawn ...`, and a shutdown whose last log line is
not "stopped"."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from regression_wire import server_flags

from radixserve.client.local_server import LaunchedServer, launched_server

CONTROL_WAIT_S = 30  # well past the server's own timeout for a control query


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


# Each replay_only test here is checked in the suite by a wider one (tests/replay_issue22.py runs
# them all): the stuck scheduler by test_server_flags' test_control_queries_answer_503_in_bounded_
# time_while_the_scheduler_is_stuck; SIGHUP and the processes' names by test_faults'
# test_sighup_drains_like_sigterm_and_ps_names_each_process; SIGTERM's last log line by
# test_reliability's test_sigterm_under_load_answers_every_request_and_exits_0.
@pytest.mark.replay_only
def test_health_answers_in_bounded_time_while_the_scheduler_is_stuck(
    small_server: LaunchedServer,
) -> None:
    scheduler = small_server.server_processes()[0]  # the first one launch.py starts
    os.kill(scheduler, signal.SIGSTOP)  # as in a long CPU prefill: there, but not answering
    try:
        reply = httpx.get(f"{small_server.http_url}/health", timeout=CONTROL_WAIT_S)
    except httpx.TimeoutException:
        pytest.fail(f"/health waited {CONTROL_WAIT_S} s on a stuck scheduler: no timeout")
    finally:
        os.kill(scheduler, signal.SIGCONT)
    assert reply.status_code == 503, reply.text


@pytest.mark.replay_only
def test_each_server_process_is_named_by_its_role(small_server: LaunchedServer) -> None:
    names = [_cmdline(pid) for pid in small_server.children()]
    servers = [name for name in names if "resource_tracker" not in name]
    assert len(servers) == 3, names
    unnamed = [name for name in servers if not name.startswith("radixserve: ")]
    assert not unnamed, f"server processes not named by role in ps: {unnamed}"


@pytest.mark.replay_only
def test_sighup_drains_like_sigterm(tiny_served_model: Path) -> None:
    with launched_server("--model", str(tiny_served_model), *server_flags()) as server:
        server.proc.send_signal(signal.SIGHUP)  # a closed terminal
        try:
            code = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGHUP not handled: the server is still up 30 s after it")
        assert code == 0, f"SIGHUP not handled: the launcher exited with {code}"


@pytest.mark.replay_only
def test_the_last_log_line_says_stopped(tiny_served_model: Path) -> None:
    with launched_server("--model", str(tiny_served_model), *server_flags()) as server:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        last = server.log().strip().splitlines()[-1]
    assert "stopped" in last, f"the last log line is not 'stopped': {last!r} (exit code {code})"
