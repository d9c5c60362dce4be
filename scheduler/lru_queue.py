"""LRUQueue: a set of items ordered by last use, least recently used out first.

The radix cache keeps its evictable leaves in one, so that an eviction costs O(1) per leaf in
the common case instead of a pass over every leaf: a pool full of cached prefixes evicts on
every step.

Lazy: adding an item again at a new time, or discarding it, leaves its old entry queued, to be
skipped as stale when it comes up; the queue is rebuilt once stale entries outnumber the live.
Times come from a clock that only grows, so most items are added at the newest time yet: those
append to a FIFO. The others (a leaf unlocked long after its last use, a parent left without
children) go to a heap. `pop_oldest` takes the older of the two heads.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

# (time, sequence number, item): the sequence number is unique, so entries never compare items.
_Entry = tuple[int, int, T]


class LRUQueue(Generic[T]):
    def __init__(self) -> None:
        self._times: dict[T, int] = {}  # the members, each at the time it was last added
        self._fifo: deque[_Entry[T]] = deque()  # in time order
        self._heap: list[_Entry[T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._times)

    def __contains__(self, item: T) -> bool:
        return item in self._times

    def __iter__(self) -> Iterator[T]:
        return iter(self._times)

    def add(self, item: T, time: int) -> None:
        """Make item a member last used at `time` (again, if it is one)."""
        self._times[item] = time
        entry = (time, next(self._seq), item)
        if not self._fifo or time >= self._fifo[-1][0]:
            self._fifo.append(entry)
        else:
            heapq.heappush(self._heap, entry)
        if len(self._fifo) + len(self._heap) > 2 * len(self._times) + 64:
            self._rebuild()

    def discard(self, item: T) -> None:
        self._times.pop(item, None)

    def pop_oldest(self) -> T | None:
        """Remove and return the least recently used member; None when there is none."""
        fifo, heap, times = self._fifo, self._heap, self._times
        while fifo or heap:
            if heap and (not fifo or heap[0] < fifo[0]):
                time, _, item = heapq.heappop(heap)
            else:
                time, _, item = fifo.popleft()
            if times.get(item) == time:  # else stale: discarded, or added again since
                del times[item]
                return item
        return None

    def _rebuild(self) -> None:
        members = sorted(self._times.items(), key=lambda member: member[1])
        self._fifo = deque((time, next(self._seq), item) for item, time in members)
        self._heap = []
