"""Who may use the server, and how much: --api-key, --max-queued-requests, the public-bind
warning, and no pickle anywhere."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from live_server import child_pids

from radixserve.client.local_server import REPO_ROOT, launched_server
from radixserve.launch import _warn_if_reachable
from radixserve.server_args import ServerArgs

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tiny_served_model):
    with launched_server(
        "--model",
        str(tiny_served_model),
        "--torch-threads",
        "1",
        "--api-key",
        KEY,
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "2",
        "--max-request-bytes",
        str(1 << 20),
    ) as s:
        yield s


class Wire:
    """A raw DEALER: the Python client has no api_key yet."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, **request: Any) -> None:
        self.sock.send(msgspec.msgpack.encode(request))

    def receive(self) -> dict:
        assert self.sock.poll(60_000), "no reply"
        return msgspec.msgpack.decode(self.sock.recv())

    def call(self, **request: Any) -> dict:
        self.send(**request)
        return self.receive()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def wire(server):
    w = Wire(server.address)
    yield w
    w.close()


def steps(wire: Wire) -> int:
    info = wire.call(type="server_info", api_key=KEY)
    assert info["type"] == "server_info"
    return info["num_steps"] + info["waiting_requests"] + info["running_requests"]


GENERATE = {"type": "generate", "rid": "k", "text": "Hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize(
    "request_",
    [
        GENERATE,
        {**GENERATE, "api_key": "wrong"},
        {**GENERATE, "api_key": KEY[:-1]},
        {**GENERATE, "api_key": "é" * 10},
        {**GENERATE, "api_key": "x" * 10_000},
        {**GENERATE, "api_key": 5},
        {**GENERATE, "stream": "not a bool"},  # invalid too: still only "unauthorized"
        {"type": "server_info"},
        {"type": "flush_cache", "api_key": "wrong"},
    ],
    ids=lambda r: ",".join(f"{k}={str(v)[:12]}" for k, v in r.items() if k != "sampling_params"),
)
def test_without_the_key_nothing_runs(wire, request_):
    before = steps(wire)
    reply = wire.call(**request_)
    assert reply["type"] == "error" and reply["code"] == "unauthorized"
    assert steps(wire) == before  # nothing was run or queued


def test_with_the_key_requests_are_served(wire):
    reply = wire.call(**GENERATE, api_key=KEY)
    assert reply["type"] == "output" and reply["finished"] and len(reply["output_ids"]) == 2
    assert wire.call(type="server_info", api_key=KEY)["type"] == "server_info"


def test_health_needs_no_key(wire):
    assert wire.call(type="health")["type"] == "health"  # for liveness probes, as SGLang


def test_past_max_queued_requests_a_request_is_overloaded(server, wire):
    long = {"max_new_tokens": 900, "ignore_eos": True}
    runner = Wire(server.address)  # its stream on its own socket
    try:
        runner.send(
            type="generate", rid="runs", text="Hi", stream=True, sampling_params=long, api_key=KEY
        )
        assert runner.receive()["rid"] == "runs"  # admitted: --max-running-requests is 1
        for rid in ("waits-1", "waits-2"):
            wire.send(type="generate", rid=rid, text="Hi", sampling_params=long, api_key=KEY)
        info = wire.call(type="server_info", api_key=KEY)  # after both, on the same queue
        assert info["waiting_requests"] == 2
        reply = wire.call(type="generate", rid="refused", text="Hi", api_key=KEY)
        assert reply == {**reply, "type": "error", "code": "overloaded", "rid": "refused"}
        for rid in ("waits-1", "waits-2"):
            wire.send(type="abort", rid=rid, api_key=KEY)
        runner.send(type="abort", rid="runs", api_key=KEY)
    finally:
        runner.close()


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def test_a_frame_over_the_size_limit_is_never_held(server):
    """ZMQ's MAXMSGSIZE drops the connection at the frame's header: 64 MiB never reach memory."""
    manager = child_pids(server)["tokenizer_manager"]
    before = peak_rss_mb(manager)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    sock.send(b"\0" * (64 << 20))
    sock.close(linger=30_000)
    ctx.term()  # once the frame is sent, or dropped with the connection
    other = Wire(server.address)
    try:
        assert other.call(type="health")["type"] == "health"  # and the server goes on
    finally:
        other.close()
    assert peak_rss_mb(manager) - before < 16


@pytest.mark.parametrize(
    "host, warns", [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True)]
)
def test_a_public_bind_is_warned_about(caplog, host, warns):
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        _warn_if_reachable(ServerArgs(host=host))
    assert ("any machine that reaches it" in caplog.text) == warns


PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
PICKLE_CALLS = {"recv_pyobj", "send_pyobj", "load"}  # torch.load unpickles too


def test_no_pickle_anywhere():
    """Nothing the server reads is unpickled: no pickle module, no pyobj sockets, no torch.load
    (weights are safetensors). multiprocessing's own spawn bootstrap is the one pickle left."""
    found = []
    for path in REPO_ROOT.rglob("*.py"):
        if {".venv", "build", "tests"} & set(path.relative_to(REPO_ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if PICKLE_MODULES & set(names):
                found.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr in PICKLE_CALLS:
                found.append(f"{path}:{node.lineno} calls .{node.attr}")
    assert found == []
    assert len(list(Path(REPO_ROOT).rglob("*.py"))) > 40  # the walk really saw the sources
