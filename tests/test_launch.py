"""launch.py before it serves: --help, its flags, a --model that is not there, Ctrl-C while
starting. Real processes, and no server ever gets ready here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from argparse import SUPPRESS
from pathlib import Path

import pytest

from radixserve.client.local_server import REPO_ROOT, LaunchedServer, free_port
from radixserve.model_worker.model_runner import CPU_MAX_KV_TOKENS
from radixserve.server_args import build_parser, parse_server_args


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
    actions = [a for a in build_parser()._actions if a.dest != "help" and a.help != SUPPRESS]
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
    draft = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/no/d")
    out = launch(*draft)
    assert out.returncode == 2
    assert "--speculative-draft-model-path /no/d: no such directory" in out.stderr


def test_a_gguf_file_is_called_one(tmp_path):
    """It was "no such directory", with the file right there."""
    from radixserve.model_worker.model_source import ModelNotFound, resolve_model_path

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFound, match="m.gguf: a GGUF file; a model is a directory"):
        resolve_model_path(str(tmp_path / "m.gguf"))


def test_an_unreachable_hub_id_suggests_the_installed_hub_command():
    out = launch("--model", "no-such-org/no-such-model", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "`hf download no-such-org/no-such-model`" in out.stderr


def test_overlap_flags_that_contradict_each_other_are_refused():
    out = launch("--enable-overlap-schedule", "--disable-overlap-schedule")
    assert out.returncode == 2
    assert "contradict" in out.stderr


def test_ctrl_c_while_the_hub_is_asked_stops_the_start(tmp_path: Path):
    """A Hub id that the local HF cache holds, and a Hub that never answers: a Ctrl-C while the
    launcher waits on it ends the start. (huggingface_hub's own `except Exception`, which retries
    from the cache, once took it and started the server from the cache.)"""
    from radixserve.model_worker.model_source import default_model_dir

    repo = tmp_path / "hub" / "models--radixserve-test--tiny"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for item in default_model_dir().iterdir():
        (snapshot / item.name).symlink_to(item)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    with socket.socket() as hub, tempfile.NamedTemporaryFile(suffix=".log") as log:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.settimeout(60)
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        env |= {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_ETAG_TIMEOUT": "120"}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{hub.getsockname()[1]}"
        argv = ["--model", "radixserve-test/tiny", "--port", str(free_port()), "--http-port", "0"]
        proc = subprocess.Popen(
            [sys.executable, "launch.py", *argv], cwd=REPO_ROOT, env=env, stdout=log, stderr=log
        )
        try:
            asked, _ = hub.accept()  # the launcher waits on the Hub's answer now
            with asked:
                proc.send_signal(signal.SIGINT)
                code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = Path(log.name).read_text()
    assert code == 0 and "SIGINT received" in text, text
    assert "is ready" not in text and "Traceback" not in text, text


def test_a_ready_child_that_dies_while_the_scheduler_starts_stops_the_start(tmp_path: Path):
    """The detokenizer killed (the OOM killer, say) while the scheduler still builds its kernels:
    the launcher says so and exits then, not once the scheduler is ready minutes later."""
    env = {**os.environ, "RADIXSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}  # a first build
    argv = ["--port", str(free_port()), "--http-port", "0", "--kernels", "cpu_extension"]
    log_path = tmp_path / "launch.log"
    with log_path.open("w") as log:
        # Its own group: the compilers its scheduler starts can be stopped with it after.
        proc = subprocess.Popen(
            [sys.executable, "launch.py", *argv],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "building the CPU kernels" not in (text := log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.1)
        while "detokenizer is ready (pid " not in (text := log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.1)
        pid = int(text.split("detokenizer is ready (pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(30) == 1
        left = [p for p in Path("/proc").glob("[0-9]*") if _runs_in(p, tmp_path)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left: spare the machine
        proc.wait()
    text = log_path.read_text()
    assert "detokenizer was killed by SIGKILL" in text and "while the others started" in text
    assert "ready on" not in text, text
    assert not left, "the scheduler's kernel compilers outlived the server"


def _runs_in(proc: Path, directory: Path) -> bool:
    """Whether a /proc entry's command line names `directory` (a compiler of a build there)."""
    with contextlib.suppress(OSError):
        return str(directory) in (proc / "cmdline").read_bytes().decode(errors="replace")
    return False


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


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """parse_server_args's error for these flags: one line, exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        parse_server_args(list(argv))
    assert exit_.value.code == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("radixserve: error: "), err
    return err


def test_every_number_is_checked_before_anything_starts(capsys: pytest.CaptureFixture[str]):
    wrong = {
        ("--page-size", "0"): "--page-size must be at least 1, not 0",
        ("--max-prefill-tokens", "0"): "--max-prefill-tokens must be at least 1",
        ("--chunked-prefill-size", "0"): "-1 (no chunking) or at least 1",
        ("--mem-fraction-static", "1.5"): "--mem-fraction-static must be at most 1.0",
        ("--watchdog-timeout", "nan"): "--watchdog-timeout must be a finite number",
        ("--port", "70000"): "--port must be at most 65535",
        ("--port", "30000", "--http-port", "30000"): "are both 30000",
        ("--max-queued-requests", "0"): "--max-queued-requests must be at least 1",
        ("--dp-size", "0"): "--dp-size must be at least 1",
        ("--api-key", ""): "--api-key must have 1 to",
        ("--served-model-name", " "): "--served-model-name must not be empty",
        ("--max-pending-requests", "-5"): "--max-pending-requests must be at least 1",
        ("--max-pending-bytes-per-client", "-1"): "--max-pending-bytes-per-client must be at",
        ("--cache-threshold", "nan"): "--cache-threshold must be a finite number",
        ("--balance-rel-threshold", "0.5"): "--balance-rel-threshold must be at least 1.0",
    }
    for argv, message in wrong.items():
        assert message in refusal(capsys, *argv), argv


def test_a_renamed_flag_names_its_new_spelling(capsys: pytest.CaptureFixture[str]):
    for argv in (["--attention-backend", "cpu_attn"], ["--attention-backend=torch_native"]):
        assert "--attention-backend is now --kernels" in refusal(capsys, *argv)
    assert "--attention-backend is now" in refusal(capsys, "--attention", "cpu_attn")  # abbreviated
    assert "--attention-backend" not in build_parser().format_help()
    assert parse_server_args(["--kernels", "torch_native"]).kernels == "torch_native"


def test_flags_that_do_not_fit_the_model_or_machine_are_one_line_and_exit_2():
    """The default model has 9 heads: --tp-size 2 was three tracebacks (two children and the
    launcher's EOFError)."""
    out = launch("--tp-size", "2")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "radixserve: error: --tp-size 2 does not divide the model's 9 attention heads "
        "(--help lists the flags)"
    ]
    out = launch("--dp-size", str(len(os.sched_getaffinity(0)) + 1), "--device", "cpu")
    assert out.returncode == 2 and "model processes on this node, which has" in out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = launch("--http-port", str(port))
    assert out.returncode == 2 and f"--http-port {port} on --host 127.0.0.1: in use" in out.stderr


def test_a_context_past_the_models_a_config_it_cannot_read_a_host_or_device_it_cannot_use(
    tmp_path: Path,
):
    """One line and exit 2 before any process starts, as SGLang and vLLM refuse them (a context
    past the model's positions gives garbage; an address not of this machine was "in use")."""
    from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path

    config = json.loads((Path(resolve_model_path(DEFAULT_MODEL)) / "config.json").read_text())
    longest = config["max_position_embeddings"]
    out = launch("--context-length", str(longest + 1))
    assert out.returncode == 2 and f"past the model's context ({longest}," in out.stderr
    assert "RADIXSERVE_ALLOW_LONG_CONTEXT=1" in out.stderr and out.stderr.count("\n") == 1
    (tmp_path / "config.json").write_text("{not json")
    out = launch("--model", str(tmp_path))
    assert out.returncode == 2 and "config.json cannot be read" in out.stderr
    out = launch("--host", "192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert out.returncode == 2 and "Cannot assign requested address" in out.stderr
    assert "in use" not in out.stderr
    out = launch("--device", "gpu")
    assert out.returncode == 2 and "--device must be auto, cpu, cuda or cuda:N" in out.stderr
    # Node 0 hosts each TP group's store at --dist-init-addr's port, on every address: one in
    # use on any of them (here on another address than the host's) failed after loading.
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dist = ("--dist-init-addr", f"127.0.0.1:{port - 1}", "--dp-size", "2", "--tp-size", "3")
        out = launch(*dist, "--nnodes", "3")
    assert out.returncode == 2 and f"store on port {port}: in use" in out.stderr


def test_the_spellings_of_sglang_and_vllm_are_the_same_flags(capsys: pytest.CaptureFixture[str]):
    spelled = parse_server_args(
        ["--model-path", "m", "--max-model-len", "100", "--tensor-parallel-size", "1"]
        + ["--data-parallel-size", "1", "--seed", "7"]
    )
    assert (spelled.model, spelled.context_length, spelled.random_seed) == ("m", 100, 7)
    assert "--torch-threads is now --num-threads" in refusal(capsys, "--torch-threads", "2")
    # Values in SGLang's and vLLM's spellings.
    assert parse_server_args(["--dtype", "half"]).dtype == "float16"
    assert parse_server_args(["--dtype", "float"]).dtype == "float32"
    assert parse_server_args(["--log-level", "WARNING"]).log_level == "warning"
    assert parse_server_args(["--log-level", "critical"]).log_level == "critical"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--gpu-memory-utilization", "0.8"], "is vLLM's: use --mem-fraction-static"),
        (["--trust-remote-code"], "never a model's remote code"),
        (["--tokenizer", "t"], "the tokenizer is --model's own"),
        (["--chat-template", "t.jinja"], "the chat template is --model's own"),
        (["--enable-metrics"], "/metrics is always served"),
        (["--disable-log-requests"], "logged only with --log-requests"),
    ],
)
def test_flags_of_other_servers_say_what_to_use(capsys, argv, says):
    """They were argparse's "unrecognized arguments", which names nothing to use instead."""
    assert says in refusal(capsys, *argv)


def test_threads_follow_the_cpu_affinity():
    """Under taskset or a container's cpuset, os.cpu_count() still counts the host's cores."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from radixserve.server_args import parse_server_args; "
        "print(parse_server_args([]).threads_per_model_process)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_the_api_key_comes_from_the_environment_too():
    os.environ["RADIXSERVE_API_KEY"] = "from-env"
    try:
        assert parse_server_args([]).api_key == "from-env"
        assert parse_server_args(["--api-key", "flag"]).api_key == "flag"
    finally:
        del os.environ["RADIXSERVE_API_KEY"]
    assert "RADIXSERVE_API_KEY" in build_parser().format_help()


def start_and_fail(*argv: str, kill_scheduler: bool = False) -> tuple[int, str]:
    """launch.py with these flags, which fail while it starts: its exit code and log."""
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="radixserve-test-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.launch", "--port", str(port), "--http-port", "0"]
            + list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        server = LaunchedServer(proc, f"tcp://127.0.0.1:{port}", Path(log.name))
        try:
            if kill_scheduler:
                deadline = time.monotonic() + 120
                while not server.server_processes():
                    assert proc.poll() is None and time.monotonic() < deadline, server.log()
                    time.sleep(0.02)
                os.kill(server.server_processes()[0], signal.SIGKILL)  # the first: the scheduler
            code = proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return code, server.log()


def test_a_child_that_fails_while_starting_is_one_line_naming_it_and_why():
    code, log = start_and_fail("--kernels", "cpu_extension", "--dtype", "float16")
    assert code == 1
    assert "Traceback" not in log and "EOFError" not in log, log
    (line,) = [line for line in log.splitlines() if "failed while starting" in line]
    assert "scheduler failed while starting: ValueError: --kernels cpu_extension" in line


def test_a_failure_whose_message_has_several_lines_is_still_one_line(tiny_served_model, tmp_path):
    """No tokenizer files: transformers' own error, five lines long, is the manager's reason."""
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(tiny_served_model / name)
    code, log = start_and_fail("--model", str(tmp_path))
    assert code == 1
    (line,) = [line for line in log.splitlines() if "failed while starting" in line]
    assert "tokenizer_manager failed while starting:" in line
    lines = log.splitlines()
    after = lines[lines.index(line) + 1 :]
    assert not after or after[0].startswith("["), log  # the next is a process's own log line


def test_a_child_killed_while_starting_is_named_with_its_signal():
    code, log = start_and_fail(kill_scheduler=True)
    assert code == 1
    assert "Traceback" not in log, log
    assert "scheduler failed while starting: was killed by SIGKILL (by the OOM killer" in log


ORPHAN = """
import multiprocessing as mp, os, sys, time
from pathlib import Path

def child(out):
    time.sleep(1.5)  # the parent is gone by now: no PDEATHSIG can ever come
    Path(out, "started").touch()
    from radixserve.process_setup import _die_with_parent
    _die_with_parent()
    Path(out, "survived").touch()

if __name__ == "__main__":
    mp.get_context("spawn").Process(target=child, args=(sys.argv[1],)).start()
    os._exit(0)
"""


def test_a_child_whose_parent_died_before_pdeathsig_was_set_exits(tmp_path: Path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    assert (tmp_path / "started").exists() and not (tmp_path / "survived").exists()
