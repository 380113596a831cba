"""EP planner: its sizes equal what the runtime allocates; drop estimates follow the tail rule."""

import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.moe.moe import GroupedExperts

from tests.helpers import REPO_ROOT, run_distributed, run_job
from torchtitan_ext import plan as plan_module
from torchtitan_ext.config import load_job_config
from torchtitan_ext.measuring.dry_run import dry_run
from torchtitan_ext.planning.memory_plan import Dimensions, expected_drop_rates, plan
from torchtitan_ext.training import prepare
from torchtitan_ext.training.specs import register_train_specs

WORLD = 2
JOB = [
    "--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"),
    "--parallelism.expert_parallel_comm_backend", "hybridep",
    "--hybridep.non_blocking_capacity_factor", "0.5",
    "--training.local_batch_size", "2", "--training.seq_len", "64",
]


@pytest.fixture(scope="module")
def harness():
    prepare()


def _plan(args):
    try:
        job_config = load_job_config(args, device_type=None, world_size=WORLD)
        return plan(job_config, dry_run(job_config, WORLD))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _allocate_worker(rank, world_size, args):
    """Build the job's HybridEP layers as training does; dispatch once; report allocations."""
    from torchtitan_ext.config import max_tokens_per_rank
    from torchtitan_ext.ep.base import Routing
    from torchtitan_ext.models.parallelize import expert_parallel_layers
    from torchtitan.protocols.train_spec import get_train_spec

    register_train_specs()
    job_config = load_job_config(list(args), device_type="cpu", world_size=world_size)
    model_args = get_train_spec("deepseek_v3").model_args["debugmodel"]
    style = expert_parallel_layers(job_config, model_args)(score_before_experts=False)
    experts = GroupedExperts(model_args.dim, model_args.moe_inter_dim, model_args.moe_args.num_experts, False)
    experts = experts.to(torch.bfloat16)
    torch.nn.init.normal_(experts.w1), torch.nn.init.normal_(experts.w2), torch.nn.init.normal_(experts.w3)
    parallelize_module(experts, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)), style)
    tokens = max_tokens_per_rank(job_config)
    top_k = model_args.moe_args.top_k
    x = torch.randn(tokens, model_args.dim, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(model_args.moe_args.num_experts)[:top_k] for _ in range(tokens)])
    captured = {}
    dispatch = style.dispatch

    def capture(*a):
        rows, counts = dispatch(*a)
        captured["rows"] = rows
        return rows, counts

    style.dispatch = capture
    experts(x, Routing(torch.rand(tokens, top_k), ids))
    buffer = style.buffer.get(None, x).value
    return {
        "backend": type(style).__name__,
        "buffer_bytes": buffer.nbytes,
        "rows": captured["rows"].shape[0],
        "row_bytes": captured["rows"][0].numel() * captured["rows"].element_size(),
        "regrowths": buffer.regrowths,
    }


@pytest.mark.slow
def test_planner_sizes_equal_the_allocations(harness):
    result = _plan(JOB)
    allocated = run_distributed(WORLD, _allocate_worker, JOB)
    by_name = {b.name: b for b in result.backends}
    non_blocking = by_name["hybridep non-blocking (capacity factor 0.5)"]
    for rank in allocated:
        assert rank["backend"] == "HybridEPExpertParallel"
        assert rank["buffer_bytes"] == non_blocking.buffer_bytes == by_name["hybridep blocking"].buffer_bytes
        assert rank["rows"] == non_blocking.rows_worst == non_blocking.rows_balanced
        assert rank["row_bytes"] == result.dims.hidden * result.dims.activation_bytes
        assert rank["regrowths"] == 0, "sized once from the config"
    # 5 MoE layers x 4 local experts x (w1, w2, w3) of 256 x 256
    assert result.dry_run.rank_expert_parameters == 5 * (8 // WORLD) * 3 * 256 * 256
    assert by_name["nccl"].buffer_bytes == 0 and not by_name["nccl"].can_drop
    assert non_blocking.can_drop


def test_saved_layers_follow_activation_checkpointing(harness):
    modes = {
        "none": ["--activation_checkpoint.mode", "none"],
        "full": ["--activation_checkpoint.mode", "full"],
        "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
        "every 2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    }
    saved = {name: _plan(JOB + args).backends[0].saved_layers for name, args in modes.items()}
    # debug model: 6 layers, layer 0 dense; every 2nd block (layers 1, 3, 5) is checkpointed
    assert saved == {"none": 5, "full": 0, "op": 5, "every 2": 2}


def test_replica_slots_enter_the_plan(harness):
    """2 slots: the debug model's expert is 3 x 256 x 256 weights; non-blocking HybridEP's fixed rows follow
    the dispatched slots (N x R x min(L + S, K) x factor), the worst case of the others as well."""
    from torchtitan_ext.planning.memory_plan import format_plan

    result = _plan(JOB + ["--expert_replication.slots_per_rank", "2"])
    dims = result.dims
    assert (dims.replica_slots, dims.expert_elements, dims.local_experts) == (2, 3 * 256 * 256, 4)
    non_blocking = next(b for b in result.backends if "non-blocking" in b.name)
    assert non_blocking.rows_worst == int(dims.tokens * 2 * min(4 + 2, 3) * 0.5)
    line = next(line for line in format_plan(result, WORLD) if "replica slots" in line)
    # 2 slots x 196,608 weights x 2 bytes (bf16) = 0.75 MiB; the copy the experts compute from holds the 4 home
    # experts too: 2.25 MiB per layer, kept by each of the 5 MoE layers without activation checkpointing, the last
    # layer's fetched replicas beside them while it computes
    assert line.startswith("  replica slots: 2 per MoE layer, weights fetched every step: 0.75 MiB per layer"), line
    assert line.endswith("a copy of the 4 home experts beside the replicas, 2.25 MiB per layer: 12.00 MiB at the peak "
                         "(5 layer(s)' copies and 1 layer(s)' fetched replicas alive at once under this activation "
                         "checkpointing)"), line
    # full: one layer's copy at a time, beside its fetched replicas and the next layer's (fetched ahead); per op:
    # every layer keeps its fetched replicas (replica_weights is on the save list, nothing is fetched ahead) and one
    # copy is rebuilt at a time; every 2 layers: MoE layers 2 and 4 keep theirs, and layer 5, the last, computes
    # beside them from its fetched replicas
    for ac, peak in ((["--activation_checkpoint.mode", "full"],
                      "3.75 MiB at the peak (1 layer(s)' copies and 2 layer(s)' fetched replicas"),
                     (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
                      "6.00 MiB at the peak (1 layer(s)' copies and 5 layer(s)' fetched replicas"),
                     (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
                      "7.50 MiB at the peak (3 layer(s)' copies and 1 layer(s)' fetched replicas")):
        checkpointed = _plan(JOB + ["--expert_replication.slots_per_rank", "2", *ac])
        line = next(line for line in format_plan(checkpointed, WORLD) if "replica slots" in line)
        assert peak in line, (ac, line)


def test_the_next_layers_fetched_replicas_count_only_where_it_is_the_next_block(harness):
    """Under full checkpointing one layer's copy is alive at a time, beside its fetched replicas and, where the next
    block is a MoE layer too, that layer's, fetched ahead; a dense block between two MoE layers (Llama4's
    interleaving) leaves nothing fetched ahead."""
    from torchtitan_ext.planning.memory_plan import replica_copies_alive

    job_config = load_job_config([*JOB, "--expert_replication.slots_per_rank", "2", "--activation_checkpoint.mode",
                                  "full"], device_type=None, world_size=WORLD)
    assert replica_copies_alive(job_config, [0, 1, 2, 3], [1, 2, 3], copied=True) == (1, 2)
    assert replica_copies_alive(job_config, [0, 1, 2, 3], [1, 3], copied=True) == (1, 1)


def test_expected_drops_follow_the_contract_example():
    """R=2, N=48, L=2, K=1, P=32, M=96: counts 49/47 pad to 64+64 rows, 15 of 96 pairs drop."""
    stats = {"tokens_per_expert": np.array([[[49, 47, 0, 0]]]), "layers": np.array([3])}
    dims = Dimensions(tokens=48, ep=2, local_experts=2, top_k=1, hidden=8, activation_bytes=2)
    overall, (layer, worst) = expected_drop_rates(stats, dims, num_rows=96, pad=32)
    assert overall == pytest.approx(15 / 96) and (layer, worst) == (3, pytest.approx(15 / 96))
    balanced = {"tokens_per_expert": np.array([[[24, 24, 24, 24]]]), "layers": np.array([3])}
    assert expected_drop_rates(balanced, dims, num_rows=96, pad=32)[0] == 0.0


@pytest.mark.slow
def test_cli(capsys):
    with pytest.raises(SystemExit) as missing:
        plan_module.main(JOB)
    assert missing.value.code == 2
    assert ("the world size is open (parallelism.data_parallel_shard_degree = -1): set NGPU=N (the python -m tools also take --world-size N)"
            in capsys.readouterr().err)
    # the module's own entry point, as a user runs it
    command = [sys.executable, "-m", "torchtitan_ext.plan", *JOB]
    result = run_job(command + ["--world-size", "2"], timeout_s=300, cwd=REPO_ROOT)
    assert "EP plan: deepseek_v3 debugmodel on 2 ranks, for one rank" in result.output
    assert "[hybridep non-blocking (capacity factor 0.5)]" in result.output
    assert "can drop tokens: yes" in result.output


def test_deepep_v2_5_plan_names_the_load_balancing_region():
    """With api = 'ep' and replica slots, the EPBuffer also reserves the replicas' region (their weights in
    the compute dtype and fp32 gradients, each tensor 2 MiB-aligned): 671B, 2 slots of 3 x 7168 x 2048
    elements, bf16: 168 MiB + 336 MiB."""
    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.ep.deepep import DeepEPPlanningProfile

    register_train_specs()
    job_config = parse(["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml", "--deepep.api", "ep",
                        "--expert_replication.slots_per_rank", "2"])
    shape = MoEShape(hidden_dim=7168, num_experts=256, top_k=8, max_tokens_per_rank=4096)
    size, note = DeepEPPlanningProfile.planned_buffer(job_config, shape)
    assert size is None
    assert note.endswith("; where its load-balancing kernels carry the replicas, a further 504 MiB (the 2 replicas' "
                         "weights and fp32 gradients, each 2 MiB-aligned)"), note
    job_config.deepep.api = "elastic"
    assert "load-balancing" not in DeepEPPlanningProfile.planned_buffer(job_config, shape)[1]
