"""StopMatcher against the obvious quadratic reference, on text that arrives in pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.detokenizer.stop_matcher import StopMatcher

# A small alphabet makes overlaps, repeats and near-misses common.
texts = st.text(alphabet="abc", max_size=12)


def held_back(text: str, stops: list[str]) -> int:
    """The longest end of text that a stop string begins with (but is not)."""
    return max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(texts.filter(bool), min_size=1, max_size=3), st.lists(texts, max_size=12))
def test_matches_and_held_back_text_equal_the_reference(stops, pieces):
    matcher = StopMatcher(stops)
    seen = ""
    for piece in pieces:
        before = seen
        seen += piece
        found = matcher.feed(piece)
        # A stop string ends inside this piece: it is in the text now and was not before.
        assert found == (any(s in seen for s in stops) and not any(s in before for s in stops))
        if found:
            return  # the request ends here
        assert matcher.pending == held_back(seen, stops)


def test_the_worst_case_of_the_quadratic_check_streams_one_character_at_a_time():
    """'aaa...ab' against a stream of 'a': the old check tried every length at every step; here
    each character moves the state once, and what is held back stays exact."""
    stop = "a" * 1023 + "b"
    matcher = StopMatcher([stop])
    for i in range(3000):
        assert not matcher.feed("a")
        assert matcher.pending == min(i + 1, 1023)
    assert matcher.feed("b")


def test_requests_with_the_same_stop_strings_share_their_tables():
    """n = 128 completions of 64 stop strings of 1,024 characters built 128 copies of each
    table; one is built, and matching still starts afresh for each."""
    stops = ["stop here " * 100, "\n\nHuman:"]
    first, second = StopMatcher(stops), StopMatcher(stops)
    assert all(a is b for a, b in zip(first.fallbacks, second.fallbacks))
    assert first.feed("x\n\nHuman:") and not second.feed("\n\nHuman")
    assert second.pending == len("\n\nHuman")
