"""Replays an issue's regression tests on the code from before its fixes, and on this tree: each
must fail there, for its bug's reason, and pass here. tests/replay_issue13.py and
tests/replay_issue22.py list their cases and call `main`.

It checks the commit before the fixes out into a throwaway git worktree, puts this tree's tests/
over its tests/, and runs each test in a pytest of its own, first on that tree and then on this
one, each tree first on PYTHONPATH as `radixserve` (pytest's header says which one it imported,
and the replay checks it). A failure counts as red only when its message names the bug (`why`,
a regex searched in the whole message): an ImportError, a missing flag or a fixture that cannot
start is not. Exits 1 unless every test is red, then green.

The old tree builds its CPU kernels in a cache of its own (the variable RADIXSERVE_KERNEL_CACHE
with "-before-<commit>" added, kept between replays), so neither tree's build is redone or
clobbered by the other's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASE_TIMEOUT_S = 900  # a pytest that runs longer hangs: each test bounds its own waits below
DEFAULT_KERNEL_CACHE = Path.home() / ".cache" / "radixserve" / "kernels"


@dataclass(frozen=True)
class Case:
    bullet: str  # the issue's first list, in its words
    test: str  # pytest node id from the repository root
    why: str  # what the failure on the old code must say (a regex)


@dataclass(frozen=True)
class Outcome:
    result: str  # passed, failed, error, skipped, timeout
    message: str  # the failure's whole message, or why the run says nothing

    def short(self, why: str = "") -> str:
        """The result and the message's line that `why` finds (else its first line)."""
        lines = self.message.strip().splitlines()
        found = [line for line in lines if why and re.search(why, line)]
        shown = (found or lines or [""])[0].strip()
        return self.result if not shown else f"{self.result}: {shown[:60]}"


def run_test(tree: Path, test: str, scratch: Path, env: dict[str, str]) -> Outcome:
    """One pytest, in `tree`, importing `radixserve` from `tree`, with `env` added."""
    path_dir = scratch / f"path-{tree.name}"
    if not path_dir.exists():
        path_dir.mkdir()
        (path_dir / "radixserve").symlink_to(tree, target_is_directory=True)
    report = scratch / "report.xml"
    report.unlink(missing_ok=True)
    pythonpath = [str(path_dir), *filter(None, [os.environ.get("PYTHONPATH")])]
    # -m "": every test, the replay_only ones too (pyproject's addopts leaves those out).
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", ""]
    command.append(f"--junitxml={report}")
    try:
        done = subprocess.run(
            [*command, test],
            cwd=tree,
            env=os.environ | env | {"PYTHONPATH": os.pathsep.join(pythonpath)},
            capture_output=True,
            text=True,
            timeout=CASE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Outcome("timeout", f"still running after {CASE_TIMEOUT_S} s")
    imported = re.search(r"^radixserve: (.+)$", done.stdout, re.MULTILINE)
    if imported is None or Path(imported.group(1)).resolve() != tree.resolve():
        found = imported.group(1) if imported else "nothing said"
        return Outcome("error", f"radixserve not imported from {tree} ({found})")
    return junit_outcome(report, done.stdout)


def junit_outcome(report: Path, stdout: str) -> Outcome:
    if not report.exists():
        return Outcome("error", stdout.strip().splitlines()[-1] if stdout.strip() else "no report")
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = [_case_outcome(case) for case in cases]
    if len(outcomes) != 1:
        return Outcome("error", f"{len(outcomes)} test cases ran, not one")
    return outcomes[0]


def _case_outcome(case: ET.Element) -> Outcome:
    for kind in ("error", "failure", "skipped"):
        found = case.find(kind)
        if found is not None:
            message = (found.get("message") or "").strip()
            return Outcome({"failure": "failed"}.get(kind, kind), message)
    return Outcome("passed", "")


@dataclass(frozen=True)
class Row:
    case: Case
    before: Outcome
    after: Outcome

    @property
    def red_then_green(self) -> bool:
        red = self.before.result == "failed" and re.search(self.case.why, self.before.message)
        return bool(red) and self.after.result == "passed"


def old_tree(commit: str, scratch: Path) -> Path:
    """`commit` checked out at scratch/before, with this tree's tests/ in place of its own."""
    tree = scratch / "before"
    git = ["git", "-C", str(REPO)]
    subprocess.run([*git, "worktree", "add", "--detach", str(tree), commit], check=True)
    shutil.rmtree(tree / "tests")
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
    shutil.copytree(REPO / "tests", tree / "tests", ignore=ignore)
    return tree


def print_table(rows: list[Row], commit: str, issue: int) -> None:
    print(f"\nbefore = {commit} (no issue {issue} fix), after = {REPO}")
    header = ("bullet", "test", "before", "after", "red, then green")
    lines = [header] + [
        (
            r.case.bullet,
            r.case.test.split("::")[-1],
            r.before.short(r.case.why),
            r.after.short(),
            "yes" if r.red_then_green else "NO",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def old_tree_env(commit: str) -> dict[str, str]:
    """The old tree's own kernel cache, beside this tree's."""
    cache = Path(os.environ.get("RADIXSERVE_KERNEL_CACHE", DEFAULT_KERNEL_CACHE))
    return {"RADIXSERVE_KERNEL_CACHE": f"{cache}-before-{commit}"}


def run_cases(cases: Sequence[Case], before_commit: str, issue: int) -> list[Row]:
    """Each case on `before_commit` with this tree's tests/, then on this tree."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"replay-issue{issue}-") as name:
        scratch = Path(name)
        try:
            before = old_tree(before_commit, scratch)
            before_env = old_tree_env(before_commit)
            for case in cases:
                print(f"{case.test} ...", flush=True)
                rows.append(
                    Row(
                        case,
                        run_test(before, case.test, scratch, before_env),
                        run_test(REPO, case.test, scratch, {}),
                    )
                )
                before_line, after_line = rows[-1].before.short(case.why), rows[-1].after.short()
                print(f"  before: {before_line}\n  after:  {after_line}")
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(scratch / "before")],
                check=False,
            )
    return rows


def main(
    cases: Sequence[Case],
    before_commit: str,
    issue: int,
    doc: str,
    not_replayable: Sequence[tuple[str, str]] = (),
) -> int:
    """The command line of a replay_issueN.py: `--only` picks the tests whose id has it (any of
    them, given more than once).
    `not_replayable` (bullet, why) are printed after the table."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--before", default=before_commit, help="the commit before the fixes")
    parser.add_argument(
        "--only", action="append", help="replay only the tests whose id has this (repeatable)"
    )
    args = parser.parse_args()
    only = args.only or [""]
    chosen = [case for case in cases if any(part in case.test for part in only)]
    rows = run_cases(chosen, args.before, issue)
    print_table(rows, args.before, issue)
    for bullet, why in not_replayable:
        print(f"not replayable: {bullet}: {why}")
    return 0 if rows and all(row.red_then_green for row in rows) else 1
