"""Which data-parallel replica gets a request: round robin, or cache-aware.

Cache-aware is the SGLang router's policy: send a request where its prompt's prefix is most
likely cached, while the replicas are balanced. The router cannot see the replicas' radix trees,
so it keeps its own picture of them: each prompt it sent a replica, as the chained hashes of its
whole pages of tokens (vLLM's block hashes), LRU-bounded. Each replica's load is its requests in
flight (ReplicaLoads: the replicas report what they hold, the routers count what they send).
- Imbalanced (the busiest holds more than --balance-abs-threshold requests over the idlest, and
  more than --balance-rel-threshold times as many): the least-loaded replica.
- Else, a replica holding at least --cache-threshold of the prompt: the one holding the most,
  the least loaded among equals (so that once a shared prefix is on several, they share it).
- Else the replica holding the fewest pages, which spreads new prefixes evenly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radixserve.protocol.internal import ReplicaLoad
from radixserve.server_args import ServerArgs

PAGE_TOKENS = 16
MAX_PAGES_PER_REPLICA = 100_000  # 1.6M tokens of prompts remembered; about 10 MB


class ReplicaLoads:
    """Each replica's requests in flight: what it last reported holding, plus what was sent to
    it since that it had not received by then. `sent` (requests ever sent each replica) is
    counted by the routers' `pick`, whose answer the controller sends."""

    def __init__(self, num_replicas: int):
        self.sent = [0] * num_replicas
        self.received = [0] * num_replicas  # as last reported
        self.held = [0] * num_replicas  # as last reported

    def report(self, load: ReplicaLoad) -> None:
        self.received[load.dp_rank] = load.received
        self.held[load.dp_rank] = load.in_flight

    def now(self) -> list[int]:
        return [h + s - r for h, s, r in zip(self.held, self.sent, self.received)]


class RoundRobinRouter:
    def pick(self, input_ids: Sequence[int], loads: ReplicaLoads) -> int:
        """The replica sent the fewest requests (the first among equals): each in turn."""
        best = min(range(len(loads.sent)), key=loads.sent.__getitem__)
        loads.sent[best] += 1
        return best


class CacheAwareRouter:
    def __init__(
        self,
        num_replicas: int,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
    ):
        self.pages: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def pick(self, input_ids: Sequence[int], replica_loads: ReplicaLoads) -> int:
        """The replica for a prompt, given each replica's requests in flight."""
        loads, sent = replica_loads.now(), replica_loads.sent
        hashes = page_hashes(input_ids)
        replicas = range(len(self.pages))
        matched = [_leading_matches(pages, hashes) for pages in self.pages]
        most = max(matched)
        if self.imbalanced(loads):
            best = min(replicas, key=lambda i: (loads[i], -matched[i]))
        elif most and most * PAGE_TOKENS >= self.cache_threshold * len(input_ids):
            best = min((i for i in replicas if matched[i] == most), key=loads.__getitem__)
        else:
            # Prompts shorter than a page add no pages: load, then requests sent break the tie.
            best = min(replicas, key=lambda i: (len(self.pages[i]), loads[i], sent[i]))
        self._remember(self.pages[best], hashes)
        sent[best] += 1
        return best

    def imbalanced(self, loads: Sequence[int]) -> bool:
        busiest, idlest = max(loads), min(loads)
        return (
            busiest - idlest > self.balance_abs_threshold
            and busiest > idlest * self.balance_rel_threshold
        )

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


def make_router(args: ServerArgs) -> RoundRobinRouter | CacheAwareRouter:
    if args.load_balance_method == "cache_aware":
        return CacheAwareRouter(
            args.dp_size,
            args.cache_threshold,
            args.balance_abs_threshold,
            args.balance_rel_threshold,
        )
    return RoundRobinRouter()
