"""Helpers shared by the tests: repository paths, the launcher, step logs, worker processes.

Nothing here waits without a deadline: spawned workers are joined against a
deadline and killed past it, their process groups time out, and launcher
output is read line by line against a deadline.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

PROCESS_GROUP_TIMEOUT = timedelta(seconds=120)
"""A collective in a test worker that waits longer than this fails instead of hanging."""

WORKERS_DEADLINE_S = 420.0
"""Default wall-clock limit of one ``run_distributed`` call."""

WORKER_PRELOAD = ["torchtitan_ext.train", "tests.training.cases", "tests.ep.cases", "tests.models.gradient_cases"]
"""Modules the fork server imports once for the whole session: every worker it forks starts with
torch and torchtitan already imported (importing them again costs ~25 s of a 2-core machine per
``run_distributed`` call). Nothing here may start a thread at import. Workers get the environment
the fork server started with (the suite's, from conftest), not a test's later ``os.environ``
changes: pass such settings to the worker as arguments. CUDA workers are spawned instead (see
``run_distributed``), without this preload."""


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


def run_launcher(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ./run_train.sh from the repository root, capturing stdout+stderr."""
    return subprocess.run(
        ["./run_train.sh", *args],
        cwd=REPO_ROOT,
        env=launcher_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


class LauncherProcess:
    """./run_train.sh (or another ``program``) running in the background, its output read by a thread.

    ``wait_for`` and ``finish`` take deadlines, so a test never blocks on a
    pipe that stays silent.
    """

    def __init__(self, *args: str, program: tuple[str, ...] = ("./run_train.sh",), **env: str):
        self.process = subprocess.Popen(
            [*program, *args],
            cwd=REPO_ROOT,
            env=launcher_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
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


def step_losses(output: str) -> dict[int, float]:
    """{step: loss} from the console step lines of one rank's log."""
    plain = ANSI_ESCAPE.sub("", output)
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(plain)}


GLOO_TRANSPORT_CRASH = re.compile(
    r"terminate called after throwing an instance of 'gloo::(IoException'|EnforceNotMet'\s+what\(\):[^\n]*getpeername)")
"""What a worker's stderr holds when gloo's TCP transport thread died of a socket error it does not catch: an
I/O error, or ``Address::fromPeerName`` on a connection reset while pairs connect (pytorch/pytorch#188266).
Either aborts the process outside any code of ours or the test's. Not a collective of mismatched sizes
(gloo::EnforceNotMet in pair.cc): that is a defect."""


class WorkersFailed(RuntimeError):
    """A ``run_distributed`` call's workers failed: the first failure, then every rank's exit code and stderr."""

    def __init__(self, message: str, transport_crash: bool):
        super().__init__(message)
        self.transport_crash = transport_crash
        """Whether gloo's transport thread aborting is the run's only failure (see :func:`_only_transport_crash`)."""


def run_distributed(world_size: int, fn, *args, device: str = "cpu", deadline_s: float = WORKERS_DEADLINE_S):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    gloo on CPU, NCCL with one GPU per rank on CUDA. Returns the ranks' return
    values in rank order; a failure in any rank raises WorkersFailed with its
    traceback and every rank's stderr, and workers still running after
    ``deadline_s`` seconds are killed. A run whose only failure is gloo's
    transport thread aborting a worker (:data:`GLOO_TRANSPORT_CRASH`; its peers
    may only have lost it) runs once more, with a warning that shows every
    rank's stderr in the test report.
    """
    try:
        return _run_workers(world_size, fn, args, device, deadline_s)
    except WorkersFailed as failure:
        if not failure.transport_crash or device != "cpu":
            raise
        warnings.warn(f"{fn.__name__} on {world_size} processes: gloo's transport aborted a worker; running it "
                      f"again once:\n{failure}", stacklevel=2)
    return _run_workers(world_size, fn, args, device, deadline_s)


def _run_workers(world_size: int, fn, args: tuple, device: str, deadline_s: float):
    import multiprocessing
    import tempfile

    import torch
    import torch.multiprocessing as mp

    # A child forked by the fork server cannot use CUDA once the server's imports have queried it
    # ("Cannot re-initialize CUDA in forked subprocess", seen on an H100): CUDA workers are spawned.
    start_method = "spawn" if device == "cuda" else "forkserver"
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker, args=(world_size, tmp, device, fn, args), nprocs=world_size, join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=min(5.0, max(deadline - time.monotonic(), 0.1))):
                if time.monotonic() > deadline:
                    alive = [process for process in context.processes if process.is_alive()]
                    for process in alive:  # every thread's stack into the rank's stderr file (see _worker)
                        os.kill(process.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    for process in alive:
                        process.kill()
                    raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {deadline_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as failure:
            report = _ranks_report(context, tmp, world_size)
            raise WorkersFailed(f"{failure}\n{report}", _only_transport_crash(context, tmp)) from failure
        return [torch.load(f"{tmp}/result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _raised(context, rank: int) -> str | None:
    """The traceback of the exception rank ``rank`` raised (torch's spawn writes it to the rank's error file); None
    when it raised none, or was stopped (torch's SIGTERM after another rank failed) before the file was written."""
    import pickle

    error_file = context.error_files[rank]
    try:
        return pickle.loads(Path(error_file).read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _only_transport_crash(context, tmp: str) -> bool:
    """Whether some rank aborted with :data:`GLOO_TRANSPORT_CRASH` and every other rank succeeded, was stopped
    after it (SIGTERM, SIGKILL, SIGINT) or raised only the loss of a peer. A rank whose own code failed in any
    other way (an exception, another abort) makes it a defect to report, whichever rank torch names first."""
    from torchtitan_ext.runtime.collectives import FAILURE_TEXTS

    aborted = False
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if code in (0, -signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT):
            continue
        stderr = Path(f"{tmp}/stderr{rank}")
        if code == -signal.SIGABRT and stderr.exists() and GLOO_TRANSPORT_CRASH.search(stderr.read_text(errors="replace")):
            aborted = True
            continue
        raised = _raised(context, rank)
        if code == 1 and raised and any(text in raised.strip().splitlines()[-1] for text in FAILURE_TEXTS):
            continue
        return False
    return aborted


def _ranks_report(context, tmp: str, world_size: int) -> str:
    """Every rank's exit code, the end of the traceback it raised and of its stderr: torch names only the
    first rank it finds failed, which may be a peer that died of another rank's failure (a gloo peer closing
    its socket)."""
    for process in context.processes:
        process.join(timeout=10)
    lines = []
    for rank, process in enumerate(context.processes):
        stderr = Path(f"{tmp}/stderr{rank}")
        tail = stderr.read_text(errors="replace")[-4000:] if stderr.exists() else ""
        raised = _raised(context, rank)
        lines.append(f"--- rank {rank}: exit code {process.exitcode}"
                     + (f", raised:\n{raised[-2000:]}" if raised else "") + f"\nstderr's end:\n{tail}")
    return "\n".join(lines)


def _worker(rank, world_size, tmp, device, fn, args):
    import faulthandler

    import torch
    import torch.distributed as dist

    # a native crash (a C++ abort in gloo, a segfault) leaves its message and every thread's Python
    # stack where run_distributed reports them
    stderr = open(f"{tmp}/stderr{rank}", "w")
    os.dup2(stderr.fileno(), 2)
    faulthandler.enable(file=stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)  # a hang: run_distributed asks for stacks
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{tmp}/result{rank}.pt")
        # as a training run ends: kernel buffers destroyed (a collective) before the process group, and no
        # rank tears the group down while a peer may still use it
        from torchtitan_ext.ep.base import destroy_kernel_buffers

        destroy_kernel_buffers()
        dist.barrier()
    finally:
        dist.destroy_process_group()
