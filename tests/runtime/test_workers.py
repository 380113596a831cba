"""The spawn harness (:mod:`torchtitan_ext.runtime.workers`): a failed run names every rank's exit code and stderr; a
worker that gloo's transport thread aborted, or that a segmentation fault killed inside a collective, runs once more,
with a warning, and no other failure does."""

import os
import time
from pathlib import Path

import pytest

from torchtitan_ext.runtime.workers import raised, run_workers, WorkersFailed


def abort_once(rank, world_size, marker, message):
    """Rank 1's first run writes ``message`` to stderr and aborts; every other run returns the rank."""
    first = rank == 1 and not Path(marker).exists()
    if first:
        Path(marker).touch()
        os.write(2, f"{message}\n".encode())
        os.abort()
    return rank


@pytest.mark.slow
@pytest.mark.parametrize("crash", [
    "terminate called after throwing an instance of 'gloo::IoException'\n  what():  [gloo/transport/tcp/pair.cc:599] "
    "Connection closed by peer [127.0.0.1]:40123",
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
    "gloo/transport/tcp/address.cc:101] rv != -1. -1 vs -1. getpeername: Transport endpoint is not connected",
])
def test_a_gloo_transport_abort_runs_again_once_with_a_warning(tmp_path, crash):
    with pytest.warns(UserWarning, match="gloo's transport crashed a worker; running it again once") as warned:
        assert run_workers(2, abort_once, str(tmp_path / "marker"), crash) == [0, 1]
    [rerun] = [str(warning.message) for warning in warned if "running it again once" in str(warning.message)]
    assert "--- rank 1: exit code -6" in rerun  # SIGABRT, with the rank's stderr
    assert crash.splitlines()[-1] in rerun


TRANSPORT_ABORT = ("terminate called after throwing an instance of 'gloo::IoException'\n  what():  "
                   "[gloo/transport/tcp/pair.cc:599] Connection closed by peer [127.0.0.1]:40123")


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie until its parent reaps it, or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def lose_the_peer_then_fail(rank, world_size, runs):
    """Rank 1 has a defect: on every run it raises an error of its own (a defect is deterministic), once its peer
    is gone. On the first run its peer, rank 0, aborts first, as gloo's transport does on a lost connection: torch
    names rank 0. ``runs`` counts rank 1's runs."""
    peer = Path(f"{runs}.peer")
    if rank == 0:
        if peer.exists():
            return rank
        written = Path(f"{runs}.peer.partial")
        written.write_text(str(os.getpid()))
        written.rename(peer)  # whole: rank 1 reads the pid as soon as the file exists
        while not Path(runs).exists():
            time.sleep(0.01)
        os.write(2, f"{TRANSPORT_ABORT}\n".encode())
        os.abort()
    with open(runs, "a") as counted:
        counted.write(f"{os.getpid()}\n")
    while not (peer.exists() and _exited(int(peer.read_text()))):
        time.sleep(0.01)
    time.sleep(0.5)  # a rank slower to fail than its peer to abort: torch's SIGTERM would find it still running
    raise ValueError("a defect in the worker")


@pytest.mark.slow
def test_an_error_of_the_workers_own_is_never_run_again(tmp_path):
    """Even when torch names the peer first, whose transport aborted on the lost connection: the defective rank
    gets the time to report its error (the harness's grace), and the abort is taken to follow the defect."""
    runs = tmp_path / "runs"
    with pytest.raises(WorkersFailed) as failure:
        run_workers(2, lose_the_peer_then_fail, str(runs))
    report = str(failure.value)
    assert report.startswith("process 0 terminated with signal SIGABRT")
    assert not failure.value.transport_crash
    assert len(runs.read_text().split()) == 1
    assert "ValueError: a defect in the worker" in report
    assert "--- rank 0: exit code -6" in report and TRANSPORT_ABORT.splitlines()[-1] in report


def abort_deep_in_a_call(rank, world_size, message, depth=120):
    """Rank 1 writes ``message`` to stderr and aborts ``depth`` calls deep: faulthandler's dump of its stack is
    longer than the stderr's end that a report shows."""
    if rank == 1:
        if depth:
            return abort_deep_in_a_call(rank, world_size, message, depth - 1)
        os.write(2, f"{message}\n".encode())
        os.abort()
    return rank


@pytest.mark.slow
def test_any_other_abort_fails_with_every_ranks_stderr_and_its_message(tmp_path):
    """A size mismatch between ranks' collectives (gloo::EnforceNotMet) is a defect: no second run. The message
    of the exception that aborted the rank is reported even when the stack dump after it is long."""
    message = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
               "gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 1046204 vs 1040256")
    with pytest.raises(WorkersFailed) as failure:
        run_workers(2, abort_deep_in_a_call, message)
    report = str(failure.value)
    assert not failure.value.transport_crash
    assert f"--- rank 1: exit code -6\nstderr before the crash's stack dump:\n{message}" in report
    assert "--- rank 0: exit code" in report


def test_a_rank_stopped_while_writing_its_traceback_raised_nothing_readable(tmp_path):
    """torch's spawn SIGTERMs the other ranks once one failed; a rank stopped inside its exception handler leaves
    an empty error file (seen in a full-suite run): the report reads it as no traceback, not as an error of its own."""
    from types import SimpleNamespace

    empty, missing = tmp_path / "empty.pickle", tmp_path / "missing.pickle"
    empty.write_bytes(b"")
    context = SimpleNamespace(error_files=[str(empty), str(missing)])
    assert (raised(context, 0), raised(context, 1)) == (None, None)


SEGFAULT_IN_A_COLLECTIVE = """Fatal Python error: Segmentation fault

Thread 0x00007f9a4bfff640 (most recent call first):
  <no Python frame>

Current thread 0x00007f9a6e9b7740 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/_ops.py", line 1279 in __call__
  File "/venv/lib/python3.11/site-packages/torch/distributed/_functional_collectives.py", line 209 in all_gather_single
  File "/repo/tests/models/gradient_cases.py", line 183 in _full
"""

PEER_LOST_THEN_TEARDOWN_FAILED = """Traceback (most recent call last):
  File "/repo/tests/models/gradient_cases.py", line 183 in _full
RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:59621: Connection reset by peer.

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/repo/torchtitan_ext/runtime/workers.py", line 216, in _worker
AssertionError: deep_ep double: the process group is destroyed under live EPBuffer
"""


@pytest.mark.parametrize("dump, retried", [
    (SEGFAULT_IN_A_COLLECTIVE, True),
    (SEGFAULT_IN_A_COLLECTIVE.replace("torch/distributed/_functional_collectives.py", "torch/nn/modules/module.py"),
     False),
])
def test_a_segfault_inside_a_collective_whose_peer_lost_it_runs_again(tmp_path, dump, retried):
    """Seen in full-suite runs under load, never alone: a rank killed by SIGSEGV in gloo's all_gather of DTensor
    gradients, its peer losing it (and its clean-up raising after). Run again once, as a transport abort is; a
    segfault outside a collective is a defect."""
    import pickle
    import signal
    from types import SimpleNamespace

    from torchtitan_ext.runtime.workers import only_transport_crash

    (tmp_path / "stderr0").write_text(dump)
    error_files = [tmp_path / "error0", tmp_path / "error1"]
    error_files[1].write_bytes(pickle.dumps(PEER_LOST_THEN_TEARDOWN_FAILED))
    context = SimpleNamespace(processes=[SimpleNamespace(exitcode=-signal.SIGSEGV), SimpleNamespace(exitcode=1)],
                              error_files=[str(path) for path in error_files])
    assert only_transport_crash(context, str(tmp_path)) is retried
