"""Dispatch handles and activation checkpointing.

10 forward+backward iterations under per-op selective activation
checkpointing (the backend's ops on torchtitan's save list) and under full
activation checkpointing: no dispatch handle stays alive, no dispatch state is
left pending, no asynchronous combine is left unlanded (the outputs go
straight into backward, unused, the case where only backward can land them), and with the save list the recomputation issues no collective
(backward communicates exactly as without checkpointing). Full checkpointing
is the control: its recomputation repeats the forward collectives.
"""

import pytest

from tests.ep.cases import Case, checkpoint_worker
from torchtitan_ext.ep.backends import CPU_VARIANTS
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow

EP = 2
ITERATIONS = 10
"""Enough to show a leak: one handle left per iteration would leave 10 alive."""
CASE = Case("handles", num_experts=4, top_k=2, score_before_experts=False, seed=41)


@pytest.fixture(scope="module")
def results():
    return run_distributed(EP, checkpoint_worker, CASE, ITERATIONS)


@pytest.mark.parametrize("backend", CPU_VARIANTS)
def test_no_handles_left_after_checkpointed_iterations(results, backend):
    for rank_results in results:
        for mode in ("selective_op", "full"):
            got = rank_results[backend, mode]
            assert len(got["backward_collectives"]) == ITERATIONS
            assert got["live_handles"] == 0
            assert not got["pending_state"]
            assert got["unlanded_combines"] == 0
            if backend != "nccl":  # the kernel backends hold one handle per layer until backward
                assert got["live_before_backward"] == [1] * ITERATIONS


@pytest.mark.parametrize("backend", CPU_VARIANTS)
def test_selective_recompute_repeats_no_collective(results, backend):
    for rank_results in results:
        baseline = rank_results[backend, "none"]["backward_collectives"]
        selective = rank_results[backend, "selective_op"]["backward_collectives"]
        full = rank_results[backend, "full"]["backward_collectives"]
        assert selective == baseline
        assert all(f > b for f, b in zip(full, baseline))
