"""A decode step of one sequence in float32 (the default dtype on CPUs without bfloat16), with
the extension's linear_panels for 1 to 4 rows on oneDNN's one copy of the weights, against
oneDNN's matmul at every row count (what one copy ran before linear_panels), in this process,
the two models' steps taking turns. With --quantization int8: int8 weights in the VNNI layout
(int8_vnni_linear) against the plain layout (int8_linear), on CPUs with AVX512-VNNI.

    python benchmarks/bench_one_row.py [--model PATH] [--steps 40] [--quantization int8]

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

from radixserve.model_worker import fused_ops, quantization
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

# name: fused_ops.PANEL_ROWS while the model is built (its fused layers keep it) and steps
FLOAT_CONFIGS = {"linear_panels (1-4 rows)": fused_ops.PANEL_ROWS, "oneDNN at every row count": 0}
# name: whether int8 weights take the VNNI layout (each weight keeps the one it was built in)
INT8_CONFIGS = {"int8, VNNI layout": True, "int8, plain layout": False}


def runner(path: str, max_len: int, quantization: str | None) -> ModelRunner:
    return ModelRunner(
        path,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_total_tokens=max_len + 8,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        attention_backend="cpu_attn",
        quantization=quantization,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quantization", default=None, choices=(None, "int8"))
    args = parser.parse_args()
    keep_freed_memory()
    path = resolve_model_path(args.model)
    max_len = 128 + args.steps + 1
    int8 = args.quantization == "int8"
    if int8 and not quantization.vnni_kernel_available():
        raise SystemExit("no AVX512-VNNI here: int8 has the plain layout only")
    configs: dict[str, int | bool] = {**(INT8_CONFIGS if int8 else FLOAT_CONFIGS)}
    runners = {}
    for name, setting in configs.items():
        if int8:
            quantization.vnni_layout_available = lambda vnni=setting: bool(vnni)
        else:
            fused_ops.PANEL_ROWS = int(setting)
        runners[name] = runner(path, max_len, args.quantization)
    vocab = next(iter(runners.values())).model_config.vocab_size
    prompt = make_prompts(1, 128, vocab)[0]
    seqs = {name: Seqs([list(prompt)], [0], max_len) for name in configs}
    times: dict[str, list[float]] = {name: [] for name in configs}
    with torch.inference_mode():
        for _ in range(args.steps + 1):  # the first is the prompt's prefill, untimed
            for name, setting in configs.items():
                if not int8:
                    fused_ops.PANEL_ROWS = int(setting)
                start = time.perf_counter()
                token = int(forward(runners[name], seqs[name], [0])[0].argmax())
                times[name].append(time.perf_counter() - start)
                seqs[name].tokens[0].append(token)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    names = list(configs)
    same = seqs[names[0]].tokens == seqs[names[1]].tokens
    print(
        f"{path}: float32, quantization {args.quantization}, one sequence, {args.steps} decode "
        f"steps taking turns, threads "
        f"{torch.get_num_threads()}; greedy tokens {'identical' if same else 'DIFFER'}"
    )
    for name, median in medians.items():
        print(f"  {name:28s} {median * 1e3:8.2f} ms per step")
    ratios = [a / b for a, b in zip(times[names[0]][1:], times[names[1]][1:])]
    print(f"  {names[0]} / {names[1]}, median of pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
