"""Where the test suite's CPU time goes, file by file: a suite-CPU campaign.

    python -m torchtitan_ext.bench suite_cpu --campaign benchmarks/suite-cpu_HARDWARE_DATE.jsonl [--fast]
        [--top N] [PATH ...]

Runs this checkout's ``./test.sh -n 0`` (``--fast``: the fast tier; PATHs: only those test files or folders): one
test at a time in one process, so that the machine's busy and idle CPU time over a test (every core, the processes
the test starts included, from /proc/stat) is that test's own, not shared with a parallel worker's. The suite takes
about 1.5 times its parallel time this way, and /proc/stat counts every process: run it on an otherwise idle
machine. The suite is CPU-bound on 2 cores, so its time on a slower CPU follows its busy CPU; this says which files
to cut first.

Each row is one test file, the costliest first: ``file``, ``tests``, ``busy_cpu_s``, ``idle_cpu_s``, ``wall_s``
(each over its tests' setup, call and teardown: a module fixture's setup counts in its file's first test and its
teardown in the last; a session fixture's setup in the first test that asks for it, its teardown in the suite's
last), and its ``costliest_test`` with that test's ``costliest_busy_cpu_s``. The header's ``code`` is the
checkout's commit ("-dirty" where tracked files differ from it), its notes the totals and pytest's counts. It prints
the ``--top`` files (default 15); a progress bar follows pytest's. A suite that fails writes no campaign. Linux only.
"""

import json
import re
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.bench.fresh_clone import COMMAND_TIMEOUT_S, git, pytest_summary
from torchtitan_ext.config import ConfigError
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.cpu_time import check_cpu_time_readable
from torchtitan_ext.runtime.entry import run_and_exit
from torchtitan_ext.runtime.jobs import JobFailed, RunningJob, SHOWN_CHARS

PLUGIN = "torchtitan_ext.bench._cpu_per_test"
"""The pytest plugin that writes each test's CPU time (``--suite-cpu-rows FILE``)."""
PROGRESS = re.compile(r"\[\s*(\d+)%\]\s*$")
"""pytest's progress at the end of a line of its output."""
NO_TESTS_COLLECTED = 5
"""pytest's exit status where no test was selected."""


def per_file(tests: list[dict]) -> list[dict]:
    """The plugin's rows (one per test, in the order they ran) summed per test file, the most busy CPU first."""
    files: dict[str, dict] = {}
    for test in tests:
        name, _, function = test["test"].partition("::")
        row = files.setdefault(name, {"file": name, "tests": 0, "busy_cpu_s": 0.0, "idle_cpu_s": 0.0, "wall_s": 0.0,
                                      "costliest_test": function, "costliest_busy_cpu_s": test["busy_cpu_s"]})
        row["tests"] += 1
        for field in ("busy_cpu_s", "idle_cpu_s", "wall_s"):
            row[field] += test[field]
        if test["busy_cpu_s"] > row["costliest_busy_cpu_s"]:
            row.update(costliest_test=function, costliest_busy_cpu_s=test["busy_cpu_s"])
    rows = sorted(files.values(), key=lambda row: -row["busy_cpu_s"])
    for row in rows:
        for field in ("busy_cpu_s", "idle_cpu_s", "wall_s", "costliest_busy_cpu_s"):
            row[field] = round(row[field], 1)
    return rows


def _from_repository(path: Path) -> str:
    """``path`` as ./test.sh takes it from the repository root: relative where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _checkout_commit() -> str:
    """The checkout's commit, "-dirty" appended where tracked files differ from it; empty outside a git checkout."""
    found = git(ROOT, "rev-parse", "--short", "HEAD", check=False)
    if found.returncode != 0:
        return ""
    changed = git(ROOT, "status", "--porcelain", "--untracked-files=no").output.strip()
    return found.output.strip() + ("-dirty" if changed else "")


def _run(pytest_args: list[str]) -> tuple[int, str, list[dict]]:
    """``./test.sh pytest_args`` with the plugin, a progress bar following pytest's: (its exit status, its output,
    the plugin's rows). TimeoutError or JobFailed past CI's 90 minutes. Every process it started is stopped at the
    end, also where this process is interrupted."""
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as scratch:
        rows_file = Path(scratch) / "tests.jsonl"
        job = RunningJob(["./test.sh", *pytest_args, "--suite-cpu-rows", str(rows_file)], cwd=ROOT)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        try:
            with tqdm(total=100, desc="bench suite_cpu", unit="%") as progress:
                while (line := job.next_line(deadline)) is not None:
                    done = PROGRESS.search(line)
                    if done:
                        progress.update(int(done[1]) - progress.n)
            returncode = job.finish(timeout_s=max(deadline - time.monotonic(), 1.0))
        finally:
            job.stop()
        tests = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    return returncode, job.output, tests


def _parser() -> CommandLineParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--campaign", type=Path, required=True,
                        help="the new campaign file (THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--fast", action="store_true", help="the fast tier only (./test.sh --fast)")
    parser.add_argument("--top", type=int, default=15, help="test files printed, the costliest first (default 15)")
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="only these test files or folders (default: the whole suite)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top}: print at least 1 file")
    check_new_campaign_path(args.campaign)
    check_cpu_time_readable()
    if not (ROOT / "test.sh").exists():
        raise ConfigError(f"{ROOT} has no test.sh: run the tool from a checkout of this project (pip install -e)")
    for path in args.paths:
        if not path.exists():
            raise ConfigError(f"{path}: no such test file or folder: give one under {ROOT / 'tests'}")
    pytest_args = ["-n", "0", "-p", PLUGIN, "--color=no", *(["--fast"] if args.fast else []),
                   *(_from_repository(path) for path in args.paths)]
    try:
        returncode, output, tests = _run(pytest_args)
    except (TimeoutError, JobFailed):
        print(f"error: ./test.sh ran past {COMMAND_TIMEOUT_S} s and was stopped: no campaign written", file=sys.stderr)
        return 1
    if returncode == NO_TESTS_COLLECTED:
        print(f"error: ./test.sh {' '.join(pytest_args)} selected no test: give test files or folders that hold some "
              "(--fast leaves out the slow ones)", file=sys.stderr)
        return 1
    if returncode != 0:
        print(f"error: ./test.sh {' '.join(pytest_args)} exited with status {returncode}: no campaign written; its "
              f"output ends:\n{output[-SHOWN_CHARS:]}", file=sys.stderr)
        return 1
    summary = pytest_summary(output)
    rows = per_file(tests)
    totals = {field: round(sum(test[field] for test in tests), 1) for field in ("busy_cpu_s", "idle_cpu_s", "wall_s")}
    counts = ", ".join(f"{summary[kind]} {kind}" for kind in ("passed", "skipped") if kind in summary)
    notes = [
        f"all {len(tests)} tests ({counts} in {summary.get('wall_s', '?')} s by pytest): busy {totals['busy_cpu_s']} "
        f"CPU-s, idle {totals['idle_cpu_s']} CPU-s, {totals['wall_s']} s",
        "busy_cpu_s, idle_cpu_s: /proc/stat's over each test's setup, call and teardown, every core (the processes a "
        "test starts included), summed per file; wall_s: the same tests' wall-clock seconds",
        "a module fixture's setup counts in its file's first test, its teardown in the last; a session fixture's setup "
        "in the first test that asks for it, its teardown in the suite's last test",
        f"made by {bench_command('suite_cpu', argv)}",
    ]
    write_campaign(args.campaign, [f"./test.sh {' '.join(pytest_args)} --suite-cpu-rows ROWS"], rows,
                   code=_checkout_commit(), notes=notes)
    print(f"{'busy CPU-s':>10} {'idle CPU-s':>10} {'wall s':>7} {'tests':>5}  file (its costliest test)")
    for row in rows[:args.top]:
        print(f"{row['busy_cpu_s']:10.1f} {row['idle_cpu_s']:10.1f} {row['wall_s']:7.1f} {row['tests']:5d}  "
              f"{row['file']} ({row['costliest_test']}: {row['costliest_busy_cpu_s']:.1f})")
    print(notes[0])
    return 0


if __name__ == "__main__":
    run_and_exit(main)
