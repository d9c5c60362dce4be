"""Replays issue 13's regression tests on the code from before its fixes, and on this tree: each
must fail there, for its bug's reason, and pass here.

    python tests/replay_issue13.py [--before c54c254] [--only SUBSTRING ...]

How: tests/replay.py.
"""

from __future__ import annotations

import sys

from replay import Case, main

BEFORE = "c54c254"  # the namespace move: main's last commit before any fix of issue 13

R = "tests/regressions/"
TM = "tests/test_tokenizer_manager.py::"
PAST_RANGE = (
    R + "test_values_past_range.py::test_a_value_past_its_range_is_refused_and_the_server_lives"
)
UNBOUNDED = R + "test_unbounded_input.py::"


CASES = [
    Case("one request kills the server", PAST_RANGE + "[seed]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[top_k]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[top_logprobs_num]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[n]", "n out of its range was accepted"),
    Case(
        "livelock on an oversized max_new_tokens",
        "tests/test_scheduler.py::"
        "test_max_new_tokens_past_context_is_admitted_even_with_a_pessimistic_reserve",
        "did not finish: deadlock or livelock",
    ),
    Case(
        "errors lose their rid",
        R + "test_error_rid.py::test_a_request_failing_validation_is_refused_with_its_rid",
        "does not say which request failed",
    ),
    Case(
        "a reused rid races a stop-string finish",
        TM + "test_a_reused_rid_never_reaches_the_old_completion",
        r"assert 'x' != 'x'",
    ),
    Case(
        "disconnects go unseen",
        TM + "test_a_client_that_went_away_has_its_requests_aborted",
        "never aborted",
    ),
    Case(
        "disconnects go unseen",
        TM + "test_a_slow_reader_gets_every_reply_in_the_end",
        "replies lost, the final one too",
    ),
    Case(
        "disconnects go unseen",
        R + "test_client_default_timeout.py::test_the_sync_client_never_waits_forever_by_default",
        "waits forever",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_oversized_stop_strings_are_refused[stop-length]",
        "stop out of its range was accepted",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_oversized_stop_strings_are_refused[stop-count]",
        "stop out of its range was accepted",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_an_oversized_rid_is_refused_without_echoing_it",
        "100,000-character rid ran",
    ),
    Case(
        "unbounded input",
        TM + "test_a_frame_over_the_size_limit_is_never_held",
        "the frame was held",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_past_the_default_queue_cap_requests_are_overloaded",
        "no queue cap",
    ),
    Case(
        "unbounded input",
        TM + "test_a_long_prompt_in_the_tokenizer_stalls_nobody",
        "waited for the long prompt",
    ),
    Case(
        "no watchdog for a hung child",
        R + "test_watchdog.py::test_a_hung_server_process_takes_the_server_down",
        "no watchdog",
    ),
]


if __name__ == "__main__":
    sys.exit(main(CASES, BEFORE, 13, __doc__ or ""))
