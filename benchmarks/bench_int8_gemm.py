"""int8 linear layers on a model's layer shapes, taking turns in one process: the VNNI kernel on
its own weight layout (int8_vnni_linear, where the CPU has AVX512-VNNI) against the plain layout's
path (int8_linear below 9 rows, oneDNN's int8 matmul in int8_gemm from there on), and bfloat16 on
oneDNN's packed weight; with --peak, what a loop of independent vpdpbusd reaches on this core;
with --one-row-cold, one row through every decoder layer's linears in turn, as a decode step of
one sequence reads them (from memory, not from the cache a layer's repeats keep them in); with
--cold-rows N, N rows through each shape's VNNI linear, every layer's own weight in turn (cold)
against one layer's weight as many times (hot); with --silu-and-mul-rows, an MLP's gate_up and
SwiGLU on the VNNI layout in one pass (int8_vnni_linear_silu_and_mul) against two
(int8_vnni_linear, then silu_and_mul), every layer's weight in turn, bfloat16 rows.

    python benchmarks/bench_int8_gemm.py [--model /work/models/qwen2-0.5b]
                                         [--rows 1,8,16,64,256,2048] [--threads 1] [--repeats 5]
                                         [--peak] [--one-row-cold] [--cold-rows 64]
                                         [--silu-and-mul-rows 64,2048]

Prints the best of --repeats per kernel (two turns each), in ms and GOPS (2 x multiply-adds),
and plain / VNNI. With --threads 1 (the default) it times the thread's CPU time, which other
processes on a shared machine barely move; with more threads, wall time (take those on an idle
machine). Pin it (`taskset -c 1`) for one-thread figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from compute_roof import core_peak_macs

from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.int8_weight import Int8Weight, int8_small_rows, vnni_kernel_available
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.process_setup import keep_freed_memory


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each linear layer of a decoder layer, and the LM head."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return {
        "qkv_proj": (qkv, hidden),
        "o_proj": (hidden, config.num_attention_heads * head_dim),
        "gate_up_proj": (2 * config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
        "lm_head": (config.vocab_size, hidden),
    }


def best_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


def one_row_cold(config: ModelConfig, turns: int = 30) -> None:
    """Every layer's four linears in both layouts (both held: 2 x the model's int8 linears), one
    row through each layout's in turn; the median of `turns` passes."""
    gen = torch.Generator().manual_seed(1)
    shapes = [s for name, s in layer_shapes(config).items() if name != "lm_head"]
    layers: dict[bool, list[Int8Weight]] = {True: [], False: []}
    for _ in range(config.num_hidden_layers):
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.05
            for vnni in layers:
                layers[vnni].append(Int8Weight(w, vnni=vnni))
    rows = {k: torch.randn(1, k, generator=gen) for _, k in shapes}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(turns):
        for vnni, weights in layers.items():
            start = time.thread_time()
            for weight in weights:
                weight.matmul(rows[weight.shape[1]], None)
            times[vnni].append(time.thread_time() - start)
    plain, vnni = (statistics.median(times[v]) * 1e3 for v in (False, True))
    print(
        f"one row through {len(layers[True])} linears in turn, median of {turns}: plain "
        f"{plain:.2f} ms, VNNI {vnni:.2f} ms, plain / VNNI {plain / vnni:.2f}x"
    )


def kernels_for(
    plain: Int8Weight, vnni: Int8Weight | None, packed: torch.Tensor, x: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    xb = x.bfloat16()
    kernels = {"plain": lambda: plain.matmul(x, None)}
    if vnni is not None:
        kernels["vnni"] = lambda: vnni.matmul(x, None)
    kernels["bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")
    return kernels


def matmul_each(weights: list[Int8Weight], x: torch.Tensor) -> list[torch.Tensor]:
    return [w.matmul(x, None) for w in weights]


def cold_and_hot(config: ModelConfig, rows: int, repeats: int, clock: Callable[[], float]) -> None:
    """Per decoder-layer shape, the VNNI linear on `rows` rows over every layer's own weight in
    turn (cold: from memory, as a step reads them) and over the first layer's as many times
    (hot), ms a call, the best of `repeats` passes in two turns each."""
    gen = torch.Generator().manual_seed(2)
    print(f"{rows} rows through {config.num_hidden_layers} layers' VNNI linears:")
    for name, (n, k) in layer_shapes(config).items():
        if name == "lm_head":
            continue  # one per step: never hot
        weights = [
            Int8Weight(torch.randn(n, k, generator=gen) * 0.05, vnni=True)
            for _ in range(config.num_hidden_layers)
        ]
        x = torch.randn(rows, k, generator=gen).bfloat16()
        ms: dict[str, float] = {}
        for _ in range(2):
            for mode, seq in (("hot", [weights[0]] * len(weights)), ("cold", weights)):
                t = best_ms(functools.partial(matmul_each, seq, x), repeats, clock) / len(seq)
                ms[mode] = min(ms.get(mode, t), t)
        print(
            f"  {name}: hot {ms['hot']:.3f} ms, cold {ms['cold']:.3f} ms, "
            f"cold / hot {ms['cold'] / ms['hot']:.2f}x"
        )


def two_passes(weights: list[Int8Weight], x: torch.Tensor) -> list[torch.Tensor]:
    return [torch.ops.radixserve.silu_and_mul(w.matmul(x, None)) for w in weights]


def one_pass(weights: list[Int8Weight], x: torch.Tensor) -> list[torch.Tensor]:
    op = torch.ops.radixserve.int8_vnni_linear_silu_and_mul
    return [op(x, w.q, w.scale, None) for w in weights]


def silu_and_mul_passes(
    config: ModelConfig, rows_list: list[int], repeats: int, clock: Callable[[], float]
) -> None:
    """gate_up then SwiGLU over every layer's own gate_up weight in turn, ms a layer: two passes
    against one, the best of `repeats` in two turns each."""
    gen = torch.Generator().manual_seed(3)
    n, k = layer_shapes(config)["gate_up_proj"]
    weights = [
        Int8Weight(torch.randn(n, k, generator=gen) * 0.05, vnni=True)
        for _ in range(config.num_hidden_layers)
    ]
    print(f"gate_up and SwiGLU ({n} x {k}), {len(weights)} layers' weights in turn:")
    print("| rows | two passes ms | one pass ms | one / two |")
    print("|---|---|---|---|")
    for rows in rows_list:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        ms: dict[str, float] = {}
        for _ in range(2):
            for name, fn in (("two", two_passes), ("one", one_pass)):
                t = best_ms(functools.partial(fn, weights, x), repeats, clock) / len(weights)
                ms[name] = min(ms.get(name, t), t)
        print(f"| {rows} | {ms['two']:.3f} | {ms['one']:.3f} | {ms['one'] / ms['two']:.3f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/qwen2-0.5b")
    parser.add_argument("--rows", default="1,8,16,64,256,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak", action="store_true", help="time a vpdpbusd loop first")
    parser.add_argument("--one-row-cold", action="store_true", help="then one row, every layer")
    parser.add_argument("--cold-rows", type=int, default=0, help="then N rows, cold and hot")
    parser.add_argument(
        "--silu-and-mul-rows", default="", help="then gate_up and SwiGLU: one pass against two"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    keep_freed_memory()
    load_cpu_kernels()
    config = ModelConfig.from_dir(resolve_model_path(args.model))
    has_vnni = vnni_kernel_available()
    print(f"{args.model}, {args.threads} thread(s), best of {args.repeats} in two turns")
    print(f"plain: int8_linear below {int8_small_rows()} rows, int8_gemm from there on")
    if args.peak and has_vnni:
        peak = core_peak_macs("int8")
        assert peak is not None  # has_vnni
        print(f"vpdpbusd loop, one thread: {2 * peak / 1e9:.0f} GOPS")
    if not has_vnni:
        print("no AVX512-VNNI here: the VNNI columns stay empty")
    else:
        if args.one_row_cold:
            one_row_cold(config)
        if args.cold_rows:
            cold_and_hot(config, args.cold_rows, args.repeats, clock)
        if args.silu_and_mul_rows:
            rows_list = [int(r) for r in args.silu_and_mul_rows.split(",")]
            silu_and_mul_passes(config, rows_list, args.repeats, clock)
    print()
    print("| layer | rows | plain ms | VNNI ms | bf16 ms | plain GOPS | VNNI GOPS | plain / VNNI |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in layer_shapes(config).items():
        w = torch.randn(n, k, generator=gen) * 0.05
        plain = Int8Weight(w, vnni=False)
        vnni = Int8Weight(w, vnni=True) if has_vnni else None
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
        del w
        for rows in (int(r) for r in args.rows.split(",")):
            if name == "lm_head" and rows > 64:
                continue  # a prefill computes the head on each prompt's last row only
            kernels = kernels_for(plain, vnni, packed, torch.randn(rows, k, generator=gen))
            if vnni is not None:
                assert torch.equal(kernels["plain"](), kernels["vnni"]())
            times: dict[str, float] = {}
            for _ in range(2):  # two turns each, the best kept
                for kind, fn in kernels.items():
                    ms = best_ms(fn, args.repeats, clock)
                    times[kind] = min(times.get(kind, ms), ms)
            gops = {kind: 2 * rows * n * k / ms / 1e6 for kind, ms in times.items()}
            new = times.get("vnni")
            print(
                f"| {name} | {rows} | {times['plain']:.3f} | "
                + ("" if new is None else f"{new:.3f}")
                + f" | {times['bf16']:.3f} | {gops['plain']:.0f} | "
                + ("" if new is None else f"{gops['vnni']:.0f}")
                + " | "
                + ("" if new is None else f"{times['plain'] / new:.2f}x")
                + " |"
            )


if __name__ == "__main__":
    main()
