"""No request can hurt the server (issue 13), end to end on a tiny random model served for real.

A fuzzer throws thousands of malformed and extreme frames while good clients stream; a load of
1,000 requests from 50 clients aborts some at random moments and drops others mid-stream. Every
other request must get exactly one final reply with the right tokens, and the KV pool must come
back whole. Raw DEALER sockets speak the wire format here, so that every reply is counted.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import ipc_dir, wait_gone
from malformed_frames import GOOD_RIDS, message
from wire_clients import Replies, WireClient, finals, generate, output_ids

from radixserve.client import Client
from radixserve.client.local_server import launched_server

MAX_NEW = 8
PROMPTS = [f"Request {i}: tell me about the number {i * 7}." for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_served_model):
    with launched_server(
        "--model",
        str(tiny_served_model),
        "--max-total-tokens",
        "16384",
        "--num-threads",
        "1",  # two OpenMP threads on two shared cores wait on each other at every op
        "--shutdown-timeout",
        "1",
        "--check-invariants",
        "--log-requests",
        # The good clients' tokens, batched with the fuzz, must equal those computed alone, as
        # they do on the CPU at this model's shapes; CUDA's kernels are chosen by shape
        # (2026-11-27, an H100: 36 of 90 differed; its server's RSS also grew 71 MB between
        # the load's rounds, not looked into). What is tested here is the wire and the
        # scheduler, not the device.
        "--device",
        "cpu",
    ) as s:
        yield s


def reference_tokens(address: str) -> list[list[int]]:
    with Client(address, timeout=60) as c:
        params = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
        return [c.generate(p, sampling_params=params).output_ids for p in PROMPTS]


def assert_pool_whole(address: str, timeout: float = 60) -> None:
    """Once what still runs has finished, every KV slot is free or held by the prefix cache."""
    with Client(address, timeout=60) as c:
        deadline = time.monotonic() + timeout
        while (info := c.server_info()).running_requests or info.waiting_requests:
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
    assert info.kv_tokens_used == 0


# ---- fuzz ------------------------------------------------------------------------------------


class GoodClients:
    """8 clients streaming greedy requests, in a thread, until stopped; each checks its tokens."""

    def __init__(self, address: str, expected: list[list[int]]):
        self.address, self.expected = address, expected
        self.completed, self.wrong = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._run(),))

    async def _run(self) -> None:
        ctx = zmq.asyncio.Context()
        clients = [WireClient(ctx, self.address) for _ in GOOD_RIDS]
        await asyncio.gather(*(self._client(c, i) for i, c in enumerate(clients)))
        for c in clients:
            await c.close()
        ctx.term()

    async def _client(self, client: WireClient, i: int) -> None:
        rid = GOOD_RIDS[i]
        while not self.stop.is_set():
            client.replies = Replies()
            await client.send(**generate(rid, PROMPTS[i], MAX_NEW, stream=True))
            await asyncio.wait_for(client.replies.finals[rid].wait(), 60)
            got = client.replies.by_rid[rid]
            if output_ids(got) != self.expected[i] or len(finals(got)) != 1:
                self.wrong.append(got)
            self.completed += 1


def test_fuzzed_frames_hurt_no_one(server):
    expected = reference_tokens(server.address)
    good = GoodClients(server.address, expected)
    ctx = zmq.Context()
    fuzzer = ctx.socket(zmq.DEALER)
    fuzzer.setsockopt(zmq.LINGER, 0)
    fuzzer.connect(server.address)
    sent = [0]

    @settings(
        max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.lists(message, min_size=1, max_size=10))
    def fuzz(messages: list[list[bytes]]) -> None:
        for frames in messages:
            fuzzer.send_multipart(frames)
        sent[0] += len(messages)
        while fuzzer.poll(0):
            fuzzer.recv_multipart()

    good.thread.start()
    try:
        fuzz()
    finally:
        good.stop.set()
        good.thread.join(120)
        fuzzer.close()
        ctx.term()
    print(
        f"\nfuzz: {sent[0]} malformed or extreme requests, {good.completed} good requests "
        f"streamed meanwhile, {len(good.wrong)} wrong or lost"
    )
    assert sent[0] >= 1000 and good.completed >= 8
    assert good.wrong == []
    with Client(server.address, timeout=60) as c:
        assert c.health().status == "ok"
    assert_pool_whole(server.address)


# ---- load ------------------------------------------------------------------------------------


@dataclass
class Planned:
    rid: str
    max_new: int
    stream: bool
    fate: str  # "normal", "abort" (at a random moment) or "disconnect" (mid-stream)
    after: int  # replies to wait for before the abort or the disconnect


def plan(rng: random.Random, round_: int, n: int) -> list[list[Planned]]:
    per_client: list[list[Planned]] = [[] for _ in range(50)]
    for i in range(n):
        fate = rng.choices(["normal", "abort", "disconnect"], [85, 10, 5])[0]
        max_new = rng.randint(1, 16)
        stream = fate == "disconnect" or rng.random() < 0.7
        after = rng.randint(0, max_new - 1) if stream else 0
        per_client[i % 50].append(Planned(f"r{round_}-{i}", max_new, stream, fate, after))
    return per_client


async def run_client(
    ctx: zmq.asyncio.Context, address: str, planned: list[Planned], results: dict[str, list[dict]]
) -> None:
    client = WireClient(ctx, address)
    for p in planned:
        await client.send(**generate(p.rid, f"prompt {p.rid} " * 3, p.max_new, p.stream))
        if p.fate != "normal":
            await client.chunks(p.rid, p.after)
        if p.fate == "disconnect":
            await client.close()  # its request is in flight: the server must notice
            client = WireClient(ctx, address)
            continue
        if p.fate == "abort":
            await client.send(type="abort", rid=p.rid)
        await asyncio.wait_for(client.replies.finals[p.rid].wait(), 120)
        results[p.rid] = client.replies.by_rid[p.rid]  # still filled: later replies count too
    # Anything sent after a final would arrive before this round trip's answer.
    await client.send(type="health")
    await asyncio.wait_for(client.replies.finals[None].wait(), 60)
    await asyncio.sleep(0.2)
    await client.close()


def server_rss_mb(server) -> float:
    pids = [server.proc.pid, *server.server_processes()]
    pages = sum(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) for pid in pids)
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_round(server, round_: int, n: int = 1000) -> dict[str, int]:
    planned = plan(random.Random(round_), round_, n)
    results: dict[str, list[dict]] = {}

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        await asyncio.gather(*(run_client(ctx, server.address, p, results) for p in planned))
        ctx.term()

    asyncio.run(run())
    counts = {"sent": n, "aborted": 0, "disconnected": 0, "lost": 0}
    for p in (p for client in planned for p in client):
        if p.fate == "disconnect":
            counts["disconnected"] += 1
            continue
        got = results[p.rid]
        if p.fate == "abort":
            counts["aborted"] += 1
            # One final: aborted, or finished first (the abort then finds nothing: not_found).
            assert len(finals(got)) == 1, (p, got)
            errors = [r for r in got if r["type"] == "error"]
            assert all(e["code"] == "not_found" for e in errors), (p, got)
            continue
        final = finals(got)
        ok = (
            len(final) == 1
            and got[-1] is final[0]
            and len(output_ids(got)) == p.max_new
            and final[0]["meta_info"]["completion_tokens"] == p.max_new
            and final[0]["meta_info"]["finish_reason"]["type"] == "length"
        )
        counts["lost"] += not ok
        assert ok, (p, got)
    return counts


def test_a_thousand_requests_with_aborts_and_disconnects(server):
    first = load_round(server, 1)
    assert_pool_whole(server.address)
    rss_after_first = server_rss_mb(server)
    second = load_round(server, 2)
    assert_pool_whole(server.address)
    growth = server_rss_mb(server) - rss_after_first
    for name, counts in (("first", first), ("second", second)):
        print(
            f"\nload, {name} round: {counts['sent']} requests from 50 clients, "
            f"{counts['aborted']} aborted, {counts['disconnected']} disconnected mid-stream, "
            f"{counts['lost']} lost"
        )
    print(f"server RSS growth between the rounds: {growth:.1f} MB")
    assert growth < 50


def test_every_request_is_logged(server):
    """--log-requests: one line per finished, aborted or failed request."""
    with Client(server.address, timeout=60) as c:
        c.generate("Hi", rid="logged-done", sampling_params={"max_new_tokens": 3})
        stream = c.stream("Hi", rid="logged-abort", sampling_params={"max_new_tokens": 500})
        next(stream)
        stream.close()  # aborts it
    # An OpenAI request's line names the id its client was given (each was rid '0' before).
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = httpx.post(f"{server.http_url}/v1/chat/completions", json=chat, timeout=60)
    response_id = reply.json()["id"]
    raw = {"type": "generate", "rid": "logged-bad", "text": "Hi", "stream": 7}
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(server.address)
        sock.send(msgspec.msgpack.encode(raw))
        assert sock.poll(30_000)
    deadline = time.monotonic() + 30
    while "rid='logged-abort'" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = server.log().splitlines()

    def line(rid: str) -> str:
        return next(x for x in lines if f"rid='{rid}'" in x)

    done = line("logged-done")
    assert "Finish:" in done and "completion_tokens=3" in done and "finish_reason=length" in done
    assert "prompt_tokens=" in done and "e2e_latency=" in done
    assert "finish_reason=abort" in line("logged-abort")
    bad = line("logged-bad")
    assert "Fail:" in bad and "code=invalid_request" in bad and "stream" in bad
    assert "Finish:" in line(f"{response_id}-0")
    # Refused by the HTTP front itself (a body that does not decode, a model not served): a
    # Fail line each too. A health probe is no client's request: no line.
    finishes = server.log().count("Finish:")
    url = server.http_url
    negative = {"text": "Hi", "sampling_params": {"max_new_tokens": -7}}
    assert httpx.post(f"{url}/generate", json=negative, timeout=60).status_code == 400
    unknown = {"model": "no-such-model", "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=unknown, timeout=60).status_code == 404
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while "no-such-model" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    fails = [x for x in server.log().splitlines() if "Fail: rid=None" in x]
    assert any("code=invalid_request" in x and "max_new_tokens" in x for x in fails), fails
    assert any("no-such-model" in x for x in fails), fails
    assert server.log().count("Finish:") == finishes


# ---- shutdown (last: it stops this module's server) ------------------------------------------


def test_sigterm_under_load_answers_every_request_and_exits_0(server):
    """SIGTERM: new requests are refused, those in flight finish within --shutdown-timeout (1 s)
    or are aborted, every one gets its final reply, and the server exits 0, leaving nothing."""
    children, ipc = server.children(), ipc_dir(server)
    lengths = {f"term-{i}": 1000 if i % 2 else 4 for i in range(20)}  # 1000: cannot finish in 1 s

    async def run() -> tuple[dict[str, list[dict]], list[dict]]:
        ctx = zmq.asyncio.Context()
        clients = {rid: WireClient(ctx, server.address) for rid in lengths}
        for rid, client in clients.items():
            await client.send(**generate(rid, f"{rid} under load", lengths[rid], stream=True))
        for rid, client in clients.items():
            await client.chunks(rid, 1)
        server.proc.send_signal(signal.SIGTERM)
        while "Shutting down" not in server.log():
            await asyncio.sleep(0.01)
        late = WireClient(ctx, server.address)
        await late.send(**generate("late", "too late", 4, stream=True))
        await asyncio.wait_for(late.replies.finals["late"].wait(), 30)
        for rid, client in clients.items():
            await asyncio.wait_for(client.replies.finals[rid].wait(), 30)
        await asyncio.sleep(0.2)  # a second final would come now
        replies = {rid: client.replies.by_rid[rid] for rid, client in clients.items()}
        for client in [*clients.values(), late]:
            await client.close()
        ctx.term()
        return replies, late.replies.by_rid["late"]

    replies, late = asyncio.run(run())
    assert server.proc.wait(30) == 0
    assert server.log().splitlines()[-1].endswith("stopped (exit code 0)")
    assert late == [late[0]] and late[0]["code"] == "overloaded"
    reasons = []
    for rid, got in replies.items():
        (final,) = finals(got)
        assert got[-1] is final
        reason = final["meta_info"]["finish_reason"]["type"]
        assert (reason, len(output_ids(got)) == lengths[rid]) in [
            ("length", True),
            ("abort", False),
        ]
        reasons.append(reason)
    print(
        f"\nSIGTERM under load: {reasons.count('length')} requests finished, "
        f"{reasons.count('abort')} aborted, 0 lost"
    )
    assert "abort" in reasons
    assert wait_gone(children) == []
    assert not os.path.exists(ipc)
