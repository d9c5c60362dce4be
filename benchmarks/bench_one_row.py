"""A decode step of one sequence with the extension's linear_panels for 1 to 4 rows on oneDNN's
one copy of the weights, against oneDNN's matmul at every row count (what one copy ran before
linear_panels), the two taking turns on one model in this process.

    python benchmarks/bench_one_row.py [--model PATH] [--dtype float32|bfloat16] [--steps 40]

float32 is the default dtype on CPUs without bfloat16; bfloat16 reads its panels with
AVX512-BF16's vdpbf16ps (elsewhere it stays on oneDNN, and both configurations are the same).
Both run cpu_attn with every decoder layer in one call (the default): the model's decoder layers
are fused twice over the same weights (`fuse_layers` while fused_ops.PANEL_ROWS is 4, then 0)
and the step swaps them, with PANEL_ROWS set to match for the LM head; each configuration
decodes its own copy of the sequence in the pool. Prints the median step of each and the median
of their ratios; whether the greedy tokens agree (sums in another order can round a bfloat16
result the other way, and a near tie then the other way too); and each step against the
weight-streaming floor, timed in turn with the steps: every weight a step reads, read once (summed
in the model's dtype, as weight_streaming.py reads a checkpoint's) where the model keeps it (the
bytes oneDNN reordered, and the norms and biases; of the embedding a step reads one row).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from bench_backends import Seqs, forward
from bench_serving import make_prompts

from radixserve.model_worker import fused_ops
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.model_source import DEFAULT_MODEL, resolve_model_path
from radixserve.model_worker.packed_linear import PackedWeight
from radixserve.model_worker.parallel import TPGroup
from radixserve.process_setup import keep_freed_memory

# name: fused_ops.PANEL_ROWS while its fused layers are built and while it steps
CONFIGS = {"linear_panels (1-4 rows)": fused_ops.PANEL_ROWS, "oneDNN at every row count": 0}
PROMPT = 128


def step_weights(runner: ModelRunner) -> list[torch.Tensor]:
    """Every weight a decode step reads in full, as tensors in the model's dtype over its memory:
    a PackedWeight's oneDNN buffer, and the parameters other than the embedding."""
    tensors = [
        p for name, p in runner.model.named_parameters() if not name.endswith("embed_tokens.weight")
    ]
    for module in runner.model.modules():
        for value in vars(module).values():
            if isinstance(value, PackedWeight):
                nbytes = int(torch.ops.mkldnn._nbytes(value.packed))
                address = int(torch.ops.mkldnn.data_ptr(value.packed))
                buffer = (ctypes.c_char * nbytes).from_address(address)
                tensors.append(torch.frombuffer(buffer, dtype=value.dtype))
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    keep_freed_memory()
    path = resolve_model_path(args.model)
    max_len = PROMPT + args.steps + 1
    dtype = getattr(torch, args.dtype)
    runner = ModelRunner(
        path,
        dtype=dtype,
        device=torch.device("cpu"),
        max_total_tokens=len(CONFIGS) * max_len + 8,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        attention_backend="cpu_attn",
    )
    assert runner.fused_layers, "cpu_attn on one rank fuses the decoder layers"
    layers = runner.model.model
    fused = {}
    for name, panel_rows in CONFIGS.items():
        fused_ops.PANEL_ROWS = panel_rows
        layers.fuse_layers()
        fused[name] = layers.fused_layers
    prompt = make_prompts(1, PROMPT, runner.model_config.vocab_size)[0]
    seqs = Seqs([list(prompt) for _ in CONFIGS], [0] * len(CONFIGS), max_len)  # one a config
    weights = step_weights(runner)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    floors = []
    with torch.inference_mode():
        for _ in range(args.steps + 1):  # the first is the prompt's prefill, untimed
            start = time.perf_counter()
            for w in weights:
                w.sum()
            floors.append(time.perf_counter() - start)
            for i, (name, panel_rows) in enumerate(CONFIGS.items()):
                fused_ops.PANEL_ROWS = panel_rows
                layers.fused_layers = fused[name]
                start = time.perf_counter()
                token = int(forward(runner, seqs, [i])[0].argmax())
                times[name].append(time.perf_counter() - start)
                seqs.tokens[i].append(token)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    floor = statistics.median(floors[1:])
    a, b = seqs.tokens[0][PROMPT:], seqs.tokens[1][PROMPT:]
    same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    agree = "identical" if same is None else f"first differ at decode step {same}"
    print(
        f"{path}: {args.dtype}, one sequence, {args.steps} decode steps taking turns, threads "
        f"{torch.get_num_threads()}; greedy tokens {agree}"
    )
    for name, median in medians.items():
        print(f"  {name:28s} {median * 1e3:8.2f} ms per step, {median / floor:.2f}x the floor")
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    print(f"  {'weight-streaming floor':28s} {floor * 1e3:8.2f} ms ({gb:.2f} GB read once)")
    names = list(CONFIGS)
    ratios = [x / y for x, y in zip(times[names[0]][1:], times[names[1]][1:])]
    print(f"  ratio, median of pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
