"""launch.py before it serves: --help, its flags, a --model that is not there, Ctrl-C while
starting. Real processes, and no server ever gets ready here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from radixserve.client.local_server import REPO_ROOT, LaunchedServer, free_port
from radixserve.model_worker.model_runner import CPU_MAX_KV_TOKENS
from radixserve.server_args import build_parser


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "launch.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_help_imports_neither_torch_nor_transformers():
    """What made `--help` take 5 s, checked without timing it."""
    code = (
        "import sys\n"
        "from radixserve.launch import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('heavy:', sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--sampling-defaults" in out.stdout
    assert "heavy: []" in out.stdout
    assert launch("--help").returncode == 0  # and the script form parses as the module does


def test_every_server_flag_has_help_and_a_default():
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert len(actions) >= 20
    for action in actions:
        assert action.help, f"{action.option_strings} has no help"
        assert "default" in action.help % {"default": action.default}, action.option_strings
    # The documented CPU KV default is model_runner's, which --help must not import.
    (kv,) = [a.help % {} for a in actions if a.dest == "max_total_tokens"]
    assert str(CPU_MAX_KV_TOKENS) in kv


def test_a_missing_directory_is_called_one():
    out = launch("--model", "/no/such/dir")
    assert out.returncode == 2
    assert "/no/such/dir: no such directory" in out.stderr
    assert "Hub" not in out.stderr


def test_an_unreachable_hub_id_suggests_the_installed_hub_command():
    out = launch("--model", "no-such-org/no-such-model", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "`hf download no-such-org/no-such-model`" in out.stderr


def test_overlap_flags_that_contradict_each_other_are_refused():
    out = launch("--enable-overlap-schedule", "--disable-overlap-schedule")
    assert out.returncode == 2
    assert "contradict" in out.stderr


def test_ctrl_c_while_starting_stops_everything_without_a_traceback():
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="radixserve-test-", suffix=".log") as log:
        # Its own process group, which a terminal's Ctrl-C signals as a whole.
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.launch", "--port", str(port), "--http-port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        server = LaunchedServer(proc, f"tcp://127.0.0.1:{port}", Path(log.name))
        try:
            deadline = time.monotonic() + 120
            while len(server.server_processes()) < 3:  # then they import torch: seconds
                assert proc.poll() is None and time.monotonic() < deadline, server.log()
                time.sleep(0.02)
            # A child that did not ignore SIGINT from its start would die of it inside its
            # imports and print a traceback (or half of one: launch.py is killing it by then).
            assert all(_ignores_sigint(pid) for pid in server.server_processes())
            children = server.children()
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = server.log()
    assert "ready on" not in text, "it was meant to be interrupted while starting"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "SIGINT received" in text
    deadline = time.monotonic() + 10
    while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
