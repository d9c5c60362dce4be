"""A decode step of one sequence in float32 (the default dtype on CPUs without bfloat16), with
the extension's linear_panels for 1 to 4 rows on oneDNN's one copy of the weights, against
oneDNN's matmul at every row count (what one copy ran before linear_panels), in this process,
the two models' steps taking turns.

    python benchmarks/bench_one_row.py [--model PATH] [--steps 40]

Both run cpu_attn with every decoder layer in one call (the default). Prints the median step of
each and their ratio; the greedy tokens of the two must agree (float32 sums in another order
differ in the last bits only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts

from radixserve.model_worker import fused_ops
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

# name: fused_ops.PANEL_ROWS while the model is built (its fused layers keep it) and steps
CONFIGS = {"linear_panels (1-4 rows)": fused_ops.PANEL_ROWS, "oneDNN at every row count": 0}


def runner(path: str, max_len: int) -> ModelRunner:
    return ModelRunner(
        path,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=max_len + 8,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        attention_backend="cpu_attn",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    keep_freed_memory()
    path = resolve_model_path(args.model)
    max_len = 128 + args.steps + 1
    runners = {}
    for name, panel_rows in CONFIGS.items():
        fused_ops.PANEL_ROWS = panel_rows
        runners[name] = runner(path, max_len)
    vocab = next(iter(runners.values())).model_config.vocab_size
    prompt = make_prompts(1, 128, vocab)[0]
    seqs = {name: Seqs([list(prompt)], [0], max_len) for name in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with torch.inference_mode():
        for _ in range(args.steps + 1):  # the first is the prompt's prefill, untimed
            for name, panel_rows in CONFIGS.items():
                fused_ops.PANEL_ROWS = panel_rows
                start = time.perf_counter()
                token = int(forward(runners[name], seqs[name], [0])[0].argmax())
                times[name].append(time.perf_counter() - start)
                seqs[name].tokens[0].append(token)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    same = seqs["linear_panels (1-4 rows)"].tokens == seqs["oneDNN at every row count"].tokens
    print(
        f"{path}: float32, one sequence, {args.steps} decode steps taking turns, threads "
        f"{torch.get_num_threads()}; greedy tokens {'identical' if same else 'DIFFER'}"
    )
    for name, median in medians.items():
        print(f"  {name:28s} {median * 1e3:8.2f} ms per step")
    names = list(CONFIGS)
    ratios = [a / b for a, b in zip(times[names[0]][1:], times[names[1]][1:])]
    print(f"  ratio, median of pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
