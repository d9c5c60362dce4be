"""The model's linear layers, three ways, taking turns in one process: F.linear (MKL's sgemm,
the baseline), oneDNN on a weight reordered once (`PackedWeight`, what `cpu_attn` runs at every
row count: only that copy is kept) and the extension's linear_small_m on the plain weight (what
float32 ran for one or two rows while both copies were kept). `--rows 1,2` measures what keeping
one copy costs those rows.

    python benchmarks/bench_linear.py [--rows 1,4,8,16,64,256,2048]

Shapes: the default model's (SmolLM2-135M: hidden 576, 9/3 heads of 64, intermediate 1536,
vocabulary 49152). Prints the best of 3 timings of each and oneDNN's speed-up over F.linear.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.fused_ops import SMALL_M
from radixserve.model_worker.packed_linear import PackedWeight

SHAPES = {
    "qkv_proj": (576, 960),
    "gate_up_proj": (576, 3072),
    "down_proj": (1536, 576),
    "o_proj": (576, 576),
    "lm_head": (576, 49152),
}  # name: (in, out)


def best_seconds(f: Callable[[], object], flops: int) -> float:
    reps = max(2, int(3e8 / flops))
    f()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            f()
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def time_layer(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight, small_m) -> list[str]:
    flops = 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
    base = best_seconds(lambda: F.linear(x, weight), flops)
    dnn = best_seconds(lambda: packed.matmul(x, None), flops)
    small = "-"
    if x.shape[0] <= SMALL_M:
        small = f"{best_seconds(lambda: small_m(x, weight, None), flops) * 1e3:.3f}"
    return [f"{base * 1e3:.3f}", f"{dnn * 1e3:.3f}", small, f"{base / dnn:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,64,256,2048")
    args = parser.parse_args()
    load_cpu_kernels()
    small_m = torch.ops.radixserve.linear_small_m.default
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}; times in ms\n")
    print("| layer | rows | F.linear | oneDNN packed | linear_small_m | oneDNN / F.linear |")
    print("|---|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k, generator=gen) * 0.05
        packed = PackedWeight(weight)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            print(f"| {name} | {m} | " + " | ".join(time_layer(x, weight, packed, small_m)) + " |")


if __name__ == "__main__":
    main()
