"""Scheduler CPU time per step, forward excluded: the real scheduler and pools, a model worker that
returns at once. Measures steady-state decode steps with N requests running.

    python benchmarks/bench_scheduler.py [--running 64 256 1024] [--steps 200]

Baseline in the same run: seed 000's textbook `build_meta` (Python lists, a padded block table)
for the same decode batch: only the metadata a step needs, none of the scheduling.
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.protocol.internal import TokenizedGenerateReq
from radixserve.protocol.wire import SamplingParams
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig

PROMPT_LEN = 128


class InstantWorker:
    """Returns a token per sequence without computing anything, and times nothing else."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        start = time.perf_counter()
        out = SampleOutput(torch.full((batch.batch_size,), 7, dtype=torch.int64))
        self.seconds += time.perf_counter() - start
        return out


def measure(running: int, steps: int, stream: bool = True) -> float:
    """Scheduler µs per decode step with `running` requests, the forward excluded. stream: every
    request hands its token to the detokenizer every step (else only when it finishes)."""
    worker = InstantWorker()
    config = SchedulerConfig(
        max_total_tokens=running * (PROMPT_LEN + steps + 8),
        max_running_requests=running,
        max_prefill_tokens=max(running * PROMPT_LEN, 16384),
        chunked_prefill_size=running * PROMPT_LEN,  # everyone prefilled in the first step
        context_len=4096,
        eos_token_ids=frozenset({0}),
    )
    s = Scheduler(config, worker)
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(running):
        s.add_request(TokenizedGenerateReq(f"r{i}", [5] * PROMPT_LEN, params, stream=stream))
    while s.waiting or any(not r.is_decoding for r in s.running):
        s.step()  # admit and prefill everyone first
    worker.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        s.step()
        s.outbox = []  # the process loop ships these; shipping is not scheduling
    return (time.perf_counter() - start - worker.seconds) / steps * 1e6


def measure_seed_build_meta(running: int, steps: int) -> float:
    """µs per step of seed 000 §5.4 C for a decode batch of the same shape."""
    seq_len = PROMPT_LEN + steps // 2
    slots = [list(range(i * seq_len, (i + 1) * seq_len)) for i in range(running)]
    start = time.perf_counter()
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
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"decode steps, forward excluded, torch threads {args.threads}\n")
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


if __name__ == "__main__":
    main()
