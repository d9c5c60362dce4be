"""The scheduler step before and after a change, in one run: bench_scheduler's decode-step
measurement of a git revision (the baseline) and of the working tree, taking turns.

    python benchmarks/bench_scheduler_ab.py --before dfa28d5 [--running 64 256 1024]
        [--rounds 8] [--steps 100] [--cpu-time]

Each measurement is a fresh process (streaming, one torch thread). The baseline is the revision
exported by `git archive`, imported ahead of the installed package. On a shared machine the two
sides see the same neighbours only if they alternate; --cpu-time counts this process's CPU time
instead of wall time, which the neighbours disturb less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MEASURE = """
import sys, time
if {cpu_time}:
    time.perf_counter = time.process_time
sys.path.insert(0, {benchmarks!r})
import torch
torch.set_num_threads(1)
from bench_scheduler import measure
print(measure({running}, {steps}))
"""


def export_revision(revision: str, root: Path) -> None:
    """The repository at `revision` (`git archive`), as root/radixserve: importable with root on
    PYTHONPATH, ahead of any installed package."""
    package = root / "radixserve"
    package.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)


def measure(root: Path | None, running: int, steps: int, cpu_time: bool) -> float:
    """µs per step of the tree at root (a directory holding the package as radixserve/), or of
    the installed working tree when root is None."""
    benchmarks = str((root / "radixserve" if root else REPO) / "benchmarks")
    env = dict(os.environ, PYTHONPATH=str(root)) if root else None
    code = MEASURE.format(cpu_time=cpu_time, benchmarks=benchmarks, running=running, steps=steps)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision of the baseline")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        export_revision(args.before, Path(tmp))
        timing = "CPU time" if args.cpu_time else "wall time"
        print(f"decode steps, streaming, {args.steps} steps, {args.rounds} rounds, {timing}\n")
        print(
            "| running | before µs / step (median, min) | after µs / step (median, min) "
            "| after / before |"
        )
        print("|---|---|---|---|")
        for n in args.running:
            before, after = [], []
            for _ in range(args.rounds):
                before.append(measure(Path(tmp), n, args.steps, args.cpu_time))
                after.append(measure(None, n, args.steps, args.cpu_time))
            b, a = statistics.median(before), statistics.median(after)
            print(
                f"| {n} | {b:.0f} ({min(before):.0f}) | {a:.0f} ({min(after):.0f}) | {a / b:.2f}x |"
            )


if __name__ == "__main__":
    main()
