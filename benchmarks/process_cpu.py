"""The serving processes' own CPU time per generated token, on a real server.

    python benchmarks/process_cpu.py [--model /work/models/qwen2-0.5b] [--dtype bfloat16]
        [--num-requests 64 --input-len 128 --output-len 128 --rounds 2]
        [--server-args "--enable-overlap-schedule"]

Starts a server, warms it up, then sends --num-requests streamed greedy requests at once
(random-id prompts, ignore_eos) over the ZMQ wire, --rounds times. Around each round it reads
every server process's and thread's user + system CPU time from /proc/<pid>/task/<tid>/stat
and prints, per process, CPU milliseconds per generated token and per decode step (a step makes
--num-requests tokens), and the share of the round's wall time. On a 2-core box whatever the
tokenizer manager, the detokenizer and the scheduler's Python spend is taken from the forward.

The scheduler's time is split into its main thread (the event loop, batch building, output
processing, and its share of the forward's OpenMP work) and its other threads (the OpenMP
workers, the overlap thread). With 2 OpenMP threads, main minus the workers bounds from below
what the scheduler spends outside the forward's parallel regions (a waiting worker spins a
while, and that counts as its CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from pathlib import Path

from bench_serving import make_prompts

from radixserve.client import AsyncClient
from radixserve.client.local_server import LaunchedServer, launched_server
from radixserve.model_worker.model_source import resolve_model_path

TICKS = os.sysconf("SC_CLK_TCK")


def server_pids(server: LaunchedServer) -> dict[str, int]:
    """Each server process's pid by name, from launch.py's log, and the launcher's."""
    deadline = time.monotonic() + 30
    while "radixserve ready" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)  # a client may be served a moment before the last child is logged
    ready = re.findall(r"(\w+) is ready \(pid (\d+)\)", server.log())
    return {**{name: int(pid) for name, pid in ready}, "launcher": server.proc.pid}


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far (threads that ended are not counted)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        times[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    return times


def snapshot(pids: dict[str, int]) -> dict[str, dict[int, float]]:
    return {name: thread_cpu_s(pid) for name, pid in pids.items()}


def usage(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], pids: dict[str, int]
) -> dict[str, float]:
    """CPU seconds between two snapshots, per process, and the scheduler's main thread apart."""
    spent: dict[str, float] = {}
    for name, threads in after.items():
        deltas = {tid: t - before[name].get(tid, 0.0) for tid, t in threads.items()}
        spent[name] = sum(deltas.values())
        if name == "scheduler":
            main = deltas.get(pids[name], 0.0)
            spent["  scheduler main thread"] = main
            spent["  scheduler other threads"] = spent[name] - main
    return spent


async def one_round(client: AsyncClient, prompts: list[list[int]], new: int) -> int:
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}

    async def one(ids: list[int]) -> int:
        tokens = 0
        async for chunk in client.stream(input_ids=ids, sampling_params=params):
            tokens += len(chunk.output_ids)
        return tokens

    return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-args", default="", help="extra radixserve flags, one string")
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    prompts = make_prompts(args.num_requests, args.input_len, vocab=32000)
    flags = ["--model", model_dir, "--disable-radix-cache", "--dtype", args.dtype]
    with launched_server(*flags, *args.server_args.split()) as server:
        pids = server_pids(server)

        async def rounds() -> list[tuple[float, int, dict[str, float]]]:
            results = []
            async with AsyncClient(server.address, timeout=3600) as client:
                await one_round(client, prompts[:8], 16)  # warm-up
                for _ in range(args.rounds):
                    before, start = snapshot(pids), time.perf_counter()
                    tokens = await one_round(client, prompts, args.output_len)
                    wall = time.perf_counter() - start
                    results.append((wall, tokens, usage(before, snapshot(pids), pids)))
            return results

        results = asyncio.run(rounds())
    print(
        f"{args.num_requests} requests at once x {args.input_len}/{args.output_len}, "
        f"--dtype {args.dtype} {args.server_args}"
    )
    for i, (wall, tokens, spent) in enumerate(results):
        print(f"\nround {i + 1}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.0f} tok/s)")
        print(f"  {'process':28s} {'ms/token':>9s} {'ms/step':>9s} {'% of wall':>9s}")
        for name, cpu in spent.items():
            per_token = cpu / tokens * 1e3
            print(
                f"  {name:28s} {per_token:9.3f} {per_token * args.num_requests:9.2f} "
                f"{cpu / wall * 100:9.1f}"
            )


if __name__ == "__main__":
    main()
