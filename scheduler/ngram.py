"""NgramIndex: prompt-lookup drafts (SGLang's NGRAM, vLLM's prompt lookup) for one request.

Its tokens are the request's prompt and real outputs, fed in as they come (`extend`): each new
token registers the n-grams (min_n <= n <= max_n) that end just before it, with where their
continuation starts. A proposal looks the request's last n tokens up, longest n first, and copies
what followed their latest earlier occurrence (a text that repeats itself, copied on past the
end: "x y x y" proposes "x y x ..."). Fed token by token, never rescanned: a step costs a
few dict operations, whatever the request's length.

    tokens:  ... a b c [d e f] ...            a b c   <- the last 3 tokens
                 ^ "a b c" -> its continuation starts at d: propose d e f
"""

from __future__ import annotations

from dataclasses import dataclass


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        tokens = self.tokens
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending at end - 1 now have a continuation: token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the last tokens; none when
        nothing matches."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                # A continuation that runs into the end repeats with its period: a loop goes on.
                period = len(tokens) - start
                return [tokens[start + i % period] for i in range(k)]
        return []


@dataclass(slots=True)
class SpecState:
    """One request's drafting state (Req.spec; speculation.py reads and writes it)."""

    index: NgramIndex | None  # None: the drafts come from a draft model (STANDALONE)
    accept_rate: float = 1.0  # recent accepted / drafted
    cooldown: int = 0  # steps left without drafting
