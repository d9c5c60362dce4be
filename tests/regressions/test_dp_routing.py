"""Issue 22, "cache-aware DP routing sends everything to one replica": with a system prompt that
is half of each prompt, `--dp-size 2 --load-balance-method cache_aware` must keep both replicas
busy once one is far ahead, not send every request to the replica that has the prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
from regression_wire import Wire, server_flags

from radixserve.client.local_server import launched_server

REQUESTS = 64
SHARED = list(range(10, 42))  # token ids: the system prompt every request starts with


# Checked in the suite by a wider test (tests/replay_issue22.py runs this one): test_parallel_
# serving's dp2 test asserts each replica's share within 35-65% on 64 prompts at once.
@pytest.mark.replay_only
def test_cache_aware_routing_keeps_both_replicas_busy(tiny_served_model: Path) -> None:
    flags = server_flags("--dp-size", "2", "--load-balance-method", "cache_aware")
    with launched_server("--model", str(tiny_served_model), *flags) as server:
        wire = Wire(server)
        try:
            for i in range(REQUESTS):  # all at once: each is in flight when the next is routed
                question = [50 + i % 7, 60 + i % 11, 70 + i, 200 + i, 300 + i, 400 + i]
                params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
                wire.send(
                    {
                        "type": "generate",
                        "rid": f"r{i}",
                        "input_ids": SHARED + question,
                        "sampling_params": params,
                    }
                )
            finished = 0
            while finished < REQUESTS:
                reply = wire.receive(timeout=120)
                assert reply["type"] == "output", reply
                finished += bool(reply["finished"])
            wire.send({"type": "server_info"})
            info = wire.receive()
            assert info["type"] == "server_info", info
        finally:
            wire.close()
    prompts = [replica.get("prompt_tokens", 0) for replica in info["replicas"]]  # 0: left out
    shares = [p / sum(prompts) for p in prompts]
    assert len(shares) == 2 and min(shares) >= 0.25, (
        f"cache-aware routing sent the requests {prompts} (prompt tokens per replica): "
        "no load term, all to one replica"
    )
