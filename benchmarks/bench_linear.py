"""A model's linear layers on each kernel we could run them on, taking turns in one process:
F.linear (MKL's sgemm, the baseline), the extension's linear_small_m on the plain weight (up to
SMALL_M rows), oneDNN's matmul on that same plain weight, oneDNN on a weight reordered once for
it (`PackedWeight`), and the extension's linear_panels on that reordered weight (up to 4 rows,
where oneDNN laid it out in panels: float32, and bfloat16 on AVX512-BF16 without AMX). Only one
form of the weight is kept in a model: this says which form and which kernels a dtype's rows are
fastest on.

    python benchmarks/bench_linear.py [--dtype float32] [--shapes default,qwen2-0.5b]
                                      [--rows 1,2,8,16,64,256,1024] [--rounds 5]
                                      [--kernels "oneDNN packed,linear_panels"] [--cold-mb 0]

Shapes: the default model's (SmolLM2-135M: hidden 576, 9/3 heads of 64, intermediate 1536,
vocabulary 49152), the 0.5B Qwen2's (hidden 896, 14/2 heads of 64, intermediate 4864, vocabulary
151936) and Qwen3-8B's (hidden 4096, 32/8 heads of 128, intermediate 12288; its LM head alone is
1.2 GB in bfloat16: leave the plain kernels out with --kernels, which then keeps no plain weight).
Each round times every kernel once, in turn, so a load that comes and goes weighs on all of them
alike; the table has each kernel's best round. "plain best / packed" is the plain weight's best
kernel (linear_small_m or oneDNN) against the packed weight's best (oneDNN or linear_panels).

"floor" is the time to read the layer's weight bytes once (summed as float32, from a 512 MB
buffer, in this process's threads), timed in turn with the kernels, and "/ floor" the packed
weight's best kernel against it. `--cold-mb 512` cycles the kernels through copies of the weight
that together take that much (more than the last-level cache: with 128 MB some calls here still
found their copy cached), as a model's step reads its layers from memory; 0 (the default) calls
one copy again and again.
"""

from __future__ import annotations

import argparse
import functools
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
    "qwen3-8b": {
        "qkv_proj": (4096, 6144),
        "o_proj": (4096, 4096),
        "gate_up_proj": (4096, 24576),
        "down_proj": (12288, 4096),
        "lm_head": (4096, 151936),
    },
}  # model: {layer: (in, out)}
READ_BUFFER_MB = 512  # more than any last-level cache here
KERNELS = ("F.linear", "linear_small_m", "oneDNN plain", "oneDNN packed", "linear_panels")
PLAIN_KERNELS = KERNELS[:3]  # those that read the plain weight
PANEL_ROWS_MAX = 4  # the extension's kMaxPanelRows: float32's (bfloat16 takes any)


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


class WeightRead:
    """Reads `nbytes` of memory once (sums them as float32), the next window of a buffer larger
    than the last-level cache each call: the floor of a kernel that reads that many bytes of
    weight, timed in turn with the kernels (the bandwidth a shared machine gives changes)."""

    def __init__(self, buffer_mb: int):
        self.buffer = torch.ones(buffer_mb * 2**20 // 4)
        self.at = 0

    def __call__(self, nbytes: int) -> None:
        left = nbytes // 4
        while left:
            if self.at == self.buffer.numel():
                self.at = 0
            take = min(left, self.buffer.numel() - self.at)
            self.buffer[self.at : self.at + take].sum()
            self.at += take
            left -= take


class Copies:
    """The copies of one weight, plain and packed, handed out in turn across all kernels: the
    copy a call reads is the one read longest ago, by whichever kernel."""

    def __init__(self, weights: list[torch.Tensor], packs: list[PackedWeight]):
        self.weights, self.packs, self.i = weights, packs, 0

    def next(self) -> int:
        self.i = (self.i + 1) % len(self.packs)
        return self.i


def layer_kernels(x: torch.Tensor, copies: Copies, wanted: set[str]) -> dict:
    small_m = torch.ops.radixserve.linear_small_m.default
    w, p = copies.weights, copies.packs
    kernels: dict[str, Callable[[], object]] = {
        "F.linear": lambda: F.linear(x, w[copies.next()]),
        "oneDNN plain": lambda: onednn_linear(x, w[copies.next()], None),
        "oneDNN packed": lambda: p[copies.next()].matmul(x, None),
    }
    if x.shape[0] <= SMALL_M:
        kernels["linear_small_m"] = lambda: small_m(x, w[copies.next()], None)
    panels = p[0].panels
    if panels is not None and (x.shape[0] <= PANEL_ROWS_MAX or x.dtype == torch.bfloat16):
        n, _ = p[0].shape
        linear_panels = torch.ops.radixserve.linear_panels.default
        kernels["linear_panels"] = lambda: linear_panels(
            x, p[copies.next()].packed, n, panels.k_pad, panels.block, panels.k_block, None
        )
    return {name: f for name, f in kernels.items() if name in wanted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", default="default,qwen2-0.5b")
    parser.add_argument("--rows", default="1,2,8,16,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--cold-mb", type=int, default=0)
    args = parser.parse_args()
    load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    wanted = set(args.kernels.split(","))
    gen = torch.Generator().manual_seed(0)
    print(
        f"{args.dtype}, threads {torch.get_num_threads()}, best of {args.rounds} rounds, weights "
        f"{'cycled through ' + str(args.cold_mb) + ' MB' if args.cold_mb else 'in one copy'}; ms\n"
    )
    shown = [kn for kn in KERNELS if kn in wanted]
    print("| model | layer | rows | " + " | ".join(shown) + " | floor | / floor | plain / packed |")
    print("|---|---|---|" + "---|" * len(shown) + "---|---|---|")
    for model in args.shapes.split(","):
        for name, (k, n) in SHAPES[model].items():
            nbytes = n * k * dtype.itemsize
            copies = max(1, -(-args.cold_mb * 2**20 // nbytes))
            weights, packs = [], []
            for _ in range(copies):  # without plain kernels, no plain copy kept (an 8B LM head)
                weight = torch.randn(n, k, generator=gen, dtype=dtype).mul_(0.05)
                packs.append(PackedWeight(weight))
                if wanted & set(PLAIN_KERNELS):
                    weights.append(weight)
                del weight
            read = WeightRead(READ_BUFFER_MB)  # after the plain weights went
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype)
                kernels = layer_kernels(x, Copies(weights, packs), wanted)
                kernels["floor"] = functools.partial(read, nbytes)
                best = time_kernels(kernels, 2 * m * n * k, args.rounds)
                floor = best["floor"]
                cells = [f"{best[kn] * 1e3:.3f}" if kn in best else "-" for kn in shown]
                inf = float("inf")
                plain = min(best.get(kn, inf) for kn in PLAIN_KERNELS[1:])
                packed = min(best.get("oneDNN packed", inf), best.get("linear_panels", inf))
                ratio = f"{plain / packed:.2f}" if plain < inf and packed < inf else "-"
                print(
                    f"| {model} | {name} | {m} | " + " | ".join(cells) + f" | {floor * 1e3:.3f}"
                    f" | {packed / floor:.2f} | {ratio} |"
                )
                del kernels  # they hold the copies
            del weights, packs, read


if __name__ == "__main__":
    main()
