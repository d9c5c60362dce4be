"""Issue 13, "errors lose their rid": a well-formed generate whose sampling_params failed
validation got an error without its rid, so a client with many requests in flight could not tell
which one failed."""

from __future__ import annotations

from regression_wire import Wire, ask, generate


def test_a_request_failing_validation_is_refused_with_its_rid(wire: Wire) -> None:
    reply = ask(wire, generate("bad-one", max_new_tokens=-1))
    assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
    assert reply.get("rid") == "bad-one", "the error does not say which request failed"
