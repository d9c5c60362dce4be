"""Scheduler CPU time per step, forward excluded: the real scheduler and pools, a model worker that
returns at once. Measures steady-state decode steps with N requests running.

    python benchmarks/bench_scheduler.py [--running 64 256 1024] [--steps 200]
        [--cached-nodes 100000] [--rounds 3]

Baseline in the same run: seed 000's textbook `build_meta` (Python lists, a padded block table)
for the same decode batch: only the metadata a step needs, none of the scheduling.

Full-cache case: the rest of the KV pool holds `--cached-nodes` or more cached prefixes (leaves of
`--leaf-tokens` tokens, 512 under each of a few hundred one-token parents), so every decode step
must evict. Baseline in the same run, taking turns: the eviction before issue 15, which rebuilt a
heap of every evictable leaf on each eviction; and the same step with nothing cached.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import statistics
import time

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.protocol.internal import TokenizedGenerateReq
from radixserve.protocol.wire import SamplingParams
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig

PROMPT_LEN = 128
CACHE_GROUP = 512  # cached leaves under one shared one-token parent
# Wall time by default; --cpu-time: this process's CPU time, steadier on a shared machine.
clock = time.perf_counter


class InstantWorker:
    """Returns a token per sequence without computing anything, and times nothing else."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        start = clock()
        out = SampleOutput(torch.full((batch.batch_size,), 7, dtype=torch.int64))
        self.seconds += clock() - start
        return out


class RebuildHeapRadixCache(RadixCache):
    """The baseline: the eviction before issue 15, a heap of every evictable leaf built afresh
    on each call (O(leaves) per evicting step once the pool is full of cache)."""

    def evict(self, num_tokens: int) -> int:
        leaves = self._evictable_leaves
        order = itertools.count()  # breaks ties: entries never compare their nodes
        heap = [(leaf.last_access_time, next(order), leaf) for leaf in leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            parent = leaf.parent
            leaves.discard(leaf)
            self._remove_leaf(leaf)
            if parent in leaves:
                heapq.heappush(heap, (parent.last_access_time, next(order), parent))
        return freed


def measure(
    running: int,
    steps: int,
    stream: bool = True,
    cached_nodes: int = 0,
    leaf_tokens: int = 1,
    cache: type[RadixCache] = RadixCache,
) -> float:
    """Scheduler µs per decode step with `running` requests, the forward excluded. stream: every
    request hands its token to the detokenizer every step (else only when it finishes).
    cached_nodes: make room for at least that many cached prefixes of `leaf_tokens` tokens and
    fill every free slot with them first, so that every step evicts, with `cache`'s eviction."""
    worker = InstantWorker()
    config = SchedulerConfig(
        max_total_tokens=running * (PROMPT_LEN + steps + 8) + cached_nodes * leaf_tokens,
        max_running_requests=running,
        max_prefill_tokens=max(running * PROMPT_LEN, 16384),
        chunked_prefill_size=running * PROMPT_LEN,  # everyone prefilled in the first step
        context_len=4096,
        eos_token_ids=frozenset({0}),
    )
    s = Scheduler(config, worker)
    s.kv.tree_cache = cache(s.kv.allocator, config.page_size)
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(running):
        s.add_request(TokenizedGenerateReq(f"r{i}", [5] * PROMPT_LEN, params, stream=stream))
    while s.waiting or any(not r.is_decoding for r in s.running):
        s.step()  # admit and prefill everyone first
    if cached_nodes:
        assert fill_with_cache(s, s.kv.tree_cache, leaf_tokens) >= cached_nodes
        gc.collect()  # the fill's one full collection of 100k+ new objects is setup, not steps
    worker.seconds = 0.0
    start = clock()
    for _ in range(steps):
        s.step()
        s.outbox = []  # the process loop ships these; shipping is not scheduling
    return (clock() - start - worker.seconds) / steps * 1e6


def fill_with_cache(s: Scheduler, tree: RadixCache, leaf_tokens: int) -> int:
    """Cache prefixes [group, leaf...] (ids the prompts never use; a leaf of `leaf_tokens`) in
    every free slot: from now on every allocation evicts. Returns how many leaves there are."""
    leaves = 0
    while s.kv.allocator.num_free > leaf_tokens:
        slots = s.kv.allocator.alloc(1 + leaf_tokens)
        assert slots is not None
        tokens = [1000 + leaves // CACHE_GROUP, 10**6 + leaves] + [7] * (leaf_tokens - 1)
        cached = tree.insert(tokens, slots).num_cached
        s.kv.allocator.free(slots[:cached])  # the group's parent, cached already
        leaves += 1
    return leaves


def measure_seed_build_meta(running: int, steps: int) -> float:
    """µs per step of seed 000 §5.4 C for a decode batch of the same shape."""
    seq_len = PROMPT_LEN + steps // 2
    slots = [list(range(i * seq_len, (i + 1) * seq_len)) for i in range(running)]
    start = clock()
    for _ in range(steps):
        positions, slot_mapping, cu_seqlens_q, seq_lens_kv, rows = [], [], [0], [], []
        for req_slots in slots:
            cur_len = seq_len - 1
            positions.append(cur_len)
            slot_mapping.append(req_slots[cur_len])
            cu_seqlens_q.append(cu_seqlens_q[-1] + 1)
            seq_lens_kv.append(seq_len)
            rows.append(req_slots)
        torch.tensor(positions), torch.tensor(slot_mapping), torch.tensor(cu_seqlens_q)
        torch.tensor(seq_lens_kv), torch.tensor(rows)
    return (clock() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cached-nodes", type=int, default=100_000, help="0: no full-cache case")
    parser.add_argument("--full-cache-running", type=int, default=256)
    parser.add_argument("--full-cache-steps", type=int, default=30)
    parser.add_argument("--leaf-tokens", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true", help="CPU time instead of wall time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        global clock
        clock = time.process_time
    timing = "CPU time" if args.cpu_time else "wall time"
    print(f"decode steps, forward excluded, torch threads {args.threads}, {timing}\n")
    if args.cached_nodes:
        full_cache(args)
        print()
    print(
        "| running | µs / step, streaming | µs / request | µs / step, not streaming "
        "| seed build_meta µs / step | ours (streaming) / seed |"
    )
    print("|---|---|---|---|---|---|")
    for n in args.running:
        ours, quiet = measure(n, args.steps), measure(n, args.steps, stream=False)
        seed = measure_seed_build_meta(n, args.steps)
        print(
            f"| {n} | {ours:.0f} | {ours / n:.2f} | {quiet:.0f} | {seed:.0f} | {ours / seed:.2f}x |"
        )


def full_cache(args: argparse.Namespace) -> None:
    n, steps, nodes = args.full_cache_running, args.full_cache_steps, args.cached_nodes
    print(
        f"full cache: {n} running, {nodes}+ cached leaves, every decode step evicting {n} tokens' "
        f"worth of them; {args.rounds} rounds of {steps} steps, the three cases taking turns\n"
    )
    print(
        "| leaf tokens | round | µs / step, nothing cached | µs / step, full cache "
        "| µs / step, full cache, heap rebuilt per eviction (before) |"
    )
    print("|---|---|---|---|---|")
    summary = []
    for leaf in args.leaf_tokens:
        plain, ours, before = [], [], []
        for r in range(args.rounds):
            plain.append(measure(n, steps))
            ours.append(measure(n, steps, cached_nodes=nodes, leaf_tokens=leaf))
            before.append(
                measure(n, steps, cached_nodes=nodes, leaf_tokens=leaf, cache=RebuildHeapRadixCache)
            )
            print(f"| {leaf} | {r + 1} | {plain[-1]:.0f} | {ours[-1]:.0f} | {before[-1]:.0f} |")
        summary.append((leaf, *(statistics.median(x) for x in (plain, ours, before))))
    print("\nmedians:\n")
    print("| leaf tokens | nothing cached | full cache | before | full / before | full / nothing |")
    print("|---|---|---|---|---|---|")
    for leaf, base, mine, theirs in summary:
        print(
            f"| {leaf} | {base:.0f} | {mine:.0f} | {theirs:.0f} | {mine / theirs:.4f}x "
            f"| {mine / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
