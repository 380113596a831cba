"""The test harness's worker processes: a failed run names every rank's exit code and stderr; a worker that gloo's
transport thread aborted runs once more, with a warning, and no other failure does."""

import os
from pathlib import Path

import pytest

from tests.helpers import GLOO_TRANSPORT_CRASH, run_distributed, WorkersFailed


def abort_once(rank, world_size, marker, message):
    """Rank 1's first run writes ``message`` to stderr and aborts; every other run returns the rank."""
    first = rank == 1 and not Path(marker).exists()
    if first:
        Path(marker).touch()
        os.write(2, f"{message}\n".encode())
        os.abort()
    return rank


def test_a_gloo_transport_abort_runs_again_once_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="gloo's transport aborted a worker; running it again once") as warned:
        assert run_distributed(2, abort_once, str(tmp_path / "marker"), f"{GLOO_TRANSPORT_CRASH}\n  what(): reset") \
            == [0, 1]
    assert "--- rank 1: exit code -6" in str(warned[0].message)  # SIGABRT, with the rank's stderr
    assert "what(): reset" in str(warned[0].message)


def test_any_other_abort_fails_with_every_ranks_stderr(tmp_path):
    """A size mismatch between ranks' collectives (gloo::EnforceNotMet) is a defect: no second run."""
    message = "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
    with pytest.raises(WorkersFailed) as failure:
        run_distributed(2, abort_once, str(tmp_path / "marker"), message)
    report = str(failure.value)
    assert "process 1 terminated with signal SIGABRT" in report
    assert f"--- rank 1: exit code -6, stderr's end:\n{message}" in report
    assert "--- rank 0: exit code" in report
