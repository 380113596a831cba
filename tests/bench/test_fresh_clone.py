"""bench fresh_clone: the README's commands in fresh clones, alternated between two commits, in CI's environment."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ext.bench import fresh_clone
from torchtitan_ext.config import ConfigError

STEP_TIMES = [4.0, 1.5, 2.5, 2.0]
LOSSES = [8.25, 7.5, 7.0, 6.75]
PASSED = {"first": 11, "second": 7}
"""What each commit's fake test.sh reports passing: tells the rows' commits apart."""


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("fake") / "repo"
    return folder, _fake_repo(folder)


def _fake_repo(folder: Path) -> dict[str, str]:
    """A git repository of two commits whose run_train.sh and test.sh print what the real ones do (a precision
    line, metrics.jsonl; pytest-xdist's worker line and pytest's summary) and fail unless run in CI's environment
    with FOO=bar and without this Python's virtual environment on PATH: {label: short commit id}."""
    (folder / "subfolder").mkdir(parents=True)  # --repo may name any folder of the repository
    own_bin = Path(sys.prefix) / "bin"
    in_ci = (f'[ "$CI" = true ] && [ "$FOO" = bar ] && [ -z "${{VIRTUAL_ENV:-}}" ] || exit 3\n'
             f'case ":$PATH:" in *":{own_bin}:"*) exit 4;; esac\n')
    metrics = "".join(json.dumps({"step": step, "loss_metrics/global_avg_loss": loss, fresh_clone.STEP_TIME: time})
                      + "\n" for step, (loss, time) in enumerate(zip(LOSSES, STEP_TIMES), start=1))
    (folder / "run_train.sh").write_text(
        f"#!/bin/bash\n{in_ci}mkdir -p outputs\ncat > outputs/metrics.jsonl <<'END'\n{metrics}END\n"
        "echo '[rank0]:12:00:00 CPU precision: training.mixed_precision_param = float32 (no AVX512_BF16)'\n")
    commits = {}
    git = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for label, passed in PASSED.items():
        workers = 3 if label == "first" else 2
        (folder / "test.sh").write_text(
            f"#!/bin/bash\n{in_ci}echo 'created: {workers}/{workers} workers'\n"
            f'if [ "${{1:-}}" = --fast ]; then seconds=3.25; else seconds=30.5; fi\n'
            f'echo "===== {passed} passed, 2 skipped, 5 warnings in ${{seconds}}s (0:00:30) ====="\n')
        for script in ("run_train.sh", "test.sh"):
            (folder / script).chmod(0o755)
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", label], check=True)
        subprocess.run([*git, "tag", label], check=True)
        commits[label] = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                                        text=True).stdout.strip()
    return commits


@pytest.mark.slow
def test_rows_alternate_the_commits_and_hold_what_each_command_reported(tmp_path, monkeypatch, fake_repo):
    repo, commits = fake_repo
    # as in a shell where this Python's virtual environment is active: the clones must not run on it
    monkeypatch.setenv("PATH", f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    campaign = tmp_path / "fresh-clone_test-cpu_2026-12-01.jsonl"
    code, against = commits["second"], commits["first"]
    status = fresh_clone.main(["--campaign", str(campaign), "--code", code, "--against", against, "--env", "FOO=bar",
                               "--repo", str(repo / "subfolder"), "--work", str(tmp_path / "work")])
    assert status == 0
    header, *rows = [json.loads(line) for line in campaign.read_text().splitlines()]
    measured = [(row.pop("busy_cpu_s"), row.pop("idle_cpu_s")) for row in rows]
    assert all(isinstance(seconds, int) and seconds >= 0 for pair in measured for seconds in pair)
    assert 0 <= rows[0].pop("wall_s") < 60  # a fake run: about no time
    assert header["code"] == code and header["commands"] == list(fresh_clone.COMMANDS)
    training = {"command": 0, "code": code, "order": 1, "returncode": 0, "median_step_s": statistics.median(STEP_TIMES),
                "steps": 4, "first_loss": 8.25, "last_loss": 6.75, "precision": "float32"}

    def suite(command, commit, order):
        label = "first" if commit == against else "second"
        return {"command": command, "code": commit, "order": order, "returncode": 0,
                "wall_s": 30.5 if command == 1 else 3.25, "passed": PASSED[label], "skipped": 2, "failed": 0,
                "workers": 3 if label == "first" else 2}

    runs = [(1, against), (1, code), (2, against), (2, code), (1, code), (1, against), (2, code), (2, against)]
    assert rows == [training, *(suite(command, commit, order) for order, (command, commit) in enumerate(runs, 2))]
    logs = [f"{order}_{commit}.log" for order, (_, commit) in enumerate([(0, code), *runs], 1)]
    assert sorted(path.name for path in (tmp_path / "work").iterdir()) == sorted([f"{against}_install.log", *logs])


def test_pytest_summary_reads_the_counts_and_time_of_the_last_summary_line():
    output = ("created: 3/3 workers\n3 workers [2066 items]\n"
              "FAILED tests/a.py::test_b - AssertionError\n"
              "== 1 failed, 2043 passed, 22 skipped, 55 warnings, 2 errors in 267.53s (0:04:27) ==\n")
    assert fresh_clone.pytest_summary(output) == {"wall_s": 267.53, "passed": 2043, "skipped": 22, "failed": 1,
                                                  "errors": 2, "workers": 3}
    assert fresh_clone.pytest_summary("Traceback (most recent call last):\nImportError: torch\n") == {}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["not a repository", "one commit twice", "no such commit", "a used work folder",
                                  "a python that imports the package"])
def test_a_bad_setting_is_refused_in_one_line_before_any_clone(tmp_path, monkeypatch, capsys, fake_repo, case):
    repo, commits = fake_repo
    work = tmp_path / "work"
    argv = ["--campaign", str(tmp_path / "fresh-clone_test-cpu_2026-12-01.jsonl"), "--repo", str(repo),
            "--work", str(work)]
    if case == "not a repository":
        argv[3], message = str(tmp_path), "not in a git repository: give this project's"
    elif case == "one commit twice":
        argv += ["--code", commits["first"], "--against", "first"]
        message = f"--against first: it is --code's commit {commits['first']}: compare two commits"
    elif case == "no such commit":
        argv += ["--code", "no-such-branch"]
        message = "--code no-such-branch: no commit of that name"
    elif case == "a used work folder":
        work.mkdir()
        (work / "1_old.log").write_text("an earlier run")
        message = "not an empty folder: name a new or empty one"
    else:
        fake_bin = tmp_path / "bin"
        fake_bin.mkdir()
        (fake_bin / "python").write_text("#!/bin/sh\nexit 0\n")  # as a python whose imports all succeed
        (fake_bin / "python").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
        message = "imports torchtitan_ext, so a clone would run on it"
    with pytest.raises((ConfigError, SystemExit)) as refused:
        fresh_clone.main(argv)
    assert message in (str(refused.value) if refused.type is ConfigError else capsys.readouterr().err)
    assert not work.exists() or [path.name for path in work.iterdir()] == ["1_old.log"]
