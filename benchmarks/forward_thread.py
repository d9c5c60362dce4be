"""The same decode forward on the process's main thread and on a fresh thread, taking turns.

    python benchmarks/forward_thread.py [--batch 1] [--rounds 3]

Overlap scheduling launches each forward from a worker thread; this measures what that costs
on the CPU by itself, with nothing else running beside it (the default model, float32,
cpu_extension, decoding from context 128; median of 10 steps per turn).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts

from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

STEPS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keep_freed_memory()
    runner = ModelRunner(
        resolve_model_path("SmolLM2-135M-Instruct"),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=args.batch * (130 + 2 * STEPS * args.rounds) + 1,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels="cpu_extension",
    )
    rows = list(range(args.batch))
    seqs = Seqs([list(p) for p in make_prompts(args.batch, 128, 49152)], [0] * args.batch, 4096)

    def steps(times: list[float]) -> None:
        with torch.inference_mode():
            for _ in range(STEPS):
                for i in rows:
                    seqs.tokens[i].append(7)
                start = time.perf_counter()
                forward(runner, seqs, rows)
                times.append(time.perf_counter() - start)

    with torch.inference_mode():
        forward(runner, seqs, rows)  # the prompts
    print(f"{args.batch} sequence(s), {torch.get_num_threads()} threads, median step:")
    for r in range(args.rounds):
        on_main: list[float] = []
        steps(on_main)
        on_thread: list[float] = []
        thread = threading.Thread(target=steps, args=(on_thread,))
        thread.start()
        thread.join()
        main_ms, thread_ms = (statistics.median(t) * 1e3 for t in (on_main, on_thread))
        print(f"  round {r + 1}: main thread {main_ms:.1f} ms, fresh thread {thread_ms:.1f} ms")


if __name__ == "__main__":
    main()
