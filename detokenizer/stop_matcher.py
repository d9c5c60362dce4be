"""Stop strings matched in text that arrives in pieces, in time linear in the text.

For each stop string the matcher keeps how much of it the text so far ends with (the state of a
Knuth-Morris-Pratt automaton). Each new character moves every state once, amortized O(1), so a
step costs O(new characters x stop strings) however long the strings are, where testing every
suffix of the held-back text against every prefix of a stop string cost O(length^2) per step.
"""

from __future__ import annotations

import functools
from array import array


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fallbacks = [_fallback_table(stop) for stop in stops]
        self.matched = [0] * len(stops)  # characters of each stop string the text ends with

    def feed(self, text: str) -> bool:
        """Advance over `text`; True once a stop string occurs (it ends inside `text`)."""
        found = False
        for i, (stop, fallback) in enumerate(zip(self.stops, self.fallbacks)):
            k = self.matched[i]
            for ch in text:
                while k and stop[k] != ch:
                    k = fallback[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    found = True
                    k = fallback[k - 1]
            self.matched[i] = k
        return found

    @property
    def pending(self) -> int:
        """How many characters at the end of the text may begin a stop string: held back."""
        return max(self.matched, default=0)


# One table a stop string, not one a request: n = 128 completions with 64 stop strings of 1,024
# characters held 128 copies of 2 MB of Python ints.
@functools.lru_cache(maxsize=1024)
def _fallback_table(s: str) -> memoryview:
    """table[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    table = array("i", bytes(len(s) * array("i").itemsize))
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return memoryview(table).toreadonly()  # one table for every request: never written
