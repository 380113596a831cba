"""Shared experts overlap combine where the backend allows it.

The ``nccl`` and ``deepep`` backends return the routed output with combine
still in flight, and the MoE layer runs its shared experts before first using
it; ``hybridep`` cannot (its combine has no asynchronous mode). Checked on 2
processes (gloo) without timing: rank 1 holds its combine back until rank 0's
shared experts have started. Rank 0 gets there only if its own combine did not
wait for rank 1's rows. Overlapping changes no number: output and gradients
equal those of the same layer with combine landed before the shared experts.
The same holds when EP borrows the TP ranks: the MoE un-splits the routed
output after its shared experts, so the overlap (and the dry run's "yes") stays.
"""

import pytest
import torch

from tests.ep.cases import Case, overlap_worker
from tests.helpers import run_distributed
from torchtitan_ext.ep import BACKENDS as BACKEND_CLASSES

pytestmark = pytest.mark.slow

EP = 2
CASE = Case("overlap", num_experts=4, top_k=2, score_before_experts=False, seed=53)
OVERLAPPING = {"nccl": True, "deepep": True, "hybridep": False}
PEER_WAIT_S = {"nccl": 120, "deepep": 120, "hybridep": 2}
"""How long rank 1 holds its combine: long where the signal must come (only a
hang would use it up), short where it cannot come before rank 1 gives up (an
overlap would signal within the milliseconds rank 0 takes to reach its shared
experts)."""


@pytest.fixture(scope="module", params=[False, True], ids=["ep", "ep_borrowing_tp"])
def results(request):
    """Plain EP, and EP borrowing the TP ranks (each rank dispatches its slice of the tokens and the
    un-split follows the shared experts)."""
    return run_distributed(EP, overlap_worker, CASE, tuple(OVERLAPPING), PEER_WAIT_S, request.param)


@pytest.mark.parametrize("backend", OVERLAPPING)
def test_shared_experts_run_while_combine_is_in_flight(results, backend):
    assert results[1][backend]["signalled"] is OVERLAPPING[backend]
    assert BACKEND_CLASSES[backend].shared_experts_overlap.startswith("yes" if OVERLAPPING[backend] else "no")


@pytest.mark.parametrize("backend", OVERLAPPING)
def test_overlap_changes_no_number(results, backend):
    for rank_results in results:
        got = rank_results[backend]
        torch.testing.assert_close(got["out"], got["sequential_out"], rtol=0, atol=0)
        torch.testing.assert_close(got["grad_x"], got["sequential_grad_x"], rtol=0, atol=0)
