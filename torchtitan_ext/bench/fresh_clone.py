"""The README's commands in fresh clones, run as CI runs them and timed: a fresh-clone campaign.

    python -m torchtitan_ext.bench fresh_clone --campaign benchmarks/fresh-clone_HARDWARE_DATE.jsonl
        [--code REV] [--against REV] [--rounds N] [--env NAME=VALUE ...] [--repo DIR] [--work DIR]

Clones ``--repo`` (default: the repository of this checkout; its commits, never its uncommitted files) at
``--code`` (default HEAD) and runs in the clone the README's commands: ``./run_train.sh`` once, its time including
the first install, then ``./test.sh`` and ``./test.sh --fast`` ``--rounds`` times (default 1). Each command sees
only HOME, a PATH without this Python's virtual environment, CI=true, a new TMPDIR (torch's compile caches start
cold) and the clone's own pip cache (its install downloads), then each ``--env``: as on CI's new machine.
With ``--against REV``, a second clone at REV is installed untimed (``./test.sh --co -q``) and each suite and fast
tier of ``--code`` runs beside one of REV's, the pair's order swapped every round (``--rounds`` even, default 2):
the machine's speed drifts by more than most changes move the suite, so only rows of one campaign give a ratio.

Each row: ``command`` (0, 1, 2: the header's commands), ``code``, ``order``, ``returncode``, ``timed_out`` where a
command ran past CI's 90 minutes, ``wall_s`` (run_train.sh: its run; a suite: pytest's own summary, absent where
pytest printed none), ``busy_cpu_s`` and ``idle_cpu_s`` (the machine's, every core, from /proc/stat over the
command); run_train.sh's ``median_step_s``, ``steps``, ``first_loss`` and ``last_loss`` (its metrics.jsonl) and the
``precision`` the runtime chose; a suite's ``passed``, ``skipped``, ``failed``, ``errors`` (where any) and
``workers``. Every command's output stays in ``--work`` (default: a new temporary folder); the clones, with their
virtual environments, are deleted at the end. Linux only (/proc/stat).
"""

import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.machine import PRECISION_LOG
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, VERSIONED, write_campaign
from torchtitan_ext.records.metrics import logged_losses, read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.cpu_time import check_cpu_time_readable, cpu_seconds
from torchtitan_ext.runtime.entry import run_and_exit
from torchtitan_ext.runtime.jobs import JobFailed, JobResult, run_job

COMMANDS = ("git clone REPO fresh && cd fresh && ./run_train.sh", "./test.sh", "./test.sh --fast")
"""The header's commands, as earlier fresh-clone campaigns name them: rows refer to them by index."""
RUNS = {0: ["./run_train.sh"], 1: ["./test.sh"], 2: ["./test.sh", "--fast"]}
COMMAND_TIMEOUT_S = 5400
"""CI's limit for a whole run (90 minutes): a command still running then is stopped, and its row's ``timed_out``
says so."""
STEP_TIME = "time_metrics/end_to_end(s)"
"""The step time rank 0 logs (its console's step_time), as the README's median step quotes it."""
SUMMARY = re.compile(r"^=+ (?P<counts>.*) in (?P<seconds>[\d.]+)s\b.* =+$", re.MULTILINE)
COUNT = re.compile(r"(\d+) (passed|skipped|failed|errors?)\b")
WORKERS = re.compile(r"created: (\d+)/\d+ workers")
VERSION_INFO = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)\.dist-info$")


def pytest_summary(output: str) -> dict:
    """pytest's last summary line and its xdist worker count, as row fields; empty where the run printed none."""
    summaries = list(SUMMARY.finditer(output))
    if not summaries:
        return {}
    last = summaries[-1]
    counts = {kind.removesuffix("s") if kind.startswith("error") else kind: int(n)
              for n, kind in COUNT.findall(last["counts"])}
    fields = {"wall_s": float(last["seconds"])}
    fields.update({kind: counts.get(kind, 0) for kind in ("passed", "skipped", "failed")})
    if counts.get("error"):
        fields["errors"] = counts["error"]
    workers = WORKERS.findall(output)
    if workers:
        fields["workers"] = int(workers[-1])
    return fields


def training_fields(output: str, dump_folder: Path) -> dict:
    """run_train.sh's row fields: its steps' median time, first and last loss, and the precision it chose."""
    times = [row[STEP_TIME] for row in read_metrics(dump_folder) if STEP_TIME in row]
    losses = logged_losses(dump_folder)
    fields = {}
    if times:
        fields.update(median_step_s=round(statistics.median(times), 3), steps=len(times))
    if losses:
        fields.update(first_loss=round(losses[min(losses)], 5), last_loss=round(losses[max(losses)], 5))
    chosen = PRECISION_LOG.search(output)
    if chosen:
        fields["precision"] = chosen.group(1)
    return fields


def ci_environment(extra: dict[str, str]) -> dict[str, str]:
    """HOME, PATH without this Python's virtual environment (a clone must make its own, as on a new machine),
    CI=true, then ``extra``."""
    own = {str(Path(sys.prefix) / "bin")} if sys.prefix != sys.base_prefix else set()
    if os.environ.get("VIRTUAL_ENV"):
        own.add(str(Path(os.environ["VIRTUAL_ENV"]) / "bin"))
    path = os.pathsep.join(part for part in os.environ.get("PATH", "").split(os.pathsep) if part and part not in own)
    return {"HOME": str(Path.home()), "PATH": path, "CI": "true", **extra}


def check_clones_install_themselves(environment: dict[str, str]) -> None:
    """Refuse a PATH whose ``python`` already finds torchtitan_ext and torchtitan (a conda environment, a site
    install), env.sh's test: it would run every clone on it, never installing the clone's own code."""
    python = shutil.which("python", path=environment["PATH"])
    finds_both = ("import importlib.util as u, sys; "
                  "sys.exit(not (u.find_spec('torchtitan_ext') and u.find_spec('torchtitan')))")
    if python and run_job([python, "-c", finds_both], env=environment, timeout_s=120, check=False).returncode == 0:
        raise ConfigError(f"{python} (the first python on PATH) imports torchtitan_ext, so a clone would run on it, "
                          "not on its own code: leave that environment (conda deactivate) or take it off PATH")


def clone_versions(clone: Path) -> dict[str, str]:
    """Python's and the packages' versions in the clone's own .venv (what its commands ran on), the interpreter that
    made it beside Python's (another build may run the suite at another speed); torch's says so where the clone made
    no .venv (its install failed: the rows say how)."""
    config = clone / ".venv" / "pyvenv.cfg"
    if not config.exists():
        return {"torch": "unknown: the clone made no .venv"}
    settings = {name.strip(): value.strip() for name, _, value in
                (line.partition("=") for line in config.read_text().splitlines())}
    versions = {"python": f"{settings.get('version', '?')} ({settings.get('executable', '?')})"}
    for info in sorted((clone / ".venv").glob("lib/python*/site-packages/*.dist-info")):
        match = VERSION_INFO.match(info.name)
        name = match and match["name"].lower().replace("_", "-")
        if name in (*VERSIONED, "pytest-xdist"):
            versions[name] = match["version"]
    return versions


def git(repo: Path, *args: str, check: bool = True) -> JobResult:
    """``git -C repo args``: its result (check: raise on a non-zero exit)."""
    return run_job(["git", "-C", str(repo), *args], timeout_s=300, check=check)


def _checked_revision(repo: Path, option: str, revision: str) -> str:
    """``revision``'s short commit id, refused in one line where it names no commit or lacks the README's commands."""
    result = git(repo, "rev-parse", "--verify", "--short", f"{revision}^{{commit}}", check=False)
    if result.returncode != 0:
        raise ConfigError(f"{option} {revision}: no commit of that name in {repo}: give a commit, branch or tag")
    commit = result.output.strip()
    for script in ("run_train.sh", "test.sh"):
        if git(repo, "cat-file", "-e", f"{commit}:{script}", check=False).returncode != 0:
            raise ConfigError(f"{option} {revision}: commit {commit} has no {script}: give a commit of this project")
    return commit


def _parser() -> CommandLineParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--campaign", type=Path, required=True,
                        help="the new campaign file (THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--code", default="HEAD", help="the commit measured (default HEAD)")
    parser.add_argument("--against", help="a commit whose suite and fast tier alternate with --code's")
    parser.add_argument("--rounds", type=int, help="suite and fast-tier runs of each commit (default 1; with "
                                                    "--against 2, and even)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable set for every command, e.g. ATEN_CPU_CAPABILITY=avx2 (repeatable)")
    parser.add_argument("--repo", type=Path, default=ROOT,
                        help="the git repository cloned (default: this checkout's)")
    parser.add_argument("--work", type=Path, help="where the clones and the commands' output go (default: a new "
                                                  "temporary folder)")
    return parser


def _extra_environment(parser: CommandLineParser, settings: list[str]) -> dict[str, str]:
    extra = {}
    for setting in settings:
        name, equals, value = setting.partition("=")
        if not equals or not name.isidentifier():
            parser.error(f"--env {setting}: give NAME=VALUE, NAME a variable's name")
        extra[name] = value
    return extra


def _checked_work(option: Path | None) -> Path:
    """The folder for the clones and logs: a new or empty one (old logs would mix with this run's)."""
    if option is None:
        return Path(tempfile.mkdtemp(prefix="fresh-clone-"))
    work = option.resolve()
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise ConfigError(f"--work {option}: not an empty folder: name a new or empty one")
    return work


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    comparing = args.against is not None
    rounds = args.rounds if args.rounds is not None else 2 if comparing else 1
    if rounds < 1 or (comparing and rounds % 2):
        parser.error(f"--rounds {rounds}: use at least 1, and with --against an even number (each commit first as "
                     "often as the other)")
    extra = _extra_environment(parser, args.env)
    check_new_campaign_path(args.campaign)
    check_cpu_time_readable()
    found = git(args.repo, "rev-parse", "--show-toplevel", check=False)
    if found.returncode != 0:
        raise ConfigError(f"--repo {args.repo}: not in a git repository: give this project's")
    repo = Path(found.output.strip())
    code = _checked_revision(repo, "--code", args.code)
    against = _checked_revision(repo, "--against", args.against) if comparing else None
    if against == code:
        parser.error(f"--against {args.against}: it is --code's commit {code}: compare two commits")
    environment = ci_environment(extra)
    check_clones_install_themselves(environment)
    work = _checked_work(args.work)
    work.mkdir(parents=True, exist_ok=True)
    commits = [code, against] if against else [code]
    try:
        for commit in commits:
            git(repo, "clone", "--quiet", "--no-checkout", str(repo), str(work / commit))
            git(work / commit, "checkout", "--quiet", commit)
        if against:
            run_job(["./test.sh", "--co", "-q"], cwd=work / against, timeout_s=COMMAND_TIMEOUT_S,
                    env=_command_environment(environment, work, against, "install"),
                    log=work / f"{against}_install.log")
            shutil.rmtree(work / "tmp_install", ignore_errors=True)
        plan = [(0, code)]
        for round_index in range(rounds):
            pair = [against, code] if against and round_index % 2 == 0 else [code, against] if against else [code]
            plan += [(command, commit) for command in (1, 2) for commit in pair]
        rows = []
        with tqdm(total=len(plan), desc="bench fresh_clone", unit="command") as progress:
            for order, (command, commit) in enumerate(plan, start=1):
                progress.set_postfix_str(f"{commit} {shlex.join(RUNS[command])}")
                command_environment = _command_environment(environment, work, commit, order)
                rows.append(_timed(command, commit, order, work, command_environment))
                progress.update()
        versions = {commit: clone_versions(work / commit) for commit in commits}
    finally:
        for commit in commits:
            shutil.rmtree(work / commit, ignore_errors=True)
            shutil.rmtree(work / f"{commit}_pip_cache", ignore_errors=True)
    notes = [
        "wall_s: run_train.sh's is the tool's clock, its first install included; a suite's is pytest's summary",
        "median_step_s: the median of the steps' step_time as rank 0 logs it (metrics.jsonl)",
        "busy_cpu_s, idle_cpu_s: /proc/stat's busy and idle jiffies over the command, every core, in seconds",
        f"every command ran with only {', '.join(environment)} set"
        + (f" ({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else "")
        + ", PATH without the tool's virtual environment; a new TMPDIR each (cold compile caches) and a new pip cache "
          "per clone, as on a new machine; the header's machine is the tool's own view of it",
        "each code ran in a fresh clone of its own" + (f"; {against}'s installed first, untimed (./test.sh --co -q)"
                                                       if against else ""),
        f"made by {bench_command('fresh_clone', argv)}",
    ]
    if against and versions[against] != versions[code]:
        notes.append(f"versions: {code}'s; {against} ran on {versions[against]}")
    write_campaign(args.campaign, list(COMMANDS), rows, code=code, versions=versions[code], notes=notes)
    print(f"the commands' output: {work}")
    for line in ratios(rows, code, against):
        print(line)
    failed = [f"order {row['order']} ({COMMANDS[row['command']]}, {row['code']}): status {row['returncode']}"
              for row in rows if row["returncode"] != 0]
    if failed:
        print("error: commands failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def _command_environment(environment: dict[str, str], work: Path, commit: str, order: int | str) -> dict[str, str]:
    """``environment`` plus a new TMPDIR for the command (torch's compile caches live there: CI starts cold) and
    the clone's own pip cache (its first install downloads as on a new machine)."""
    temporary = work / f"tmp_{order}"
    temporary.mkdir()
    return {"TMPDIR": str(temporary), "PIP_CACHE_DIR": str(work / f"{commit}_pip_cache"), **environment}


def _timed(command: int, commit: str, order: int, work: Path, environment: dict[str, str]) -> dict:
    """Run README command ``command`` in ``commit``'s clone under ``work``; its row."""
    busy, idle = cpu_seconds()
    try:
        result = run_job(RUNS[command], cwd=work / commit, env=environment, timeout_s=COMMAND_TIMEOUT_S,
                         log=work / f"{order}_{commit}.log", check=False)
        timed_out = False
    except JobFailed as stopped:  # past the timeout: stopped with every process it started
        result, timed_out = stopped.result, True
    busy_after, idle_after = cpu_seconds()
    shutil.rmtree(environment["TMPDIR"], ignore_errors=True)
    row = {"command": command, "code": commit, "order": order, "returncode": result.returncode}
    if timed_out:
        row["timed_out"] = True
    if command == 0:
        row.update(wall_s=round(result.seconds, 1), **training_fields(result.output, work / commit / "outputs"))
    else:
        row.update(pytest_summary(result.output))
    row.update(busy_cpu_s=round(busy_after - busy), idle_cpu_s=round(idle_after - idle))
    return row


def ratios(rows: list[dict], code: str, against: str | None) -> list[str]:
    """For the finding: each command's mean time and busy CPU per commit, and with ``against``, ``code``'s over its."""
    lines = []
    for command in (1, 2):
        means = {}
        for commit in filter(None, (code, against)):
            ran = [row for row in rows if row["command"] == command and row["code"] == commit
                   and row["returncode"] == 0 and "wall_s" in row]
            if ran:
                means[commit] = (statistics.fmean(row["wall_s"] for row in ran),
                                 statistics.fmean(row["busy_cpu_s"] for row in ran))
                lines.append(f"{COMMANDS[command]} at {commit}: {means[commit][0]:.2f} s, busy {means[commit][1]:.0f} "
                             f"CPU-s (the mean of {len(ran)} run(s))")
        if against and len(means) == 2 and all(means[against]):
            lines.append(f"{COMMANDS[command]}: {code} took {means[code][0] / means[against][0]:.3f} of {against}'s "
                         f"pytest time and {means[code][1] / means[against][1]:.3f} of its busy CPU")
    return lines


if __name__ == "__main__":
    run_and_exit(main)
