"""Run a function on several processes of this machine, one rank each: the harness of the tests, the planner's
measurements and the benchmarks.

:func:`run_workers` starts ``world_size`` processes (forked from a preloaded fork server on a CPU, spawned on
CUDA), joins them in a process group through a rendezvous file (gloo, or NCCL with one GPU per rank), runs
``fn(rank, world_size, *args)`` on each and returns the ranks' return values. Nothing waits without a deadline.
A failure raises :class:`WorkersFailed` with every rank's exit code, the end of the traceback it raised and of
its stderr (a native crash's message and every thread's Python stack, from faulthandler). The one known flake,
gloo's transport thread aborting a worker (:data:`GLOO_TRANSPORT_CRASH`), runs once more, with a warning.
"""

import faulthandler
import multiprocessing
import os
import pickle
import re
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_ext.runtime.collectives import FAILURE_TEXTS

PROCESS_GROUP_TIMEOUT = timedelta(seconds=120)
"""A collective in a worker that waits longer than this fails instead of hanging."""

DEADLINE_S = 420.0
"""Default wall-clock limit of one :func:`run_workers` call."""

GLOO_TRANSPORT_CRASH = re.compile(
    r"terminate called after throwing an instance of 'gloo::(IoException'|EnforceNotMet'\s+what\(\):[^\n]*getpeername)")
"""What a worker's stderr holds when gloo's TCP transport thread died of a socket error it does not catch: an
I/O error, or ``Address::fromPeerName`` on a connection reset while pairs connect (pytorch/pytorch#188266).
Either aborts the process outside any code of ours or the caller's. Not a collective of mismatched sizes
(gloo::EnforceNotMet in pair.cc): that is a defect."""

GLOO_COLLECTIVE_SEGFAULT = re.compile(
    r"Fatal Python error: Segmentation fault.*?\(most recent call first\):\n"
    r"(?:  File [^\n]*\n)?  File \"[^\"]*/torch/distributed/", re.S)
"""What faulthandler writes to a worker's stderr when it died of a segmentation fault while a thread was inside a
torch.distributed collective (its innermost Python frame, or the one under torch's op call), as a gloo
``all_gather`` of DTensor gradients can under load."""

_before_teardown: list[Callable[[], None]] = []


def before_process_group_teardown(callback: Callable[[], None]) -> None:
    """Run ``callback`` in every worker that returns, before its process group is destroyed (a feature that holds
    communication resources, the EP backends' kernel buffers, registers their release: it is a collective that
    needs the group alive)."""
    if callback not in _before_teardown:
        _before_teardown.append(callback)


class WorkersFailed(RuntimeError):
    """A :func:`run_workers` call's workers failed: the first failure, then every rank's exit code and stderr."""

    def __init__(self, message: str, transport_crash: bool):
        super().__init__(message)
        self.transport_crash = transport_crash
        """Whether a crash in gloo's transport (an abort, or a segfault inside a collective) is the run's only failure
        (:func:`only_transport_crash`)."""


def run_workers(
    world_size: int,
    fn: Callable,
    *args,
    device: str = "cpu",
    deadline_s: float = DEADLINE_S,
    preload: Sequence[str] = (),
    timeout: timedelta = PROCESS_GROUP_TIMEOUT,
) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one process group; their return values
    in rank order.

    ``device``: "cpu" (gloo, one thread per process) or "cuda" (NCCL, one GPU per rank). ``preload``: modules the
    CPU workers' fork server imports once, so that each worker starts with them imported (torch and torchtitan
    take seconds of a small machine to import); nothing in them may start a thread at import, and workers get
    the environment the fork server started with, not later changes of ``os.environ``: pass such settings as
    arguments. ``timeout``: of each collective. Workers still running after ``deadline_s`` seconds dump every
    thread's stack into their stderr and are killed.
    """
    try:
        return _run(world_size, fn, args, device, deadline_s, preload, timeout)
    except WorkersFailed as failure:
        if not failure.transport_crash or device != "cpu":
            raise
        warnings.warn(f"{fn.__name__} on {world_size} processes: gloo's transport crashed a worker; running it "
                      f"again once:\n{failure}", stacklevel=2)
    return _run(world_size, fn, args, device, deadline_s, preload, timeout)


PEERS_GRACE_S = 3.0
"""Once a rank failed, how long its peers may take to exit on their own before torch's SIGTERM: a rank still
writing its traceback, or a peer's transport aborting on the lost connection, is then seen for what it did."""


def _run(world_size, fn, args, device, deadline_s, preload, timeout) -> list:
    # A child forked by the fork server cannot use CUDA once the server's imports have queried it
    # ("Cannot re-initialize CUDA in forked subprocess", seen on an H100): CUDA workers are spawned.
    start_method = "spawn" if device == "cuda" else "forkserver"
    if start_method == "forkserver" and preload:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker, args=(world_size, tmp, device, timeout, fn, args), nprocs=world_size, join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=min(5.0, max(deadline - time.monotonic(), 0.1)), grace_period=PEERS_GRACE_S):
                if time.monotonic() > deadline:
                    alive = [process for process in context.processes if process.is_alive()]
                    for process in alive:  # every thread's stack into the rank's stderr file (see _worker)
                        os.kill(process.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    for process in alive:
                        process.kill()
                    raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {deadline_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as failure:
            report = ranks_report(context, tmp, world_size)
            raise WorkersFailed(f"{failure}\n{report}", only_transport_crash(context, tmp)) from failure
        return [torch.load(f"{tmp}/result{rank}.pt", weights_only=False) for rank in range(world_size)]


def raised(context, rank: int) -> str | None:
    """The traceback of the exception rank ``rank`` raised (torch's spawn writes it to the rank's error file); None
    when it raised none, or was stopped (torch's SIGTERM after another rank failed) before the file was written."""
    try:
        return pickle.loads(Path(context.error_files[rank]).read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _crashed_in_transport(code: int | None, stderr: Path) -> bool:
    """Whether a rank that exited with ``code`` died in gloo's transport (:data:`GLOO_TRANSPORT_CRASH`) or of a
    segmentation fault inside a collective (:data:`GLOO_COLLECTIVE_SEGFAULT`), by its stderr file."""
    crash = {-signal.SIGABRT: GLOO_TRANSPORT_CRASH, -signal.SIGSEGV: GLOO_COLLECTIVE_SEGFAULT}.get(code)
    return crash is not None and stderr.exists() and crash.search(stderr.read_text(errors="replace")) is not None


def _lost_its_peer(traceback: str) -> bool:
    """Whether a rank's traceback is the loss of a peer: its last exception, or the first, where cleaning up after
    it raised another."""
    exceptions = [line for line in traceback.splitlines() if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", line)]
    last = traceback.strip().splitlines()[-1]
    return any(text in line for line in (last, *exceptions[:1]) for text in FAILURE_TEXTS)


def only_transport_crash(context, tmp: str) -> bool:
    """Whether some rank crashed in gloo's transport (:func:`_crashed_in_transport`) and every other rank
    succeeded, was stopped after it (SIGTERM, SIGKILL, SIGINT) or raised only the loss of a peer. A rank whose own
    code failed in any other way (an exception, another abort) makes it a defect to report, whichever rank torch
    names first."""
    aborted = False
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if code in (0, -signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT):
            continue
        if _crashed_in_transport(code, Path(f"{tmp}/stderr{rank}")):
            aborted = True
            continue
        traceback = raised(context, rank)
        if code == 1 and traceback and _lost_its_peer(traceback):
            continue
        return False
    return aborted


def ranks_report(context, tmp: str, world_size: int) -> str:
    """Every rank's exit code, the end of the traceback it raised and of its stderr: torch names only the
    first rank it finds failed, which may be a peer that died of another rank's failure (a gloo peer closing
    its socket)."""
    for process in context.processes:
        process.join(timeout=10)
    lines = []
    for rank, process in enumerate(context.processes):
        stderr = Path(f"{tmp}/stderr{rank}")
        text = stderr.read_text(errors="replace") if stderr.exists() else ""
        traceback = raised(context, rank)
        crash = _crash_message(text, STDERR_TAIL_CHARS)
        lines.append(f"--- rank {rank}: exit code {process.exitcode}"
                     + (f", raised:\n{traceback[-2000:]}" if traceback else "")
                     + (f"\nstderr before the crash's stack dump:\n{crash}" if crash else "")
                     + f"\nstderr's end:\n{text[-STDERR_TAIL_CHARS:]}")
    return "\n".join(lines)


STDERR_TAIL_CHARS = 4000
"""How much of the end of each rank's stderr a failure report shows."""

CRASH_DUMP = "Fatal Python error:"
"""How faulthandler's dump of a fatal signal begins: every thread's stack, then the extension modules."""


def _crash_message(text: str, tail_chars: int) -> str:
    """What a rank wrote just before faulthandler's dump (the C++ exception that aborted it), when the dump pushed it
    out of the last ``tail_chars`` characters: a rank with many threads dumps more than that."""
    dump = text.rfind(CRASH_DUMP)
    start = max(dump - 1500, 0)
    if dump < 0 or start >= len(text) - tail_chars:
        return ""
    return text[start:dump].strip()


def _worker(rank, world_size, tmp, device, timeout, fn, args):
    # a native crash (a C++ abort in gloo, a segfault) leaves its message and every thread's Python
    # stack where run_workers reports them
    stderr = open(f"{tmp}/stderr{rank}", "w")
    os.dup2(stderr.fileno(), 2)
    faulthandler.enable(file=stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)  # a hang: run_workers asks for stacks
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size, timeout=timeout,
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{tmp}/result{rank}.pt")
        # as a training run ends: communication resources released (collectives) before the process group, and
        # no rank tears the group down while a peer may still use it
        for callback in _before_teardown:
            callback()
        dist.barrier()
    finally:
        dist.destroy_process_group()
