"""Dry run: every shipped config, and every parallelism the plans keep, applies on a
fake process group with a meta-device model (no weights allocated)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torchtitan.distributed import activation_checkpoint
from torchtitan.protocols.train_spec import get_train_spec

from tests.helpers import DEBUG_FLAVOURS, REPO_ROOT
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.measuring.dry_run import dry_run
from torchtitan_ext.measuring import dry_run as dry_run_module
from torchtitan_ext.training import prepare

SHIPPED = {
    "debug_model.toml": 2,
    "llama4_debug_model.toml": 2,
    "deepseek_v3_16b.toml": 8,
    "deepseek_v3_671b_gb200.toml": 256,
    "llama4_17bx16e.toml": 32,
    "llama4_17bx128e_gb200.toml": 64,
    "qwen3_moe_debug_model.toml": 2,
    "gpt_oss_debug_model.toml": 2,
    "qwen3_30b_a3b.toml": 8,
    "qwen3_235b_a22b_gb200.toml": 64,
    "gpt_oss_20b.toml": 8,
    "gpt_oss_120b_gb200.toml": 64,
}

PARALLELISMS = {
    "fsdp_ep": (2, []),
    "tp_sp_ep_borrowing_tp": (8, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp_etp": (8, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]),
    "hsdp_ep": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "pp_1f1b_ep": (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    "pp_dualpipev_ep": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV"]),
    "cp_ep": (4, ["--parallelism.context_parallel_degree", "2"]),
    "selective_op_ac": (2, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    "selective_layer_ac": (2, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]),
    "full_ac": (2, ["--activation_checkpoint.mode", "full"]),
    "tp_deepep": (8, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_comm_backend", "deepep"]),
    "pp_hybridep_non_blocking": (4, ["--parallelism.pipeline_parallel_degree", "2",
                                     "--parallelism.expert_parallel_comm_backend", "hybridep",
                                     "--hybridep.non_blocking_capacity_factor", "0.5"]),
}

FSDP_EP = {"batch": 2, "loss": 2, "fsdp": 2, "ep": 2}
TP_EP = {"batch": 4, "loss": 4, "fsdp": 4, "tp": 2, "ep": 2, "efsdp": 4}
PP_EP = {"pp": 2, "batch": 2, "loss": 2, "fsdp": 2, "ep": 2}
MESHES = {
    # torchtitan's one-dimensional meshes of size > 1. The debug job has EP = 2 and FSDP over what the other
    # degrees leave (dp_shard = world / (dp_replicate x cp x tp x pp)); batch = dp_replicate x dp_shard, loss =
    # batch x cp, fsdp = dp_shard x cp, efsdp = fsdp x tp / (ep x etp)
    "fsdp_ep": FSDP_EP,  # 2 ranks: dp_shard 2, efsdp 2 / 2 = 1
    "tp_sp_ep_borrowing_tp": TP_EP,  # 8 ranks: dp_shard 4, efsdp 4 x 2 / 2
    "tp_etp": {"batch": 4, "loss": 4, "fsdp": 4, "tp": 2, "ep": 2, "efsdp": 2, "etp": 2},  # efsdp 4 x 2 / (2 x 2)
    "hsdp_ep": {"batch": 4, "loss": 4, "dp_replicate": 2, "fsdp": 2, "ep": 2},  # 4 ranks: dp_shard 4 / 2
    "pp_1f1b_ep": PP_EP,  # 4 ranks: dp_shard 4 / 2
    "pp_dualpipev_ep": PP_EP,
    "cp_ep": {"batch": 2, "loss": 4, "fsdp": 4, "cp": 2, "ep": 2, "efsdp": 2},  # 4 ranks: dp_shard 2, fsdp 2 x 2
    "selective_op_ac": FSDP_EP,
    "selective_layer_ac": FSDP_EP,
    "full_ac": FSDP_EP,
    "tp_deepep": TP_EP,
    "pp_hybridep_non_blocking": PP_EP,
}
CHECKPOINTED = {
    # the debug job checkpoints nothing; each block is wrapped whole ("full"), per op ("op": with selective
    # checkpointing's context), or every second one (torchtitan counts blocks from 1)
    "selective_op_ac": lambda block: "op",
    "selective_layer_ac": lambda block: "full" if block % 2 else None,
    "full_ac": lambda block: "full",
}
REFUSED = {
    # what docs/models.md's refusals leave out (tests/config/test_model_limits.py holds each refusal)
    "qwen3": {"pp_1f1b_ep", "pp_dualpipev_ep", "pp_hybridep_non_blocking"},
    "gpt_oss": {"pp_1f1b_ep", "pp_dualpipev_ep", "pp_hybridep_non_blocking", "cp_ep", "tp_etp"},
}


@pytest.fixture(scope="module", autouse=True)
def harness():
    prepare()


_reports: dict[tuple, object] = {}
"""Dry runs by (arguments, world size): the 671B job's is read by two tests (a report is frozen)."""


def _dry_run(args, world_size):
    key = (tuple(args), world_size)
    if key not in _reports:
        try:
            _reports[key] = dry_run(load_job_config(args, device_type=None, world_size=world_size), world_size)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return _reports[key]


def test_guard_of_the_suites_coverage_every_shipped_config_dry_runs_below():
    """A guard of the suite's own coverage, not of the product: every shipped config has its world size here."""
    assert sorted(p.name for p in (REPO_ROOT / "train_configs").glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("config, world_size", sorted(SHIPPED.items()))
def test_shipped_config_dry_runs(config, world_size):
    """The model is torchtitan's flavour, whole; rank 0 holds its MoE layers' routed experts split over every rank
    of a data-parallel replica (EP x expert TP x expert FSDP = world / (PP x data_parallel_replicate)), and nothing
    is allocated."""
    args = ["--job.config_file", str(REPO_ROOT / "train_configs" / config)]
    report = _dry_run(args, world_size)
    job_config = load_job_config(args, device_type=None, world_size=world_size)
    spec = get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])  # update_from_config changes it in place
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    assert report.total_parameters == sum(parameter.numel() for parameter in model.parameters())
    experts = sum(parameter.numel() for name, parameter in model.named_parameters()
                  if ".moe.experts." in name and int(name.split(".")[1]) in report.rank_moe_layers)
    p = job_config.parallelism
    expert_shards = world_size // (p.pipeline_parallel_degree * p.data_parallel_replicate_degree)
    assert report.rank_expert_parameters == pytest.approx(experts / expert_shards, rel=0.01)
    assert report.parameter_devices == {"meta"}


def test_671b_report():
    report = _dry_run(["--job.config_file", str(REPO_ROOT / "train_configs/deepseek_v3_671b_gb200.toml")], 256)
    assert report.mesh == {"batch": 256, "loss": 256, "fsdp": 256, "ep": 64, "efsdp": 4}
    assert report.total_parameters == 671_026_404_352
    # FSDP over 256 ranks; routed experts over 64 EP ranks x 4 FSDP ranks
    assert report.rank_parameters == pytest.approx(report.total_parameters / 256, rel=0.01)
    assert report.ep_settings["environment"] == "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=64 USE_MNNVL=1"
    assert report.ep_settings["expert group padding"] == "multiples of 32 rows"
    assert report.converters == ("quantize.grouped_mm.mx",)


def _checkpointing(block) -> str | None:
    """How activation checkpointing wrapped a transformer block: "full", "op" (per-op selective) or None."""
    if not isinstance(block, CheckpointWrapper):
        return None
    return "op" if "context_fn" in block.checkpoint_fn.keywords else "full"


@pytest.mark.parametrize("model, name", [(model, name) for model in DEBUG_FLAVOURS for name in sorted(PARALLELISMS)
                                         if name not in REFUSED.get(model, ())])
def test_parallelism_applies(model, name, monkeypatch):
    """The plan builds the parallelism's mesh and wraps rank 0's blocks for activation checkpointing as configured
    (the model parts are read from the train spec's parallelize function, which the pipeline split calls per
    stage). A dry run applies TP as on GPUs, where Qwen3's is torchtitan's plan."""
    world_size, overrides = PARALLELISMS[name]
    parts = []
    spec = dry_run_module.get_train_spec(model)

    def parallelize(*args, **kwargs):
        parts.append(spec.parallelize_fn(*args, **kwargs))
        return parts[-1]

    monkeypatch.setattr(dry_run_module, "get_train_spec",
                        lambda model_name: dataclasses.replace(spec, parallelize_fn=parallelize))
    # torchtitan counts per-layer checkpointing's blocks across the process: start this model at 0
    monkeypatch.setattr(activation_checkpoint, "_layer_sac_count", 0)
    args = ["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"), "--model.name", model,
            "--model.flavor", DEBUG_FLAVOURS[model], *overrides]
    report = _dry_run(args, world_size)
    assert report.mesh == MESHES[name]
    blocks = {int(layer_id): _checkpointing(block) for part in parts for layer_id, block in part.layers.items()}
    assert blocks and sorted(blocks) == sorted(report.rank_layers)
    assert blocks == {block: CHECKPOINTED.get(name, lambda _: None)(block) for block in report.rank_layers}


def test_bad_degrees_are_rejected_before_building():
    with pytest.raises(ConfigError, match="expert_parallel_degree = 64 .* must divide dp_shard x cp x tp = 32"):
        _dry_run(["--job.config_file", str(REPO_ROOT / "train_configs/deepseek_v3_671b_gb200.toml")], 32)


def test_a_dense_model_dry_runs_without_moe_layers():
    """A model without routed experts (torchtitan's Llama3, whose blocks have no ``moe_enabled``) dry-runs with no MoE
    layer and no EP backend."""
    report = _dry_run(["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"), "--model.name", "llama3",
                       "--parallelism.expert_parallel_degree", "1"], 2)
    assert report.rank_layers and report.rank_moe_layers == ()
    assert report.rank_expert_parameters == 0
    assert report.ep_settings == {"backend": "none (no MoE layers)"}
