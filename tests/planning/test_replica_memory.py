"""What is alive at once under expert replication, counted on a real step against the planner's count.

The planner (:func:`torchtitan_ext.planning.memory_plan.replica_copies_alive`) says how many MoE layers'
copies of their home experts beside the replicas, and how many layers' fetched replicas, are alive at its
peak, under each activation-checkpointing mode, with the next layer's replicas fetched ahead. Here the tiny
DeepSeek-V3 of the gradient matrix (3 MoE layers; EP = 2, 4 home experts and 2 replica slots per rank, FSDP)
trains one step in 2 processes while :class:`tests.models.gradient_cases.ReplicaCopyCounter` counts those
tensors from the moment an operator makes them until they are freed.
"""

import pytest

from tests.helpers import run_distributed
from tests.models.gradient_cases import Cell, matrix_worker

pytestmark = pytest.mark.slow

CHECKPOINTING = {
    "none": (),
    "full": ("--activation_checkpoint.mode", "full"),
    "per_op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
    "every_2_layers": ("--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "2"),
}
CELLS = [Cell(f"replicas2_ac_{name}", "deepseek_v3", "nccl", 2, ("--parallelism.expert_parallel_degree", "2", *args),
              replicas=2) for name, args in CHECKPOINTING.items()]
PROJECTIONS = 3
"""w1, w2, w3: one copy tensor per projection and layer."""


@pytest.fixture(scope="module")
def counted():
    return run_distributed(2, matrix_worker, CELLS, True, deadline_s=300)


@pytest.mark.parametrize("cell", CELLS, ids=[cell.name for cell in CELLS])
def test_the_replica_copies_alive_at_once_are_the_planners(counted, cell):
    from tests.models.gradient_cases import _job_config
    from torchtitan_ext.config import model_args_of
    from torchtitan_ext.planning.memory_plan import replica_copies_alive
    from torchtitan_ext.training import prepare

    prepare()
    job_config = _job_config(cell, 2, 2)
    # the tiny model: layer 0 dense, layers 1-3 MoE, all on one stage
    copies, fetched = replica_copies_alive(job_config, [0, 1, 2, 3], [1, 2, 3])
    home, slots = model_args_of(job_config).moe_args.num_experts // 2, cell.replicas
    for rank_results in counted:
        result = rank_results[cell.id]["replica_copies"]
        # the planner's peak (copies of L + S experts, fetched replicas of S) is the most alive at once
        assert result["most_elements"] == (copies * (home + slots) + fetched * slots) * result["expert_elements"], (
            copies, fetched, result)
        assert result["most"]["copies"] == copies * PROJECTIONS, result
        assert result["after_backward"] == {"copies": 0, "fetched": 0}, result
        # what forward leaves for backward: every layer's copy; none (recomputed); none (rebuilt from the
        # saved fetched replicas); layer 2's, the one layer that every-2-layers checkpointing does not wrap
        assert result["at_forward_end"]["copies"] == KEPT_BY_FORWARD[cell.name] * PROJECTIONS, result
        # per-op checkpointing saves every layer's fetched replicas; elsewhere a layer's fetched replicas and the
        # next layer's, fetched ahead, are alive together
        assert result["at_forward_end"]["fetched"] == (3 if cell.name == "replicas2_ac_per_op" else 0), result
        assert result["most"]["fetched"] == (3 if cell.name == "replicas2_ac_per_op" else 2), result


KEPT_BY_FORWARD = {"replicas2_ac_none": 3, "replicas2_ac_full": 0, "replicas2_ac_per_op": 0,
                   "replicas2_ac_every_2_layers": 1}
