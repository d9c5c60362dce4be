"""Issue 22, "flags are not checked before processes start": a flag the model or the server
cannot work with must be one line from the launcher and exit code 2, before any process starts;
before the fixes `--tp-size` that does not divide the heads gave tracebacks from every process,
and `--page-size 0` and `--max-prefill-tokens 0` started a server that could not serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from regression_wire import server_flags

from radixserve.client.local_server import free_port

WRONG = {  # flags: what a server started with them did before the fixes
    "tp-size-3": (("--tp-size", "3"), "tracebacks"),  # the tiny model has 4 heads
    "page-size-0": (("--page-size", "0"), "a ZeroDivisionError on the first request"),
    "max-prefill-tokens-0": (("--max-prefill-tokens", "0"), "nothing admitted, ever"),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_flag_that_cannot_work_is_one_line_and_exit_2(tiny_served_model: Path, name: str):
    flags, before = WRONG[name]
    command = [sys.executable, "-m", "radixserve.launch", "--model", str(tiny_served_model)]
    ports = ["--port", str(free_port()), "--http-port", str(free_port())]
    proc = subprocess.Popen(
        [*command, *ports, *server_flags(*flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(flags)} was accepted: the server started ({before})")
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (
        f"{' '.join(flags)} was not refused in one line ({before}): exit code "
        f"{proc.returncode}, {err.count('Traceback')} tracebacks, {len(lines)} lines on stderr"
    )
    assert lines[0].startswith("radixserve: error: ") and flags[0] in lines[0], lines
