"""int8 linear layers at many rows (a prefill chunk, 64 decodes): the extension's int8_gemm
(a block of outputs at a time, rescaled while its products are in cache) against the three ops it
replaced (quantize_rows_int8, torch._int_mm on all rows, dequantize_rows) and against bfloat16
on oneDNN's packed weight, on a model's layer shapes, taking turns.

    python benchmarks/bench_int8_gemm.py [--model /work/models/qwen2-0.5b] [--rows 64,2048]
                                         [--threads 1] [--repeats 5]

Prints the best of --repeats per kernel, in ms. With --threads 1 (the default) it times the
thread's CPU time, which other processes on a shared machine barely move; with more threads,
wall time (take those on an idle machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from radixserve.model_worker.cpu_kernels import load_cpu_kernels
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.model_source import resolve_model_path
from radixserve.model_worker.quantization import Int8Weight
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


def kernels_for(
    int8: Int8Weight, packed: torch.Tensor, x: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    ops = torch.ops.radixserve
    xb = x.bfloat16()

    def three_ops() -> torch.Tensor:
        xq, x_scale = ops.quantize_rows_int8(x)
        products = torch._int_mm(xq, int8.q.t())
        return ops.dequantize_rows(products, x_scale, int8.scale, None)

    return {
        "three": three_ops,
        "gemm": lambda: ops.int8_gemm(x, int8.q, int8.scale, None),
        "bf16": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/qwen2-0.5b")
    parser.add_argument("--rows", default="64,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    keep_freed_memory()
    load_cpu_kernels()
    config = ModelConfig.from_dir(resolve_model_path(args.model))
    print(f"{args.model}, {args.threads} thread(s), best of {args.repeats}, ms\n")
    print("| layer | rows | three ops (before) | int8_gemm | bfloat16 oneDNN packed |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in layer_shapes(config).items():
        w = torch.randn(n, k, generator=gen) * 0.05
        int8 = Int8Weight(w)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
        del w
        for rows in (int(r) for r in args.rows.split(",")):
            if name == "lm_head" and rows > 64:
                continue  # a prefill computes the head on each prompt's last row only
            kernels = kernels_for(int8, packed, torch.randn(rows, k, generator=gen))
            assert torch.equal(kernels["three"](), kernels["gemm"]())
            times: dict[str, float] = {}
            for _ in range(2):  # two turns each, the best kept
                for kind, fn in kernels.items():
                    ms = best_ms(fn, args.repeats, clock)
                    times[kind] = min(times.get(kind, ms), ms)
            print(
                f"| {name} | {rows} | {times['three']:.2f} | {times['gemm']:.2f} "
                f"| {times['bf16']:.2f} |"
            )


if __name__ == "__main__":
    main()
