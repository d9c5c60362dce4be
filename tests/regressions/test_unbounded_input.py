"""Issue 13, "unbounded input": stop strings of any length and number, rids of any length (sent
back in every reply), and a waiting queue with no cap, so the documented `overloaded` was never
produced. (Frames over --max-request-bytes and a huge prompt's tokenization:
test_tokenizer_manager.py.)"""

from __future__ import annotations

import pytest
from regression_wire import Wire, ask, assert_refused, generate

OVERSIZED = [
    ({"stop": ["x" * 100_000]}, "stop"),
    ({"stop": ["x"] * 1000}, "stop"),
]


@pytest.mark.parametrize("params, field", OVERSIZED, ids=["stop-length", "stop-count"])
def test_oversized_stop_strings_are_refused(wire: Wire, params: dict, field: str) -> None:
    assert_refused(ask(wire, generate("stops", max_new_tokens=1, **params)), field)


def test_an_oversized_rid_is_refused_without_echoing_it(wire: Wire) -> None:
    reply = ask(wire, generate("r" * 100_000, max_new_tokens=1))
    assert reply["type"] == "error" and "rid" in reply["message"], "a 100,000-character rid ran"
    assert "rid" not in reply


def test_past_the_default_queue_cap_requests_are_overloaded(wire: Wire) -> None:
    """1,100 requests at once, each holding a large share of the pool when it runs: most wait,
    and past --max-queued-requests' default (1,024) they are refused."""
    rids = [f"q{i}" for i in range(1100)]
    for rid in rids:
        wire.send(generate(rid, max_new_tokens=60))
    finals: dict[str, dict] = {}
    overloaded = 0
    while len(finals) < len(rids):
        reply = wire.receive()
        if reply["type"] == "error" or reply["finished"]:
            finals[reply["rid"]] = reply
            overloaded += reply.get("code") == "overloaded"
        if len(finals) == 1:  # the queue has formed: let the rest go
            for rid in rids:
                if rid not in finals:
                    wire.send({"type": "abort", "rid": rid})
    assert overloaded > 0, "1,100 requests waited and none was refused: no queue cap"
