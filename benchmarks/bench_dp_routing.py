"""Data-parallel routing with a shared system prompt (issue 22, acceptance 2).

    python benchmarks/bench_dp_routing.py [--requests 64] [-- SERVER FLAGS...]

Serves one replica, then `--dp-size 2` with each load-balance method, and sends each the same
requests at once: a system prompt shared by all, half of each prompt, then a question of its own.
Prints each replica's share of the requests and the prefix-cache hit rate (the share of prompt
tokens served from cache). Cache-aware routing should keep both replicas busy (35-65% each) with
a hit rate within 10 points of one replica's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass

from radixserve.client import AsyncClient, Client
from radixserve.client.local_server import LaunchedServer, launched_server

SYSTEM_PROMPT = (
    "You are the assistant of a small public library. The library opens at nine and closes at "
    "six, lends books for three weeks, renews them twice, and charges nothing for late returns "
    "on children's books. Answer briefly, politely and only about the library; when you do not "
    "know, say so and suggest asking at the front desk. "
)
WORDS = [
    "book",
    "shelf",
    "author",
    "novel",
    "poem",
    "atlas",
    "index",
    "river",
    "garden",
    "winter",
    "letter",
    "music",
    "stone",
]


@dataclass
class RoutingFigures:
    shares: list[float]  # each replica's share of the requests
    hit_rate: float  # prompt tokens served from the prefix caches, of all prompt tokens

    def row(self, name: str) -> str:
        shares = " / ".join(f"{s:.0%}" for s in self.shares)
        return f"{name:<28} {shares:<12} {self.hit_rate:.1%}"


def shared_prompt_prompts(count: int) -> list[str]:
    """Prompts whose first half is the one system prompt."""
    rng = random.Random(0)
    question_words = len(SYSTEM_PROMPT.split())
    return [
        f"{SYSTEM_PROMPT}Question {i}: " + " ".join(rng.choices(WORDS, k=question_words))
        for i in range(count)
    ]


def shared_prompt_run(server: LaunchedServer, count: int) -> RoutingFigures:
    """`count` shared-prompt requests sent at once, from a flushed cache."""
    with Client(server.address, timeout=600) as c:
        assert c.flush_cache().success
        before = c.server_info()

    async def send_all() -> None:
        async with AsyncClient(server.address, timeout=600) as c:
            params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            await asyncio.gather(
                *(c.generate(p, sampling_params=params) for p in shared_prompt_prompts(count))
            )

    asyncio.run(send_all())
    with Client(server.address, timeout=600) as c:
        after = c.server_info()
    replicas = list(zip(before.replicas, after.replicas)) or [(before, after)]
    shares = [(a.num_requests - b.num_requests) / count for b, a in replicas]
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = sum(
        a.cache_hit_rate * a.prompt_tokens - b.cache_hit_rate * b.prompt_tokens for b, a in replicas
    )
    return RoutingFigures(shares, cached / max(prompt, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("server_flags", nargs="*", help="after --: flags for every server")
    args = parser.parse_args()
    runs = {
        "one replica": (),
        "dp 2, round_robin": ("--dp-size", "2", "--load-balance-method", "round_robin"),
        "dp 2, cache_aware": ("--dp-size", "2", "--load-balance-method", "cache_aware"),
    }
    rows = []
    for name, flags in runs.items():
        with launched_server(*args.server_flags, *flags) as server:
            rows.append(shared_prompt_run(server, args.requests).row(name))
    print(f"{args.requests} requests at once, sharing a system prompt (half of each prompt)")
    print(f"{'server':<28} {'shares':<12} hit rate")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
