"""bfloat16 linear layers of a forward of some rows (a decode step's, a prefill chunk's), taking
turns in one process: the extension's linear_panels on oneDNN's packed weight against oneDNN's
own matmul on the same copy, every decoder layer's linears in turn and then the LM head, as a
forward reads them (the weights from memory, not from the cache that repeating one layer keeps
them in).

    python benchmarks/bench_panels.py [--model SmolLM2-135M-Instruct] [--rows 16,64,256,512,2048]
                                      [--threads 2] [--rounds 5] [--layers N]

Checks first that both give the same result to the bit (linear_panels sums in oneDNN's order),
then prints, per row count, each layer's ms per pass (the median of --rounds passes; the kernel
that goes first alternates), and panels / oneDNN. The LM head is timed up to 64 rows only (a
prefill computes it on each prompt's last row), so the totals of fewer and more rows differ in
what they hold. --layers holds fewer decoder layers than the model has, to fit a large model's
in memory (enough of them that they do not fit in the last-level cache). Wall time: take it on
an idle machine. Needs AVX512-BF16 (oneDNN's bfloat16 panels).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_int8_gemm import layer_shapes

from radixserve.model_worker.cpu_features import has_amx_bf16, has_avx512_bf16
from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.packed_linear import PackedWeight
from radixserve.process_setup import keep_freed_memory

Linear = Callable[[torch.Tensor, PackedWeight], torch.Tensor]


def onednn(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    return weight.matmul(x, None)


def panels(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    p = weight.panels
    assert p is not None
    return torch.ops.radixserve.linear_panels(
        x, weight.packed, weight.shape[0], p.k_pad, p.block, p.k_block, None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rows", default="16,64,256,512,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, help="decoder layers to hold (default: all)")
    args = parser.parse_args()
    if not has_avx512_bf16() or has_amx_bf16():
        raise SystemExit("no AVX512-BF16, or AMX, here: linear_panels leaves bfloat16 to oneDNN")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    load_cpu_kernels()
    config = ModelConfig.from_dir(resolve_model_path(args.model))
    shapes = layer_shapes(config)
    head_shape = shapes.pop("lm_head")
    gen = torch.Generator().manual_seed(0)

    def packed(n: int, k: int) -> PackedWeight:
        weight = PackedWeight((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
        if weight.panels is None:
            raise SystemExit(
                f"oneDNN's layout of a [{n}, {k}] weight is not one linear_panels reads"
            )
        return weight

    layers = [
        {name: packed(*shape) for name, shape in shapes.items()}
        for _ in range(args.layers or config.num_hidden_layers)
    ]
    head = packed(*head_shape)
    print(
        f"{args.model}: {len(layers)} layers, bfloat16, {args.threads} thread(s), "
        f"median of {args.rounds} passes taking turns; panels of "
        + ", ".join(
            f"{name} {w.panels.block} x k blocks of {w.panels.k_block or 'all of K'}"
            for name, w in layers[0].items()
            if w.panels is not None
        )
    )
    print()
    print("| rows | layer | oneDNN ms | linear_panels ms | panels / oneDNN |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        step = [(name, weight) for layer in layers for name, weight in layer.items()]
        if rows <= 64:
            step.append(("lm_head", head))
        xs = {
            name: torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
            for name, weight in step
        }
        for name, weight in step[: len(shapes)] + step[-1:]:
            assert torch.equal(onednn(xs[name], weight), panels(xs[name], weight)), name
        times: dict[tuple[str, str], list[float]] = {}
        for turn in range(args.rounds):
            kernels = (("onednn", onednn), ("panels", panels))
            for kernel, fn in kernels if turn % 2 == 0 else kernels[::-1]:
                spent: dict[str, float] = {}
                for name, weight in step:
                    start = time.perf_counter()
                    fn(xs[name], weight)
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
                for name, seconds in spent.items():
                    times.setdefault((kernel, name), []).append(seconds)
        total = {"onednn": 0.0, "panels": 0.0}
        for name in dict.fromkeys(name for name, _ in step):
            ms = {k: statistics.median(times[(k, name)]) * 1e3 for k in total}
            for k in total:
                total[k] += ms[k]
            print(
                f"| {rows} | {name} | {ms['onednn']:.2f} | {ms['panels']:.2f} | "
                f"{ms['panels'] / ms['onednn']:.2f}x |"
            )
        print(
            f"| {rows} | **all** | {total['onednn']:.2f} | {total['panels']:.2f} | "
            f"**{total['panels'] / total['onednn']:.2f}x** |"
        )


if __name__ == "__main__":
    main()
