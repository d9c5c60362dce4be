"""Hypothesis strategies for what a hostile or broken client sends: valid requests with fields
replaced by wrong types, extreme integers, huge strings and other clients' rids; junk bytes;
nesting deeper than any decoder's recursion; multipart messages."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

GOOD_RIDS = [f"good-{i}" for i in range(8)]
FIELDS = [
    "type",
    "rid",
    "text",
    "input_ids",
    "messages",
    "sampling_params",
    "stream",
    "return_logprob",
    "top_logprobs_num",
    "api_key",
    "junk",
]
PARAMS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "seed",
    "n",
    "junk",
]
# Built when drawn: a strategy keeps its constants' repr, and these would make it megabytes.
HUGE = {"ascii": lambda: "x" * 100_000, "emoji": lambda: "🎉" * 20_000, "nul": lambda: "\0" * 999}
NASTY = [
    None,
    True,
    0,
    -1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64 - 1,
    1.5,
    float("nan"),
    float("inf"),
    "",
    b"\xff",
    [],
    {},
    [1, "a", None],
    {"type": "generate"},
    [[[[[[[[[[1]]]]]]]]]],
    {"a": {"b": {"c": {}}}},
]
nasty = (
    st.sampled_from(NASTY)
    | st.integers(-(2**63), 2**64 - 1)  # all msgpack can carry
    | st.text(max_size=10)
    | st.sampled_from(sorted(HUGE)).map(lambda k: HUGE[k]())
    | st.sampled_from(GOOD_RIDS)  # other clients' rids: duplicates, and aborts of them
)


def mutated(kind: str, rid: str, fields: list, params: list) -> bytes:
    """A valid request of `kind` with some fields and sampling parameters replaced."""
    request: dict[str, Any] = {"type": kind, "rid": rid, "text": "hi", "stream": True}
    request["sampling_params"] = {"max_new_tokens": 2, **dict(params)}
    request.update(fields)
    return msgspec.msgpack.encode(request)


def deep(depth: int) -> bytes:
    """A map whose value nests `depth` arrays: deeper than any decoder's recursion."""
    return b"\x82\xa4type\xa8generate\xa4text" + b"\x91" * depth + b"\xc0"


requests = st.builds(
    mutated,
    st.sampled_from(["generate", "abort", "health", "server_info", "flush_cache", "launch"]),
    st.sampled_from([*GOOD_RIDS, "fuzz"]),
    st.lists(st.tuples(st.sampled_from(FIELDS), nasty), max_size=3),
    st.lists(st.tuples(st.sampled_from(PARAMS), nasty), max_size=3),
)
message = st.one_of(
    requests.map(lambda m: [m]),
    st.binary(max_size=100).map(lambda m: [m]),
    st.integers(1_000, 100_000).map(lambda d: [deep(d)]),
    st.lists(st.binary(max_size=20), min_size=2, max_size=3),  # multipart
)
