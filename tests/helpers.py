"""Helpers shared by the tests: repository paths, the launcher, worker processes.

Nothing here waits without a deadline: workers are joined against a deadline and killed past it
(:mod:`torchtitan_ext.runtime.workers`), and launcher output is read against a deadline.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from torchtitan_ext.metrics_file import read_metrics
from torchtitan_ext.runtime.workers import DEADLINE_S, run_workers, WorkersFailed  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def launcher_env(**overrides: str) -> dict[str, str]:
    """Environment for run_train.sh: this interpreter first on PATH, 2 processes, unbuffered output."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MASTER_PORT", None)
    env.pop("CONFIG_FILE", None)
    env["NGPU"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def _launched_from_the_root(**env: str) -> dict:
    """How the tests start a launcher: from the repository root, stdout and stderr as one text stream."""
    return {"cwd": REPO_ROOT, "env": launcher_env(**env), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
            "text": True}


def run_launcher(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ./run_train.sh from the repository root, capturing stdout+stderr."""
    return subprocess.run(["./run_train.sh", *args], timeout=timeout, **_launched_from_the_root(**env))


class LauncherProcess:
    """./run_train.sh (or another ``program``) running in the background, its output read by a thread.

    ``wait_for`` and ``finish`` take deadlines, so a test never blocks on a
    pipe that stays silent.
    """

    def __init__(self, *args: str, program: tuple[str, ...] = ("./run_train.sh",), **env: str):
        self.process = subprocess.Popen([*program, *args], start_new_session=True, **_launched_from_the_root(**env))
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first new line matching ``pattern`` (a regex); AssertionError past ``timeout`` s or at EOF."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-3000:]}") from None
            if line is None:
                raise AssertionError(f"output ended without {pattern!r}:\n{self.output[-3000:]}")
            if re.search(pattern, ANSI_ESCAPE.sub("", line)):
                return line

    def wait_for_step(self, dump_folder: Path, step: int, timeout: float) -> dict:
        """The metrics of ``step`` once the job has logged it in ``dump_folder``'s metrics.jsonl; AssertionError past
        ``timeout`` s or when the job ends first."""
        deadline = time.monotonic() + timeout
        while True:
            logged = [row for row in read_metrics(dump_folder) if row["step"] >= step]
            if logged:
                return logged[0]
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"step {step} not logged within {timeout} s:\n{self.output[-3000:]}")
            time.sleep(0.2)

    def finish(self, timeout: float) -> int:
        """Wait for the process and its output; its return code. Kills it past ``timeout`` s."""
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-3000:]}") from None
        self._reader.join(timeout=10)
        return returncode

    def kill(self) -> None:
        """SIGKILL the launcher and every process under it.

        torchrun starts each worker in a session of its own, so killing the launcher's process
        group would leave the workers training on, orphaned, through the rest of the suite.
        """
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc), children before their own children."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            frontier += kids
    return found


WORKER_PRELOAD = ["torchtitan_ext.train", "tests.training.cases", "tests.ep.cases", "tests.models.gradient_cases"]
"""Modules the workers' fork server imports once for the whole session (:func:`run_distributed`)."""


def run_distributed(world_size: int, fn, *args, device: str = "cpu", deadline_s: float = DEADLINE_S):
    """``fn(rank, world_size, *args)`` on ``world_size`` processes (:func:`torchtitan_ext.runtime.workers.run_workers`),
    CPU workers forked with torch, torchtitan and the test cases already imported."""
    return run_workers(world_size, fn, *args, device=device, deadline_s=deadline_s, preload=WORKER_PRELOAD)
