"""The CPU extension's paged attention on a decode step, alone: what a layer costs and the rate
at which it reads K and V, from memory and again with them in cache.

    python benchmarks/bench_attention.py [--batch 64 --context 135 --head-dim 64]

SmolLM2's heads by default (9 query, 3 KV). One decode token for each of --batch sequences,
each at --context cached tokens, over 30 layers' pools (so that a layer's K and V are not in
cache when it runs), on slots laid out two ways: each sequence's in a row (a prompt prefilled
at once) and shuffled (decode steps interleave the sequences' slots). Then one layer again and
again: the same work with K and V in cache, i.e. the arithmetic alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.model_worker.cpu_kernels import load_cpu_kernels

LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=135)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_cpu_kernels()
    attention = torch.ops.radixserve.paged_attention.default
    b, ctx, d = args.batch, args.context, args.head_dim
    num_slots = b * (ctx + 1) + 1  # slot 0 is padding
    gen = torch.Generator().manual_seed(0)
    k_pool = [torch.randn(num_slots, args.kv_heads, d, generator=gen) for _ in range(LAYERS)]
    v_pool = [torch.randn(num_slots, args.kv_heads, d, generator=gen) for _ in range(LAYERS)]
    q = torch.randn(b, args.heads, d, generator=gen)
    k, v = torch.randn(b, args.kv_heads, d), torch.randn(b, args.kv_heads, d)
    prefix, extend = torch.full((b,), ctx), torch.ones(b, dtype=torch.int64)
    kv_bytes = b * (ctx + 1) * args.kv_heads * d * 4 * 2
    print(
        f"{b} decodes at context {ctx}, heads {args.heads}/{args.kv_heads}x{d}, float32, "
        f"threads {torch.get_num_threads()}; {kv_bytes / 1e6:.1f} MB of K and V a layer\n"
    )
    print("| slots | from memory (ms/layer) | GB/s | in cache (ms/layer) |")
    print("|---|---|---|---|")
    for layout in ("in a row", "shuffled"):
        order = torch.arange(1, num_slots)
        if layout == "shuffled":
            order = order[torch.randperm(num_slots - 1, generator=gen)]
        kv_slots = order.view(b, ctx + 1).contiguous()
        loc = kv_slots[:, -1].contiguous()
        layers = [
            (q, k, v, k_pool[i], v_pool[i], loc, kv_slots, prefix, extend, d**-0.5)
            for i in range(LAYERS)
        ]
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for layer in layers:
                attention(*layer)
            best = min(best, (time.perf_counter() - start) / LAYERS)
        start = time.perf_counter()
        for _ in range(LAYERS):
            attention(*layers[0])
        cached = (time.perf_counter() - start) / LAYERS
        print(f"| {layout} | {best * 1e3:.3f} | {kv_bytes / best / 1e9:.1f} | {cached * 1e3:.3f} |")


if __name__ == "__main__":
    main()
