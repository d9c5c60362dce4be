"""A server's start and stop before and after a change, taking turns: how long until launch.py
says "radixserve ready", each process's peak RSS by then, and how long a SIGINT takes to end it
with nothing in flight.

    python benchmarks/bench_start_ab.py --baseline 8d51910 [--rounds 3] [--server-args "..."]

The baseline is the revision exported by `git archive`, the working tree is this checkout, each
imported ahead of any installed package (bench_served_ab.py's way). Each round starts, times and
stops one side's server, then the other's; the side that goes first alternates. Prints every
round, the medians and after / before. Wall time: take it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_scheduler_ab import REPO, export_revision
from serve_memory import process_name, process_tree, status_field

READY_LINE = "radixserve ready"


@dataclass
class Start:
    ready_s: float
    stop_s: float
    peak_rss: dict[str, float]  # GB by process name, at ready


def start_once(python_path: str, flags: list[str]) -> Start:
    env = dict(os.environ, PYTHONPATH=python_path)
    command = [sys.executable, "-m", "radixserve.launch", *flags]
    started = time.monotonic()
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if READY_LINE in line:
                break
        else:
            sys.exit(f"the server exited with {server.wait()} before it was ready")
        ready_s = time.monotonic() - started
        peak = {
            process_name(pid): status_field(pid, "VmHWM") / 1e9
            for pid in process_tree(server.pid)[1:]
        }
        stopping = time.monotonic()
        server.send_signal(signal.SIGINT)
        server.stdout.read()  # until every process that held it is gone
        server.wait(60)
        return Start(ready_s, time.monotonic() - stopping, peak)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision of the baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    args = parser.parse_args()
    flags = ["--port", "30131", "--http-port", "30831", *args.server_args.split()]
    results: dict[str, list[Start]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as before, tempfile.TemporaryDirectory() as after:
        export_revision(args.baseline, Path(before))
        (Path(after) / "radixserve").symlink_to(REPO)
        trees = {"before": before, "after": after}
        for round_ in range(args.rounds):
            for side in list(trees)[:: 1 if round_ % 2 == 0 else -1]:
                result = start_once(trees[side], flags)
                results[side].append(result)
                rss = ", ".join(f"{name} {gb:.2f}" for name, gb in sorted(result.peak_rss.items()))
                print(
                    f"round {round_ + 1} {side:6s}: ready {result.ready_s:5.2f} s, "
                    f"stop {result.stop_s:4.2f} s, peak RSS (GB) {rss}",
                    flush=True,
                )
    medians = {
        side: {
            "ready (s)": statistics.median(r.ready_s for r in rs),
            "stop (s)": statistics.median(r.stop_s for r in rs),
            "peak RSS, all processes (GB)": statistics.median(sum(r.peak_rss.values()) for r in rs),
        }
        for side, rs in results.items()
    }
    print(f"\n| median of {args.rounds} | before ({args.baseline}) | after | after / before |")
    print("|---|---|---|---|")
    for key in medians["before"]:
        b, a = medians["before"][key], medians["after"][key]
        print(f"| {key} | {b:.2f} | {a:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
