"""A served run before and after a change, taking turns: the server of a git revision (the
baseline) and of the working tree, each started afresh for each round, under the same load.

    python benchmarks/bench_served_ab.py --baseline 5c50c83 [--model /work/models/qwen2-0.5b]
        [--dtype bfloat16] [--server-args "--quantization int8"] [--rounds 3]
        [--num-requests 64 --input-len 128 --output-len 128]
    python benchmarks/bench_served_ab.py --baseline HEAD --baseline-server-args ""
        --server-args "--quantization int8"   (two configurations of one revision)

Each round starts one side's server, sends every request at once over ZMQ (streaming, greedy,
bench_serving.run_load; the radix cache off, as bench_vs_peers runs it), stops it, then does the
same with the other side's; the side that goes first alternates. Prints each round's output
tokens per second and TTFT p50, their medians, and after / before (above 1x is faster for
throughput, below 1x for TTFT). The baseline is the revision exported by `git archive`, the
working tree is this checkout, each imported ahead of any installed package; the kernels build
into the one cache (keyed by their sources). Wall time: take it on an idle machine.
--baseline-server-args gives the baseline's server other flags than --server-args (by default
the same): two configurations of one revision, taking turns.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from bench_scheduler_ab import REPO, export_revision
from bench_serving import RunResult, make_prompts, run_load

from radixserve.client.local_server import launched_server


def serve_once(python_path: str, flags: list[str], prompts: list[list[int]], new: int) -> RunResult:
    """Start the server of the tree on python_path (a directory holding it as radixserve/), run
    the load, stop it."""
    command = ("env", f"PYTHONPATH={python_path}", sys.executable, "-m", "radixserve.launch")
    with launched_server(*flags, command=command, start_timeout=600) as server:
        return asyncio.run(run_load(server.address, prompts, new))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision of the baseline")
    parser.add_argument("--model", default=None, help="default: the server's default model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    parser.add_argument(
        "--baseline-server-args", default=None, help="the baseline's, if not --server-args"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    common = ["--dtype", args.dtype, "--disable-radix-cache"]
    if args.model:
        common += ["--model", args.model]
    baseline = args.server_args if args.baseline_server_args is None else args.baseline_server_args
    flags = {
        "before": [*common, *baseline.split()],
        "after": [*common, *args.server_args.split()],
    }
    prompts = make_prompts(args.num_requests, args.input_len, 49152)  # the default tokenizer's
    results: dict[str, list[RunResult]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as before, tempfile.TemporaryDirectory() as after:
        export_revision(args.baseline, Path(before))
        (Path(after) / "radixserve").symlink_to(REPO)
        trees = {"before": before, "after": after}
        print(
            f"{args.model or 'the default model'}; {args.num_requests} at once x"
            f" {args.input_len}/{args.output_len}; before: {args.baseline}"
            f" ({' '.join(flags['before'])}), after: the working tree"
            f" ({' '.join(flags['after'])})\n"
        )
        print("| round | side | output tok/s | TTFT p50 (s) |")
        print("|---|---|---|---|")
        for r in range(1, args.rounds + 1):
            for side in ("before", "after") if r % 2 else ("after", "before"):
                run = serve_once(trees[side], flags[side], prompts, args.output_len)
                results[side].append(run)
                ttft = statistics.median(run.ttfts)
                print(f"| {r} | {side} | {run.throughput:.1f} | {ttft:.2f} |", flush=True)
    medians = {
        side: (
            statistics.median(r.throughput for r in runs),
            statistics.median(statistics.median(r.ttfts) for r in runs),
        )
        for side, runs in results.items()
    }
    for side, (tok_s, ttft) in medians.items():
        print(f"- {side} (medians over rounds): {tok_s:.1f} tok/s, TTFT p50 {ttft:.2f} s")
    (b_tok, b_ttft), (a_tok, a_ttft) = medians["before"], medians["after"]
    print(f"- after / before: throughput {a_tok / b_tok:.3f}x, TTFT p50 {a_ttft / b_ttft:.2f}x")


if __name__ == "__main__":
    main()
