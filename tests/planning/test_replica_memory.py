"""What is alive at once under expert replication, counted on a real step against the planner's count.

The planner (:func:`torchtitan_ext.planning.memory_plan.replica_copies_alive`) says how many MoE layers'
copies of their home experts beside the replicas, and how many layers' fetched replicas, are alive at its
peak, under each activation-checkpointing mode, with the next layer's replicas fetched ahead, for grouped GEMMs
(which compute from such a copy) and for torchtitan's per-expert loop (from views, no copy). Here the tiny
DeepSeek-V3 of the gradient matrix (3 MoE layers; EP = 2, 4 home experts and 2 replica slots per rank, FSDP)
trains one step in 2 processes while :class:`tests.models.gradient_cases.ReplicaCopyCounter` counts those
tensors from the moment an operator makes them until they are freed; and the tiny GPT-OSS (2 MoE layers, each
expert two weights and their biases) without checkpointing and with per-op checkpointing, the two that keep the
most.
"""

import math

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
GROUPED_AS_ON_A_GPU = ("--training.mixed_precision_param", "bfloat16")
"""The grouped GEMMs compute in bf16: from bf16 weights, as FSDP's mixed precision gathers them on a GPU, they
compute from the copy itself (from fp32 ones, from a bf16 cast of it)."""
GPT_OSS_CHECKPOINTING = ("none", "per_op")
CELLS = [Cell(f"replicas2_ac_{name}{'_grouped_mm' if grouped else ''}", model, "nccl", 2,
              ("--parallelism.expert_parallel_degree", "2", *args, *(GROUPED_AS_ON_A_GPU if grouped else ())),
              bf16=grouped, grouped_mm=grouped, replicas=2)
         for model in ("deepseek_v3", "gpt_oss") for grouped in (False, True) for name, args in CHECKPOINTING.items()
         if model == "deepseek_v3" or name in GPT_OSS_CHECKPOINTING]


@pytest.fixture(scope="module")
def counted():
    return run_distributed(2, matrix_worker, CELLS, True, deadline_s=300)


@pytest.mark.parametrize("cell", CELLS, ids=[f"{cell.model}-{cell.name}" for cell in CELLS])
def test_the_replica_copies_alive_at_once_are_the_planners(counted, cell):
    from tests.models.gradient_cases import _job_config, tiny_model_args
    from torchtitan_ext.planning.memory_plan import replica_copies_alive
    from torchtitan_ext.training import prepare

    prepare()
    job_config = _job_config(cell, 2, 2)
    tiny = tiny_model_args(cell.model, cell.grouped_mm)
    # the tiny model, all on one stage: DeepSeek-V3's layer 0 dense, its layers 1-3 MoE; GPT-OSS's 2 layers MoE
    layers = list(range(tiny.n_layers))
    moe_layers = layers[getattr(tiny, "n_dense_layers", 0):]
    copies, fetched = replica_copies_alive(job_config, layers, moe_layers, copied=cell.grouped_mm)
    home, slots = tiny.moe_args.num_experts // 2, cell.replicas
    for rank_results in counted:
        result = rank_results[cell.id]["replica_copies"]
        shapes = result["expert_shapes"]
        planned = (copies * (home + slots) + fetched * slots) * sum(map(math.prod, shapes))
        # the planner's peak (copies of L + S experts, fetched replicas of S) is the most alive at once, to the
        # element for bias-free experts; GPT-OSS's copies of its biases may be gone by then (laying a bias over the
        # rows, an index, saves no copy for backward, where a GEMM saves its weights')
        weights = [shape for shape in shapes if len(shape) > 1]
        biases = copies * (home + slots) * sum(math.prod(shape) for shape in shapes if len(shape) == 1)
        assert planned - biases <= result["most_elements"] <= planned, (copies, fetched, result)
        assert copies * len(weights) <= result["most"]["copies"] <= copies * len(shapes), result
        assert result["after_backward"] == {"copies": 0, "fetched": 0}, result
        if cell.model != "deepseek_v3":
            continue  # what follows counts DeepSeek-V3's 3 MoE layers
        # what forward leaves for backward: what every layer computed from; none (recomputed); the fetched
        # replicas of every layer (per-op checkpointing saves them; the grouped GEMMs' copy is rebuilt from them);
        # layer 2's, the one layer that every-2-layers checkpointing does not wrap
        mode = cell.name.removeprefix("replicas2_ac_").removesuffix("_grouped_mm")
        kept, saved_fetched = KEPT_BY_FORWARD[mode], 3 if mode == "per_op" else 0
        if cell.grouped_mm:
            assert result["at_forward_end"] == {"copies": kept * len(shapes), "fetched": saved_fetched}, result
        else:
            assert result["at_forward_end"] == {"copies": 0, "fetched": kept + saved_fetched}, result
        # at the peak: a layer's fetched replicas and the next layer's, fetched ahead, beside what the layers below
        # kept where they hold their fetched replicas (per-op checkpointing; the loop with no checkpointing: all 3)
        assert result["most"]["fetched"] == MOST_FETCHED[mode, cell.grouped_mm], result


KEPT_BY_FORWARD = {"none": 3, "full": 0, "per_op": 0, "every_2_layers": 1}
MOST_FETCHED = {("none", True): 2, ("full", True): 2, ("per_op", True): 3, ("every_2_layers", True): 2,
                ("none", False): 3, ("full", False): 2, ("per_op", False): 3, ("every_2_layers", False): 2}
