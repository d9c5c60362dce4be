"""Replays issue 13's regression tests on the code from before its fixes, and on this tree: each
must fail there, for its bug's reason, and pass here.

    python tests/replay_issue13.py [--before c54c254] [--only SUBSTRING]

It checks `--before` out into a throwaway git worktree, puts this tree's tests/ over its tests/,
and runs each test in a pytest of its own, first on that tree and then on this one, each tree
first on PYTHONPATH as `radixserve` (pytest's header says which one it imported, and the replay
checks it). A failure counts as red only when its message names the bug (`why`): an ImportError,
a missing flag or a fixture that cannot start is not. Exits 1 unless every test is red, then
green.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE = "c54c254"  # the namespace move: main's last commit before any fix of issue 13
CASE_TIMEOUT_S = 600  # a pytest that runs longer hangs: each test bounds its own waits far below

R = "tests/regressions/"
TM = "tests/test_tokenizer_manager.py::"
PAST_RANGE = (
    R + "test_values_past_range.py::test_a_value_past_its_range_is_refused_and_the_server_lives"
)
UNBOUNDED = R + "test_unbounded_input.py::"


@dataclass(frozen=True)
class Case:
    bullet: str  # issue 13's first list, in its words
    test: str  # pytest node id from the repository root
    why: str  # what the failure on the old code must say (a regex)


CASES = [
    Case("one request kills the server", PAST_RANGE + "[seed]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[top_k]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[top_logprobs_num]", "server exited"),
    Case("one request kills the server", PAST_RANGE + "[n]", "n out of its range was accepted"),
    Case(
        "livelock on an oversized max_new_tokens",
        "tests/test_scheduler.py::"
        "test_max_new_tokens_past_context_is_admitted_even_with_a_pessimistic_reserve",
        "did not finish: deadlock or livelock",
    ),
    Case(
        "errors lose their rid",
        R + "test_error_rid.py::test_a_request_failing_validation_is_refused_with_its_rid",
        "does not say which request failed",
    ),
    Case(
        "a reused rid races a stop-string finish",
        TM + "test_a_reused_rid_never_reaches_the_old_completion",
        r"assert 'x' != 'x'",
    ),
    Case(
        "disconnects go unseen",
        TM + "test_a_client_that_went_away_has_its_requests_aborted",
        "never aborted",
    ),
    Case(
        "disconnects go unseen",
        TM + "test_a_slow_reader_gets_every_reply_in_the_end",
        "replies lost, the final one too",
    ),
    Case(
        "disconnects go unseen",
        R + "test_client_default_timeout.py::test_the_sync_client_never_waits_forever_by_default",
        "waits forever",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_oversized_stop_strings_are_refused[stop-length]",
        "stop out of its range was accepted",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_oversized_stop_strings_are_refused[stop-count]",
        "stop out of its range was accepted",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_an_oversized_rid_is_refused_without_echoing_it",
        "100,000-character rid ran",
    ),
    Case(
        "unbounded input",
        TM + "test_a_frame_over_the_size_limit_is_never_held",
        "the frame was held",
    ),
    Case(
        "unbounded input",
        UNBOUNDED + "test_past_the_default_queue_cap_requests_are_overloaded",
        "no queue cap",
    ),
    Case(
        "unbounded input",
        TM + "test_a_long_prompt_in_the_tokenizer_stalls_nobody",
        "waited for the long prompt",
    ),
    Case(
        "no watchdog for a hung child",
        R + "test_watchdog.py::test_a_hung_server_process_takes_the_server_down",
        "no watchdog",
    ),
]


@dataclass(frozen=True)
class Outcome:
    result: str  # passed, failed, error, skipped, timeout
    message: str  # the failure's first line, or why the run says nothing

    def short(self) -> str:
        return self.result if not self.message else f"{self.result}: {self.message[:60]}"


def run_test(tree: Path, test: str, scratch: Path) -> Outcome:
    """One pytest, in `tree`, importing `radixserve` from `tree`."""
    path_dir = scratch / f"path-{tree.name}"
    if not path_dir.exists():
        path_dir.mkdir()
        (path_dir / "radixserve").symlink_to(tree, target_is_directory=True)
    report = scratch / "report.xml"
    report.unlink(missing_ok=True)
    pythonpath = [str(path_dir), *filter(None, [os.environ.get("PYTHONPATH")])]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}"]
    try:
        done = subprocess.run(
            [*command, test],
            cwd=tree,
            env=os.environ | {"PYTHONPATH": os.pathsep.join(pythonpath)},
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
            first_line = (found.get("message") or "").strip().split("\n")[0]
            return Outcome({"failure": "failed"}.get(kind, kind), first_line)
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


def print_table(rows: list[Row], commit: str) -> None:
    print(f"\nbefore = {commit} (no issue 13 fix), after = {REPO}")
    header = ("bullet", "test", "before", "after", "red, then green")
    lines = [header] + [
        (
            r.case.bullet,
            r.case.test.split("::")[-1],
            r.before.short(),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit before the fixes")
    parser.add_argument("--only", default="", help="replay only the tests whose id has this")
    args = parser.parse_args()
    cases = [case for case in CASES if args.only in case.test]
    rows = []
    with tempfile.TemporaryDirectory(prefix="replay-issue13-") as name:
        scratch = Path(name)
        try:
            before = old_tree(args.before, scratch)
            for case in cases:
                print(f"{case.test} ...", flush=True)
                rows.append(
                    Row(
                        case,
                        run_test(before, case.test, scratch),
                        run_test(REPO, case.test, scratch),
                    )
                )
                print(f"  before: {rows[-1].before.short()}\n  after:  {rows[-1].after.short()}")
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(scratch / "before")],
                check=False,
            )
    print_table(rows, args.before)
    return 0 if rows and all(row.red_then_green for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
