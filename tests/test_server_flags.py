"""Every flag of the README's serving table given to a real server (issue 22, acceptance 5),
combined into two starts: one server with --quantization int8, --page-size 16, --schedule-policy
lpm, --chunked-prefill-size -1, --sampling-defaults openai, a forced --kernels,
--api-key and a small --max-request-bytes (401 and 413 over a real socket); and one whose CPU
extension cannot build, where `auto` falls back to torch_native with a warning and serves."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from live_server import child_pids

from radixserve.client import Client, ServerError
from radixserve.client.local_server import LaunchedServer, launched_server

KEY = "flag-test-key"
MAX_BODY = 65_536


@pytest.fixture(scope="module")
def greedy_by_default_model(tiny_served_model: Path, tmp_path_factory) -> Path:
    """The tiny model whose generation_config.json makes requests greedy by default: with
    --sampling-defaults openai they sample at SGLang's temperature 1.0 instead."""
    path = tmp_path_factory.mktemp("greedy-default")
    shutil.copytree(tiny_served_model, path, dirs_exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 1}))
    return path


@pytest.fixture(scope="module")
def server(greedy_by_default_model: Path) -> Iterator[LaunchedServer]:
    flags = {
        "--quantization": "int8",
        "--page-size": "16",
        "--schedule-policy": "lpm",
        "--chunked-prefill-size": "-1",
        "--sampling-defaults": "openai",
        "--kernels": "cpu_extension",
        "--api-key": KEY,
        "--max-request-bytes": str(MAX_BODY),
        "--device": "cpu",  # int8 and cpu_extension are the CPU's, on a GPU box too
    }
    args = [part for flag, value in flags.items() for part in (flag, value)]
    with launched_server("--model", str(greedy_by_default_model), *args, "--check-invariants") as s:
        yield s


def test_the_flags_are_in_force(server):
    log = server.log()
    assert "kernels cpu_extension, quantization int8" in log
    assert "chunked_prefill_size=1024" in log  # -1: the whole context in one step
    assert "Sampling defaults from" not in log  # openai: generation_config.json is not read
    prompt = "The library opens at nine and closes at six, and lends books for three weeks."

    def generate(**params: int) -> dict:
        body = {"text": prompt, "sampling_params": params}
        headers = {"Authorization": f"Bearer {KEY}"}
        reply = httpx.post(f"{server.http_url}/generate", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    first = generate(max_new_tokens=4, temperature=0)
    again = generate(max_new_tokens=4, temperature=0)
    assert again["output_ids"] == first["output_ids"]
    cached = again["meta_info"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0  # --page-size 16: whole pages only
    # Sampled at temperature 1.0 (openai), not greedy (the model's config): seeds differ.
    one, two = (generate(max_new_tokens=16, seed=seed)["output_ids"] for seed in (1, 2))
    assert one != two


def test_401_and_413_over_a_real_socket(server):
    url = server.http_url
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/generate", json=body).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(f"{url}/generate", json=body, headers=wrong).status_code == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/generate", json=body, headers=good).status_code == 200
    big = {**body, "text": "x" * MAX_BODY}
    refused = httpx.post(f"{url}/generate", json=big, headers=good)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_large"
    for text, status in (("Hi", 200), ("x" * MAX_BODY, 413)):  # no Content-Length: chunked
        chunked = iter([json.dumps({**body, "text": text}).encode()])
        as_json = {**good, "Content-Type": "application/json"}
        assert httpx.post(f"{url}/generate", content=chunked, headers=as_json).status_code == status
    with Client(server.address, timeout=60) as c, pytest.raises(ServerError) as e:
        c.generate("Hi", sampling_params={"max_new_tokens": 2})
    assert e.value.code == "unauthorized"


def test_auto_falls_back_to_torch_native_when_the_kernels_cannot_build(
    tiny_served_model, tmp_path, monkeypatch
):
    # A compiler that answers torch's checks but fails every compile, and a cache with nothing
    # built yet.
    compiler = tmp_path / "failing-c++"
    compiler.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -c ] && exit 1; done\nexec c++ "$@"\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    args = ("--dtype", "float32", "--device", "cpu")  # the CPU's kernels, on a GPU box too
    with launched_server("--model", str(tiny_served_model), *args) as s:
        with Client(s.address, timeout=120) as c:
            out = c.generate("Hi there", sampling_params={"max_new_tokens": 3, "temperature": 0})
        log = s.log()
    assert len(out.output_ids) == 3
    assert "CPU kernels unavailable, falling back to torch_native" in log
    assert "kernels torch_native" in log


def test_control_queries_answer_503_in_bounded_time_while_the_scheduler_is_stuck(server):
    """A scheduler that does not answer (here stopped, as in a long CPU prefill): /health
    and the ZMQ health check get `overloaded` after the manager's timeout instead of waiting, and
    /metrics its counters alone; once it runs again they answer."""
    pid = child_pids(server)["scheduler"]
    headers = {"Authorization": f"Bearer {KEY}"}

    def http(path: str) -> httpx.Response:
        return httpx.get(f"{server.http_url}{path}", headers=headers, timeout=60)

    def zmq_health() -> str:
        with Client(server.address, timeout=60) as c, pytest.raises(ServerError) as e:
            c.health()
        return e.value.code

    os.kill(pid, signal.SIGSTOP)
    try:  # the three at once: each waits out the manager's timeout (5 s) on its own
        with ThreadPoolExecutor(3) as pool:
            health, metrics = (pool.submit(http, path) for path in ("/health", "/metrics"))
            zmq = pool.submit(zmq_health)
            reply = health.result()
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "overloaded"
            # /metrics answers with what the tokenizer manager counts, without the gauges
            # that the scheduler did not give in time: a scrape is not "down" in a long step.
            scrape = metrics.result()
            assert scrape.status_code == 200 and "radixserve:num_requests_total" in scrape.text
            assert "radixserve:num_running_reqs" not in scrape.text
            assert zmq.result() == "overloaded"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert httpx.get(f"{server.http_url}/health", timeout=60).status_code == 200
