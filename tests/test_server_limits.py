"""Who may use the server, and how much: --api-key, --max-queued-requests, the public-bind warning,
and no pickle anywhere (--max-request-bytes: test_tokenizer_manager.py). Each on the process that
enforces it, over its real sockets, with the tiny model (tm_harness.py plays the scheduler for the
tokenizer manager)."""

from __future__ import annotations

import ast
import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from tm_harness import Harness, receive, send, tokenizer_manager

from radixserve.client.local_server import REPO_ROOT
from radixserve.launch import (
    _warn_if_oversubscribed,
    _warn_if_reachable,
    _warn_if_store_elsewhere,
)
from radixserve.launch import main as launch_main
from radixserve.process_setup import Heartbeat
from radixserve.protocol import transport
from radixserve.protocol.internal import (
    HealthReq,
    ReqError,
    TokenizedGenerateReq,
    TokenizerManagerInput,
)
from radixserve.protocol.wire import MAX_API_KEY_CHARS, SamplingParams
from radixserve.scheduler.process import SchedulerProcess
from radixserve.server_args import ServerArgs, usable_cores
from radixserve.tokenizer_manager.request_decoder import (
    MAX_ERROR_CHARS,
    ClientError,
    RequestDecoder,
)

KEY = "s3cret-key"
GENERATE = {"type": "generate", "rid": "k", "text": "Hi", "sampling_params": {"max_new_tokens": 2}}
UNAUTHORIZED = [
    GENERATE,
    {**GENERATE, "api_key": "wrong"},
    {**GENERATE, "api_key": KEY[:-1]},
    {**GENERATE, "api_key": KEY + "x"},
    {**GENERATE, "api_key": "é" * 10},
    {**GENERATE, "api_key": "x" * 10_000},
    {**GENERATE, "api_key": 5},
    {**GENERATE, "api_key": KEY.upper()},
    {**GENERATE, "stream": "not a bool"},  # invalid too: still only "unauthorized"
    {"type": "abort", "rid": "k"},
    {"type": "server_info", "api_key": None},
    {"type": "flush_cache", "api_key": "wrong"},
    {"type": "model_info"},
]


def test_without_the_key_nothing_reaches_the_scheduler(tiny_served_model):
    async def scenario(h: Harness) -> None:
        client = h.client()
        for request in UNAUTHORIZED:
            await send(client, **request)
            reply = await receive(client)
            assert reply["type"] == "error" and reply["code"] == "unauthorized", request
        assert not await h.scheduler.poll(100)  # nothing ran, nothing was queued
        await send(client, **GENERATE, api_key=KEY)
        assert isinstance(await h.to_scheduler(), TokenizedGenerateReq)
        await send(client, type="health")  # liveness probes carry no secret (as SGLang)
        assert isinstance(await h.to_scheduler(), HealthReq)

    asyncio.run(_with_manager(tiny_served_model, scenario, api_key=KEY))


async def _with_manager(model_dir: Path, scenario: Any, **overrides: Any) -> None:
    async with tokenizer_manager(model_dir, **overrides) as h:
        await scenario(h)


def test_past_max_queued_requests_a_request_is_overloaded(tiny_served_model):
    ipc_dir = tempfile.mkdtemp(prefix="rs-queue-")
    ctx = zmq.Context()
    try:
        replies = transport.bind_pull(ctx, ipc_dir, transport.TOKENIZER_MANAGER_INPUT)
        model = str(tiny_served_model)
        args = ServerArgs(model=model, max_total_tokens=4096, max_queued_requests=2)
        heartbeat = Heartbeat(multiprocessing.get_context("spawn"))
        process = SchedulerProcess(args, model, ipc_dir, heartbeat)
        params = SamplingParams(max_new_tokens=4)
        for cid in ("a", "b", "c"):  # no step between them: all three wait
            process.process_input_request(TokenizedGenerateReq(cid, [1, 2, 3], params, False))
        assert [r.rid for r in process.scheduler.waiting] == ["a", "b"]
        assert replies.poll(10_000)
        refusal = msgspec.msgpack.decode(replies.recv(), type=TokenizerManagerInput)
        assert isinstance(refusal, ReqError) and (refusal.rid, refusal.code) == ("c", "overloaded")
        # Received, refused or not: the count the DP controller subtracts from what it sent.
        assert process.scheduler.stats.num_requests == 3
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


@pytest.mark.parametrize(
    "host, warns", [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True)]
)
def test_a_public_bind_is_warned_about(caplog, host, warns):
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        _warn_if_reachable(ServerArgs(host=host))
    assert ("any machine that reaches it" in caplog.text) == warns


@pytest.mark.parametrize("threads, warns", [(None, False), (1, False), (usable_cores() + 1, True)])
def test_more_threads_than_cores_are_warned_about(caplog, threads, warns):
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        _warn_if_oversubscribed(ServerArgs(device="cpu", num_threads=threads))
    assert ("more threads than this node's" in caplog.text) == warns


@pytest.mark.parametrize(
    "addr, tp, warns",
    [
        ("127.0.0.1:29500", 2, False),
        ("198.51.100.7:29500", 2, True),
        ("198.51.100.7:29500", 1, False),
    ],
)
def test_a_store_address_not_of_this_machine_is_warned_about(caplog, addr, tp, warns):
    """Node 0's TP ranks meet at --dist-init-addr's host: one not of this machine works only
    through a NAT (TEST-NET-2 here: of no machine); with one rank a replica there is no store."""
    args = ServerArgs(dist_init_addr=addr, tp_size=tp, nnodes=2)
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        _warn_if_store_elsewhere(args)
    assert ("is not an address of this machine" in caplog.text) == warns


@pytest.mark.parametrize("key", ["", "k" * (MAX_API_KEY_CHARS + 1)])
def test_an_api_key_that_could_not_work_is_refused_at_start(key):
    """Empty would turn authentication off; longer than a request may carry could never match."""
    with pytest.raises(SystemExit) as exit_:
        launch_main(["--api-key", key])
    assert exit_.value.code == 2


def test_an_error_quotes_a_bounded_part_of_the_request():
    """msgspec's message names the unknown key: a megabyte of key must not come back (or go to
    the request log) whole."""
    payload = msgspec.msgpack.encode({"type": "generate", "rid": "r", "text": "x", "k" * 10**6: 1})
    with pytest.raises(ClientError) as refused:
        RequestDecoder(None).decode(payload)
    assert refused.value.code == "invalid_request" and refused.value.rid == "r"
    assert MAX_ERROR_CHARS < len(refused.value.message) < MAX_ERROR_CHARS + 20


PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
PICKLE_CALLS = {"recv_pyobj", "send_pyobj"}


def test_no_pickle_anywhere():
    """Nothing the server reads is unpickled: no pickle module, no pyobj sockets, no torch.load
    (weights are safetensors). multiprocessing's own spawn bootstrap is the one pickle left."""
    found = []
    sources = [
        p
        for p in REPO_ROOT.rglob("*.py")
        if not {".venv", "build", "tests"} & set(p.relative_to(REPO_ROOT).parts)
    ]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if PICKLE_MODULES & set(names):
                found.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and (
                node.attr in PICKLE_CALLS or _is_torch_load(node)  # torch.load unpickles too
            ):
                found.append(f"{path}:{node.lineno} calls .{node.attr}")
    assert found == []
    assert len(sources) > 40  # the walk really saw the sources


def _is_torch_load(node: ast.Attribute) -> bool:
    return node.attr == "load" and isinstance(node.value, ast.Name) and node.value.id == "torch"
