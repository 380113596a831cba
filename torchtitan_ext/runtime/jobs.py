"""The one way this project starts a command from Python: tests, benches and checks all go through it.

Every job gets a timeout, runs in a process group of its own, and has its output (stdout and stderr together)
kept in a file. On timeout, on Ctrl-C and when it ends, the whole group is stopped: SIGTERM, then SIGKILL after a
grace period, so that no rank or helper a job started outlives it. A failure is one error naming the command and
showing the end of its output.

Standard library only: it starts processes before anything heavy is imported.
"""

import os
import queue
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 10.0
"""Seconds a stopped job's processes get between SIGTERM and SIGKILL."""
KILL_WAIT_S = 5.0
"""Seconds to wait for SIGKILLed processes to be gone."""
SHOWN_CHARS = 4000
"""Characters of a failed job's output that its error shows (the end)."""


@dataclass(frozen=True)
class JobResult:
    command: tuple[str, ...]
    returncode: int
    output: str
    """stdout and stderr, interleaved as written."""
    seconds: float


class JobFailed(RuntimeError):
    """A job that exited non-zero (``check``) or ran past its timeout; the message names the command."""

    def __init__(self, message: str, result: JobResult):
        super().__init__(message)
        self.result = result


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


def _group_members(group: int) -> list[int]:
    """The running processes of process group ``group`` (zombies have ended)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state, ppid, pgrp, ...
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_job(process: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """Stop ``process`` and every process it started: its process group and its descendants (torchrun starts each
    rank in a session of its own), SIGTERM first, SIGKILL to what is left after ``grace_s``."""
    # the job's own pid only while it runs: once reaped, the number may be another process's
    targets = {*descendants(process.pid), *_group_members(process.pid)}
    if process.poll() is None:
        targets.add(process.pid)
    # SIGKILL is delivered asynchronously: wait for it too, briefly
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        for pid in targets:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()
            if not any(_running(pid) for pid in targets):
                break
            time.sleep(0.05)
    process.wait()


def run_job(command: list[str] | tuple[str, ...], *, timeout_s: float, cwd: str | Path | None = None,
            env: dict[str, str] | None = None, log: Path | None = None, check: bool = True,
            grace_s: float = GRACE_S) -> JobResult:
    """Run ``command`` to its end in a process group of its own, at most ``timeout_s`` seconds; its output goes to
    ``log`` (kept) or a temporary file. Every process left in its group is stopped when it ends, times out or the
    caller is interrupted. Raises :class:`JobFailed` on timeout, and on a non-zero exit when ``check``."""
    command = tuple(str(part) for part in command)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(log) if log is not None else Path(scratch) / "output.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        timed_out = False
        with path.open("w") as output:
            process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # on timeout, on Ctrl-C, and after a normal end (a child it left running)
                stop_job(process, grace_s)
        result = JobResult(command, process.returncode, path.read_text(errors="replace"), time.monotonic() - start)
    shown = result.output[-SHOWN_CHARS:]
    if timed_out:
        raise JobFailed(f"{shlex.join(command)} ran past {timeout_s:.0f} s and was stopped with every process it "
                        f"started; its output ends:\n{shown}", result)
    if check and result.returncode != 0:
        raise JobFailed(f"{shlex.join(command)} exited with status {result.returncode}; its output ends:\n{shown}",
                        result)
    return result


class RunningJob:
    """A command running in the background in a process group of its own, its output lines read by a thread: what a
    test waits on line by line. :meth:`finish` and :meth:`wait_for` take deadlines; :meth:`stop` stops every process
    it started."""

    def __init__(self, command: list[str] | tuple[str, ...], *, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None):
        self.command = tuple(str(part) for part in command)
        self.process = subprocess.Popen(self.command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
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

    def next_line(self, deadline: float) -> str | None:
        """The next line of output; None at its end; TimeoutError past ``deadline`` (time.monotonic())."""
        try:
            return self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise TimeoutError(f"{shlex.join(self.command)}: no output line in time") from None

    def finish(self, timeout_s: float) -> int:
        """Its exit status once it has ended; past ``timeout_s`` it is stopped and :class:`JobFailed` raised."""
        try:
            returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            result = JobResult(self.command, self.process.returncode, self.output, timeout_s)
            raise JobFailed(f"{shlex.join(self.command)} ran past {timeout_s:.0f} s and was stopped with every "
                            f"process it started; its output ends:\n{self.output[-SHOWN_CHARS:]}", result) from None
        self._reader.join(timeout=10)
        return returncode

    def stop(self, grace_s: float = GRACE_S) -> None:
        stop_job(self.process, grace_s)
