"""Issue 13, "one request kills the server": seed, top_k or top_logprobs_num past int64 passed
the wire decoding and raised OverflowError in the scheduler, which took every process down; n had
no upper bound. Each is now refused by name, with the request's rid, and the server goes on."""

from __future__ import annotations

import pytest
from regression_wire import Wire, ask, assert_refused, assert_serves, generate

PAST_RANGE = [
    ({"sampling_params": {"seed": 2**63}}, "seed"),
    ({"sampling_params": {"top_k": 2**63}}, "top_k"),
    ({"return_logprob": True, "top_logprobs_num": 2**63}, "top_logprobs_num"),
    ({"sampling_params": {"n": 129}}, "n"),
]


@pytest.mark.parametrize("fields, field", PAST_RANGE, ids=[field for _, field in PAST_RANGE])
def test_a_value_past_its_range_is_refused_and_the_server_lives(
    wire: Wire, fields: dict, field: str
) -> None:
    others = {name: value for name, value in fields.items() if name != "sampling_params"}
    request = generate("past-range", others, max_new_tokens=1, **fields.get("sampling_params", {}))
    assert_refused(ask(wire, request), field)
    assert_serves(wire)
