"""A model's linear layers on each kernel we could run them on, taking turns in one process:
F.linear (MKL's sgemm, the baseline), the extension's linear_small_m on the plain weight (up to
SMALL_M rows), oneDNN's matmul on that same plain weight, oneDNN on a weight reordered once for
it (`PackedWeight`), and the extension's linear_panels on that reordered weight (float32, up to
4 rows, where oneDNN laid it out in panels). Only one form of the weight is kept in a model: this
says which form and which kernels a dtype's rows are fastest on.

    python benchmarks/bench_linear.py [--dtype float32] [--shapes default,qwen2-0.5b]
                                      [--rows 1,2,8,16,64,256,1024] [--rounds 5]

Shapes: the default model's (SmolLM2-135M: hidden 576, 9/3 heads of 64, intermediate 1536,
vocabulary 49152) and the 0.5B Qwen2's (hidden 896, 14/2 heads of 64, intermediate 4864,
vocabulary 151936). Each round times every kernel once, in turn, so a load that comes and goes
weighs on all of them alike; the table has each kernel's best round. "plain best / packed" is
the plain weight's best kernel (linear_small_m or oneDNN) against the packed weight's best
(oneDNN or linear_panels).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.fused_ops import SMALL_M
from radixserve.model_worker.packed_linear import PackedWeight, onednn_linear

SHAPES = {
    "default": {
        "qkv_proj": (576, 960),
        "o_proj": (576, 576),
        "gate_up_proj": (576, 3072),
        "down_proj": (1536, 576),
        "lm_head": (576, 49152),
    },
    "qwen2-0.5b": {
        "qkv_proj": (896, 1152),
        "o_proj": (896, 896),
        "gate_up_proj": (896, 9728),
        "down_proj": (4864, 896),
        "lm_head": (896, 151936),
    },
}  # model: {layer: (in, out)}
KERNELS = ("F.linear", "linear_small_m", "oneDNN plain", "oneDNN packed", "linear_panels")
PANEL_ROWS_MAX = 4  # the extension's kMaxPanelRows


def seconds_per_call(f: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps


def time_kernels(kernels: dict[str, Callable[[], object]], flops: int, rounds: int) -> dict:
    """Each kernel's best seconds per call over `rounds` rounds, the kernels in turn."""
    reps = max(1, int(2e8 / flops))
    for f in kernels.values():
        f()  # warm-up: oneDNN builds its primitive on the first call
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds):
        for name, f in kernels.items():
            best[name] = min(best[name], seconds_per_call(f, reps))
    return best


def layer_kernels(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> dict:
    small_m = torch.ops.radixserve.linear_small_m.default
    kernels: dict[str, Callable[[], object]] = {"F.linear": lambda: F.linear(x, weight)}
    if x.shape[0] <= SMALL_M:
        kernels["linear_small_m"] = lambda: small_m(x, weight, None)
    kernels["oneDNN plain"] = lambda: onednn_linear(x, weight, None)
    kernels["oneDNN packed"] = lambda: packed.matmul(x, None)
    panels = packed.panels
    if panels is not None and x.shape[0] <= PANEL_ROWS_MAX:
        n, _ = packed.shape
        linear_panels = torch.ops.radixserve.linear_panels.default
        kernels["linear_panels"] = lambda: linear_panels(
            x, packed.packed, n, panels.k_pad, panels.block, None
        )
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", default="default,qwen2-0.5b")
    parser.add_argument("--rows", default="1,2,8,16,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.dtype}, threads {torch.get_num_threads()}, best of {args.rounds} rounds; ms\n")
    print("| model | layer | rows | " + " | ".join(KERNELS) + " | plain best / packed |")
    print("|---|---|---|" + "---|" * len(KERNELS) + "---|")
    for model in args.shapes.split(","):
        for name, (k, n) in SHAPES[model].items():
            weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            packed = PackedWeight(weight)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype)
                best = time_kernels(layer_kernels(x, weight, packed), 2 * m * n * k, args.rounds)
                cells = [f"{best[kn] * 1e3:.3f}" if kn in best else "-" for kn in KERNELS]
                inf = float("inf")
                plain = min(best["oneDNN plain"], best.get("linear_small_m", inf))
                ratio = plain / min(best["oneDNN packed"], best.get("linear_panels", inf))
                print(f"| {model} | {name} | {m} | " + " | ".join(cells) + f" | {ratio:.2f} |")
            del weight, packed


if __name__ == "__main__":
    main()
