"""Flood: many large generates from many clients at once (issue 22, acceptance 3).

    python benchmarks/flood.py [--requests 2000 --clients 20 --request-bytes 1000000]
                               [--rss-bound-mb 1024] [-- SERVER FLAGS...]

Starts a server, then every client (a raw ZMQ DEALER) sends its share of generates of
`--request-bytes` each, all at once, while /health is polled over HTTP. Checks, and prints:
every request had exactly one reply (served, `overloaded`, or refused for its size: a prompt of
a megabyte is longer than any context served here, so the served kind is `too_long`); the
server's memory (the tokenizer manager's RSS, and all its processes') stayed under the bound;
every /health answered within its timeout. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import zmq
import zmq.asyncio

from radixserve.client.local_server import LaunchedServer, launched_server

HEALTH_TIMEOUT_S = 10.0  # the server's own answers within 5 s, or says 503
HEALTH_INTERVAL_S = 0.25
RSS_INTERVAL_S = 0.05
EXTRA_REPLY_WAIT_S = 1.0  # after the last expected reply: a second reply would come by then


@dataclass
class FloodResult:
    replies: Counter[str] = field(default_factory=Counter)  # by kind: output, or error code
    duplicates: int = 0  # replies past the first for one rid
    unanswered: int = 0
    baseline_rss_mb: float = 0.0  # the tokenizer manager's, before the flood
    peak_rss_mb: float = 0.0
    peak_total_rss_mb: float = 0.0  # all server processes together
    health_codes: Counter[int] = field(default_factory=Counter)
    health_failures: int = 0  # no answer within HEALTH_TIMEOUT_S
    slowest_health_s: float = 0.0
    seconds: float = 0.0

    def table(self) -> str:
        rows = [
            ("replies by kind", dict(self.replies)),
            ("rids answered twice / never", f"{self.duplicates} / {self.unanswered}"),
            (
                "tokenizer manager RSS before / peak (MB)",
                f"{self.baseline_rss_mb:.0f} / {self.peak_rss_mb:.0f}",
            ),
            ("all server processes, peak RSS (MB)", f"{self.peak_total_rss_mb:.0f}"),
            ("/health statuses", dict(self.health_codes)),
            (f"/health without an answer in {HEALTH_TIMEOUT_S:g}s", self.health_failures),
            ("slowest /health (s)", f"{self.slowest_health_s:.2f}"),
            ("flood took (s)", f"{self.seconds:.1f}"),
        ]
        return "\n".join(f"{name:<45} {value}" for name, value in rows)


def server_pids(server: LaunchedServer) -> dict[str, int]:
    ready = re.findall(r"(\w+) is ready \(pid (\d+)\)", server.log())
    return {name: int(pid) for name, pid in ready}


def rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


async def flood(
    server: LaunchedServer, requests: int, clients: int, request_bytes: int
) -> FloodResult:
    result = FloodResult()
    deadline = time.monotonic() + 60  # launch.py logs the last child ready just after serving
    while "radixserve ready" not in server.log() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    pids = server_pids(server)
    manager = pids["tokenizer_manager"]
    result.baseline_rss_mb = rss_mb(manager)
    done = asyncio.Event()
    watchers = [
        asyncio.create_task(_watch_rss(result, manager, list(pids.values()), done)),
        asyncio.create_task(_watch_health(result, server.http_url, done)),
    ]
    ctx = zmq.asyncio.Context()
    text = "word " * (request_bytes // 5)
    start = time.monotonic()
    try:
        shares = [requests // clients + (i < requests % clients) for i in range(clients)]
        await asyncio.gather(
            *(_client(ctx, server.address, i, n, text, result) for i, n in enumerate(shares))
        )
    finally:
        result.seconds = time.monotonic() - start
        done.set()
        await asyncio.gather(*watchers)
        ctx.destroy(linger=0)
    return result


async def _client(
    ctx: zmq.asyncio.Context, address: str, number: int, count: int, text: str, result: FloodResult
) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # the client holds a few frames; the rest wait to be built
    sock.connect(address)
    encoder = msgspec.msgpack.Encoder()
    seen: Counter[str] = Counter()

    async def send_all() -> None:
        for i in range(count):
            request = {
                "type": "generate",
                "rid": f"c{number}-{i}",
                "text": text,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            }
            await sock.send(encoder.encode(request))

    sending = asyncio.create_task(send_all())
    try:
        while len(seen) < count:
            if not await sock.poll(600_000):
                break
            _count_reply(msgspec.msgpack.decode(await sock.recv()), seen, result)
        while await sock.poll(int(EXTRA_REPLY_WAIT_S * 1000)):  # a second reply to any rid?
            _count_reply(msgspec.msgpack.decode(await sock.recv()), seen, result)
        await sending
    finally:
        sending.cancel()
        sock.close()
    result.duplicates += sum(n - 1 for n in seen.values())
    result.unanswered += count - len(seen)


def _count_reply(reply: dict, seen: Counter[str], result: FloodResult) -> None:
    seen[reply.get("rid") or "?"] += 1
    result.replies[reply["code"] if reply["type"] == "error" else reply["type"]] += 1


async def _watch_rss(
    result: FloodResult, manager: int, pids: list[int], done: asyncio.Event
) -> None:
    while not done.is_set():
        result.peak_rss_mb = max(result.peak_rss_mb, rss_mb(manager))
        result.peak_total_rss_mb = max(result.peak_total_rss_mb, sum(map(rss_mb, pids)))
        await asyncio.sleep(RSS_INTERVAL_S)


async def _watch_health(result: FloodResult, url: str, done: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as http:
        while not done.is_set():
            asked = time.monotonic()
            try:
                status = (await http.get(f"{url}/health")).status_code
                result.health_codes[status] += 1
            except httpx.TimeoutException:
                result.health_failures += 1
            result.slowest_health_s = max(result.slowest_health_s, time.monotonic() - asked)
            await asyncio.sleep(HEALTH_INTERVAL_S)


def failures(result: FloodResult, requests: int, rss_bound_mb: float) -> list[str]:
    """What the flood found wrong: the acceptance's checks."""
    found = []
    if result.duplicates or result.unanswered:
        found.append(f"{result.duplicates} rids answered twice, {result.unanswered} never")
    if sum(result.replies.values()) != requests + result.duplicates:
        found.append(f"replies {dict(result.replies)} for {requests} requests")
    unexpected = set(result.replies) - {"output", "overloaded", "too_long"}
    if unexpected:
        found.append(f"replies of kinds {unexpected}")
    if result.peak_rss_mb - result.baseline_rss_mb > rss_bound_mb:
        found.append(
            f"the tokenizer manager grew {result.peak_rss_mb - result.baseline_rss_mb:.0f} MB, "
            f"past the {rss_bound_mb:g} MB bound"
        )
    if result.health_failures or not result.health_codes:
        found.append(f"{result.health_failures} health checks without an answer")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--request-bytes", type=int, default=1_000_000)
    parser.add_argument(
        "--rss-bound-mb",
        type=float,
        default=1024,
        help="how much the tokenizer manager's RSS may grow (the default caps let 256 MiB of "
        "requests wait, and libzmq holds 8 frames per client)",
    )
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args()
    with launched_server(*args.server_flags) as server:
        result = asyncio.run(flood(server, args.requests, args.clients, args.request_bytes))
    print(result.table())
    found = failures(result, args.requests, args.rss_bound_mb)
    for failure in found:
        print("FAILED:", failure)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
