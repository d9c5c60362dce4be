"""Overlap scheduling on and off: two servers on the same model, taking turns in one run (or,
with --compare fused-layers, cpu_extension's decoder layers in one call and as modules op by op).

    python benchmarks/bench_overlap.py [--rounds 3 --num-requests 64 --input-len 128
                                        --output-len 128 --latency-requests 8]
                                       [--dtype float32] [--server-args "--device cuda"]
                                       [--compare fused-layers]

Each round runs, on each server in turn (which goes first alternates): 64 streaming greedy
requests at once (throughput), then requests one at a time (latency: ITL at concurrency 1).
The idle server sleeps on its sockets meanwhile. First, both servers answer the same greedy
prompts, which must come back token for token the same. On a shared machine one run can be 10%
off the next: compare the medians, and the per-round ratios beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from contextlib import ExitStack

from bench_serving import RunResult, make_prompts, print_table, run_load

from radixserve.client import AsyncClient
from radixserve.client.local_server import launched_server
from radixserve.model_worker.model_source import resolve_model_path

# The two servers of each comparison: name -> flags; the ratios are first / second.
COMPARISONS = {
    "overlap": {
        "overlap": ["--enable-overlap-schedule"],
        "no overlap": ["--disable-overlap-schedule"],
    },
    "fused-layers": {"fused layers": [], "modules": ["--disable-fused-layers"]},
}


async def greedy_outputs(address: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = {"max_new_tokens": n, "temperature": 0}
    async with AsyncClient(address, timeout=1800) as c:
        replies = await asyncio.gather(
            *(c.generate(input_ids=p, sampling_params=params) for p in prompts)
        )
    return [r.output_ids for r in replies]


def one_at_a_time(address: str, prompts: list[list[int]], output_len: int, name: str) -> RunResult:
    runs = [asyncio.run(run_load(address, [p], output_len, name)) for p in prompts]
    return RunResult(
        name=name,
        duration=sum(r.duration for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        ttfts=[t for r in runs for t in r.ttfts],
        itls=[t for r in runs for t in r.itls],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--latency-requests", type=int, default=8)
    parser.add_argument("--equality-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    parser.add_argument("--compare", choices=list(COMPARISONS), default="overlap")
    args = parser.parse_args()
    modes = COMPARISONS[args.compare]
    first, second = modes

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(resolve_model_path(args.model)))
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    latency_prompts = make_prompts(args.latency_requests, args.input_len, vocab, seed=1)
    equality_prompts = make_prompts(args.equality_prompts, args.input_len, vocab, seed=2)
    # No prefix cache: each run computes its prompts, as the first one did.
    common = ["--model", args.model, "--dtype", args.dtype, "--disable-radix-cache"]
    common += args.server_args.split()
    with ExitStack() as stack:
        servers = {
            mode: stack.enter_context(launched_server(*common, *flags))
            for mode, flags in modes.items()
        }
        outputs = {
            mode: asyncio.run(greedy_outputs(s.address, equality_prompts, 64))
            for mode, s in servers.items()
        }
        same = sum(a == b for a, b in zip(*outputs.values()))
        results: dict[str, list[RunResult]] = {}
        for round_ in range(args.rounds):
            for mode in list(servers)[:: 1 if round_ % 2 == 0 else -1]:
                address = servers[mode].address
                name = f"{mode}, {args.num_requests} at once"
                result = asyncio.run(run_load(address, prompts, args.output_len, name))
                results.setdefault(name, []).append(result)
                name = f"{mode}, one at a time"
                result = one_at_a_time(address, latency_prompts, args.output_len, name)
                results.setdefault(name, []).append(result)

    print(
        f"\n{args.num_requests} requests at once and {args.latency_requests} one at a time, "
        f"{args.input_len} prompt + {args.output_len} new tokens, greedy, {args.dtype}, "
        f"{args.rounds} rounds\n"
    )
    print(f"greedy outputs equal on {same} of {len(equality_prompts)} prompts (64 tokens each)\n")
    print_table(
        [
            [f"{name}, round {i + 1}", *r.row()[1:]]
            for name, rs in results.items()
            for i, r in enumerate(rs)
        ]
    )
    print()
    for load in (f"{args.num_requests} at once", "one at a time"):
        on, off = results[f"{first}, {load}"], results[f"{second}, {load}"]
        tput = statistics.median(r.throughput for r in on) / statistics.median(
            r.throughput for r in off
        )
        itl = statistics.median(statistics.median(r.itls) for r in on) / statistics.median(
            statistics.median(r.itls) for r in off
        )
        rounds = ", ".join(f"{a.throughput / b.throughput:.3f}" for a, b in zip(on, off))
        print(
            f"{load}: throughput {first} / {second} {tput:.3f}x (medians; per round {rounds}), "
            f"ITL p50 {first} / {second} {itl:.3f}x"
        )


if __name__ == "__main__":
    main()
