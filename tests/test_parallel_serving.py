"""Scale-out end to end, on the CPU with gloo, float32, greedy, a tiny random model served for
real: --tp-size 2, --dp-size 2 and two launchers splitting --tp-size 2 over loopback give the
tokens --tp-size 1 gives; cache-aware routing beats round robin on prefix-cache hits; a dead TP
rank takes the whole server down."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from live_server import child_pids, wait_gone
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.benchmarks.bench_dp_routing import shared_prompt_run
from radixserve.client import AsyncClient, Client, ServerError
from radixserve.client.local_server import (
    LaunchedServer,
    free_port,
    launched_server,
    wait_healthy,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "1, 2, 3,",
    "Translate to German: good morning",
    "The quick brown fox",
    "Water boils at",
    "In 1969, the first",
]
GREEDY_32 = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
FAMILIES = [
    "You are a careful assistant for a bakery. The shop sells bread, cakes and pastries, opens "
    "at seven and closes at six, and takes orders by phone. ",
    "Here is a long story about the sea, the wind and a small boat that sailed from harbour to "
    "harbour looking for a place to rest before the winter storms came. ",
    "def parse(config):\n    # Read every section of the file, check each key against the "
    "schema, and collect the errors so that the user sees all of them at once.\n",
    "Lecture notes, chapter three: the radix tree stores every prompt as a path of tokens, and a "
    "new request reuses the longest path it shares with an earlier one. ",
]


# One thread per model process: the ranks share two cores here. On the CPU on a GPU box too:
# the tokens are checked against transformers' on the CPU, and NCCL needs a GPU per TP rank.
FLAGS = ("--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "8192")
FLAGS += ("--device", "cpu")


def serve(model: Path, *args: str) -> Iterator[LaunchedServer]:
    with launched_server("--model", str(model), *FLAGS, *args) as server:
        yield server


def greedy_tokens(server: LaunchedServer) -> list[list[int]]:
    """The 8 prompts sent at once: batched together, prompts of different lengths."""

    async def run() -> list[list[int]]:
        async with AsyncClient(server.address, timeout=120) as c:
            outs = await asyncio.gather(
                *(c.generate(p, sampling_params=GREEDY_32) for p in PROMPTS)
            )
        return [out.output_ids for out in outs]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def greedy_reference(tiny_served_model) -> list[list[int]]:
    """transformers' own greedy tokens, computed here. --tp-size 1 serves exactly these: the
    replicas of --dp-size 2 are --tp-size 1 schedulers, and that test checks them against these
    (as tests/test_server.py does for the default model); every other run is checked against
    them as well, so all give the tokens of --tp-size 1."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_served_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_served_model, dtype=torch.float32)
    tokens = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            tokens.append(out[0, ids.shape[1] :].tolist())
    return tokens


@pytest.fixture(scope="module")
def tp2_server(tiny_served_model) -> Iterator[LaunchedServer]:
    yield from serve(tiny_served_model, "--tp-size", "2")


def test_tp2_gives_the_greedy_tokens_of_tp1(tp2_server, greedy_reference):
    assert "TP rank 1/2" in tp2_server.log()
    assert greedy_tokens(tp2_server) == greedy_reference


def test_a_killed_tp_rank_takes_the_server_down(tp2_server):
    pids = child_pids(tp2_server)
    assert sorted(pids) == ["detokenizer", "scheduler", "scheduler_tp1", "tokenizer_manager"]
    children = tp2_server.children()
    start = time.monotonic()
    os.kill(pids["scheduler_tp1"], signal.SIGKILL)
    assert tp2_server.proc.wait(10) == 1
    print(f"\nTP rank 1 SIGKILL: server down in {time.monotonic() - start:.1f} s")
    assert "scheduler_tp1 was killed by SIGKILL" in tp2_server.log()
    assert wait_gone(children) == []


def prefix_hit_rate(server: LaunchedServer) -> float:
    """32 requests in 4 prefix families, one after another, family by family: the share of
    their prompt tokens served from the replicas' prefix caches."""
    with Client(server.address, timeout=120) as c:
        assert c.flush_cache().success
        before = c.server_info()
        for family in FAMILIES:
            for i in range(8):
                c.generate(
                    f"{family}Question {i}: what next?",
                    sampling_params=GREEDY_32 | {"max_new_tokens": 1},
                )
        after = c.server_info()
    assert [r.dp_rank for r in after.replicas] == [0, 1]
    assert all(
        r.prompt_tokens > before.replicas[i].prompt_tokens for i, r in enumerate(after.replicas)
    )

    def cached(info):
        return info.cache_hit_rate * info.prompt_tokens

    return (cached(after) - cached(before)) / (after.prompt_tokens - before.prompt_tokens)


def test_dp2_gives_the_greedy_tokens_of_tp1_and_cache_aware_routing_hits_more(
    tiny_served_model, greedy_reference
):
    """And issue 22's acceptance 2: with 64 requests at once sharing a system prompt, cache-aware
    routing keeps both replicas busy (35-65% of the requests each), at a prefix-cache hit rate
    within 10 points of one replica's (benchmarks/bench_dp_routing.py prints the figures)."""
    rates = {}
    shared = {}
    for method in ("round_robin", "cache_aware"):
        for server in serve(tiny_served_model, "--dp-size", "2", "--load-balance-method", method):
            assert greedy_tokens(server) == greedy_reference
            rates[method] = prefix_hit_rate(server)
            if method == "cache_aware":
                shared[method] = shared_prompt_run(server, 64)
    for server in serve(tiny_served_model):
        shared["one replica"] = shared_prompt_run(server, 64)
    print(f"\nprefix-cache hit rate over --dp-size 2: {rates}")
    print("\n".join(figures.row(name) for name, figures in shared.items()))
    assert rates["cache_aware"] > rates["round_robin"]
    assert all(0.35 <= share <= 0.65 for share in shared["cache_aware"].shares)
    assert shared["cache_aware"].hit_rate >= shared["one replica"].hit_rate - 0.10


def test_two_nodes_on_loopback_give_the_greedy_tokens_of_tp1(
    tiny_served_model, greedy_reference, tmp_path
):
    """Node 0 alone cannot load its model (its TP group waits for node 1): until node 1 comes,
    node 0 answers every request at once with `not_ready` (503 over HTTP) rather than hold it."""
    dist = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    flags = ("--model", str(tiny_served_model), *FLAGS)
    node1_log = tmp_path / "node1.log"
    node1 = None
    try:
        with launched_server(*flags, *dist, "--node-rank", "0", wait=False) as s:
            check_not_ready(s)
            with open(node1_log, "wb") as log:
                node1 = subprocess.Popen(
                    [sys.executable, "-m", "radixserve.launch", *flags, *dist, "--node-rank", "1"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            wait_healthy(s, 300)
            assert greedy_tokens(s) == greedy_reference
            assert httpx.get(f"{s.http_url}/health_generate", timeout=60).status_code == 200
            (card,) = httpx.get(f"{s.http_url}/v1/models").json()["data"]
            assert card["root"] == card["id"] and card["max_model_len"] == 1024
        # Node 0 gone, node 1's rank loses its group and its launcher stops.
        assert node1 is not None and node1.wait(20) == 1
    finally:
        if node1 is not None and node1.poll() is None:
            node1.kill()
            node1.wait()
    assert "radixserve node 1 of 2 ready" in node1_log.read_text()


def check_not_ready(server: LaunchedServer) -> None:
    """Every door refuses at once while the model loads: ZMQ generates with `not_ready` and their
    rid, HTTP with 503 and Retry-After (/v1/models too, as vLLM is not listening by then)."""
    with Client(server.address, timeout=30, connect_timeout=1) as c:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the tokenizer manager listens
            try:
                c.health()
            except (ConnectionError, TimeoutError):
                continue
            except ServerError as e:
                assert e.code == "not_ready"
                break
        with pytest.raises(ServerError) as refused:
            c.generate("Hi", rid="early", sampling_params={"max_new_tokens": 2})
        assert (refused.value.code, refused.value.rid) == ("not_ready", "early")
        with pytest.raises(ServerError, match="not_ready"):
            c.health()
    url = server.http_url
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    for response in (
        httpx.get(f"{url}/health"),
        httpx.get(f"{url}/health_generate"),
        httpx.get(f"{url}/v1/models"),
        httpx.post(f"{url}/generate", json=body),
    ):
        assert response.status_code == 503, response.url
        assert response.headers["retry-after"] == "1"
    assert httpx.post(f"{url}/generate", json=body).json()["error"]["code"] == "not_ready"
