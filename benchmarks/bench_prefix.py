"""Prefix-cache benchmark: N requests sharing a long system prompt, each with its own question,
run with the radix cache on and with --disable-radix-cache, in the same run.

    python benchmarks/bench_prefix.py [--num-requests 64 --system-len 1024 --question-len 32]

Prints prefill tokens computed, TTFT p50/p99 and output tok/s for each, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench_serving import RunResult, make_prompts, print_table, run_load

from radixserve.client import Client
from radixserve.client.local_server import launched_server
from radixserve.model_worker.model_source import resolve_model_path


def run(args: argparse.Namespace, prompts: list[list[int]], cache: bool) -> tuple[RunResult, int]:
    flags = ["--model", args.model, "--dtype", args.dtype, *args.server_args.split()]
    if not cache:
        flags.append("--disable-radix-cache")
    name = "radix cache on" if cache else "--disable-radix-cache"
    with launched_server(*flags) as server:
        result = asyncio.run(run_load(server.address, prompts, args.output_len, name))
        with Client(server.address, timeout=60) as c:
            prefill_tokens = c.server_info().num_prefill_tokens
    return result, prefill_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(resolve_model_path(args.model)))
    (system,) = make_prompts(1, args.system_len, vocab, seed=1)
    questions = make_prompts(args.num_requests, args.question_len, vocab, seed=2)
    prompts = [system + q for q in questions]

    on, on_prefill = run(args, prompts, cache=True)
    off, off_prefill = run(args, prompts, cache=False)
    print(
        f"\n{args.num_requests} requests x ({args.system_len} shared + {args.question_len} own "
        f"prompt tokens, {args.output_len} new tokens), {args.dtype}\n"
    )
    rows = [[*on.row(), str(on_prefill)], [*off.row(), str(off_prefill)]]
    header_extra = "prefill tokens computed"
    print_table(rows, extra=[header_extra])
    tput = on.throughput / off.throughput
    ttft = statistics.median(off.ttfts) / statistics.median(on.ttfts)
    print(
        f"\ncache on / off: prefill tokens {on_prefill / off_prefill:.1%}, "
        f"TTFT p50 {ttft:.1f}x lower, throughput {tput:.2f}x"
    )


if __name__ == "__main__":
    main()
