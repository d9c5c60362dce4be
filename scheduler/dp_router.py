"""Which data-parallel replica gets a request: round robin, or cache-aware.

Cache-aware is the SGLang router's idea: send a request where its prompt's prefix is most likely
cached. The router cannot see the replicas' radix trees, so it keeps its own picture of them:
each prompt it sent a replica, as the chained hashes of its whole pages of tokens (vLLM's block
hashes), LRU-bounded. A replica holding at least MIN_MATCH of the prompt gets it; otherwise the
replica holding the fewest pages does, which spreads new prefixes evenly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import count

PAGE_TOKENS = 16
MIN_MATCH = 0.5  # SGLang router's --cache-threshold default
MAX_PAGES_PER_REPLICA = 100_000  # 1.6M tokens of prompts remembered; about 10 MB


class RoundRobinRouter:
    def __init__(self, num_replicas: int):
        self._next = count()
        self.num_replicas = num_replicas

    def pick(self, input_ids: Sequence[int]) -> int:
        return next(self._next) % self.num_replicas


class CacheAwareRouter:
    def __init__(self, num_replicas: int):
        self.pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.num_sent = [0] * num_replicas

    def pick(self, input_ids: Sequence[int]) -> int:
        hashes = page_hashes(input_ids)
        replicas = range(len(self.pages))
        matched = [_leading_matches(pages, hashes) for pages in self.pages]
        best = max(replicas, key=matched.__getitem__)
        if matched[best] * PAGE_TOKENS < MIN_MATCH * len(input_ids):
            # Prompts shorter than a page add no pages: the count of requests breaks the tie.
            best = min(replicas, key=lambda i: (len(self.pages[i]), self.num_sent[i]))
        self._remember(self.pages[best], hashes)
        self.num_sent[best] += 1
        return best

    @staticmethod
    def _remember(pages: OrderedDict[int, None], hashes: list[int]) -> None:
        for h in hashes:
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > MAX_PAGES_PER_REPLICA:
            pages.popitem(last=False)


def page_hashes(input_ids: Sequence[int]) -> list[int]:
    """One hash per whole page of the prompt, each covering every token before it too."""
    hashes, h = [], 0
    for start in range(0, len(input_ids) - PAGE_TOKENS + 1, PAGE_TOKENS):
        h = hash((h, tuple(input_ids[start : start + PAGE_TOKENS])))
        hashes.append(h)
    return hashes


def _leading_matches(pages: OrderedDict[int, None], hashes: list[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in pages:
        n += 1
    return n


def make_router(method: str, num_replicas: int) -> RoundRobinRouter | CacheAwareRouter:
    if method == "cache_aware":
        return CacheAwareRouter(num_replicas)
    return RoundRobinRouter(num_replicas)
