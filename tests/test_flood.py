"""Issue 22, acceptance 3, scaled down (benchmarks/flood.py runs the full one: 2,000 generates
of 1 MB from 20 clients): 200 generates of 1 MB from 10 clients at once, against a server whose
intake caps are small. Every request gets exactly one reply, the tokenizer manager's memory stays
bounded, and /health answers throughout."""

from __future__ import annotations

import asyncio

from radixserve.benchmarks.flood import failures, flood
from radixserve.client.local_server import launched_server
from radixserve.tokenizer_manager.manager import ROUTER_RCVHWM

REQUESTS, CLIENTS, MB = 200, 10, 1_000_000
CAPS = ("--max-pending-requests", "16", "--max-pending-bytes", str(16 * MB))


def test_a_flood_of_large_generates_costs_bounded_memory_and_one_reply_each(tiny_served_model):
    with launched_server("--model", str(tiny_served_model), *CAPS) as server:
        result = asyncio.run(flood(server, REQUESTS, CLIENTS, MB))
    print(f"\n{result.table()}")
    # What may wait: the intake's 16 MB, libzmq's frames per client, and as much again for
    # copies in passing (a frame and its decoded text); 200 MB were sent.
    bound_mb = 2 * (16 + CLIENTS * ROUTER_RCVHWM) + 32
    assert failures(result, REQUESTS, bound_mb) == []
    assert result.replies["too_long"] > 0  # some went through the intake to the tokenizer
