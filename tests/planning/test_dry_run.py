"""Dry run: every shipped config, and every parallelism the plans keep, applies on a
fake process group with a meta-device model (no weights allocated)."""

import pytest
import torch.distributed as dist

from tests.helpers import REPO_ROOT
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.planning.dry_run import dry_run
from torchtitan_ext.training import prepare

SHIPPED = {
    "debug_model.toml": 2,
    "llama4_debug_model.toml": 2,
    "deepseek_v3_16b.toml": 8,
    "deepseek_v3_671b_gb200.toml": 256,
    "llama4_17bx16e.toml": 32,
    "llama4_17bx128e_gb200.toml": 64,
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


@pytest.fixture(scope="module", autouse=True)
def harness():
    prepare()


def _dry_run(args, world_size):
    try:
        return dry_run(load_job_config(args, device_type=None, world_size=world_size), world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_every_shipped_config_is_listed():
    assert sorted(p.name for p in (REPO_ROOT / "train_configs").glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("config, world_size", sorted(SHIPPED.items()))
def test_shipped_config_dry_runs(config, world_size):
    report = _dry_run(["--job.config_file", str(REPO_ROOT / "train_configs" / config)], world_size)
    assert report.world_size == world_size
    assert 0 < report.rank_parameters < report.total_parameters
    assert report.ep_settings["backend"].endswith("ExpertParallel")
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


@pytest.mark.parametrize("model", ["deepseek_v3", "llama4"])
@pytest.mark.parametrize("name", sorted(PARALLELISMS))
def test_parallelism_applies(model, name):
    world_size, overrides = PARALLELISMS[name]
    args = ["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"), "--model.name", model, *overrides]
    report = _dry_run(args, world_size)
    assert report.world_size == world_size
    if "pipeline_parallel_degree" in overrides:
        assert report.mesh["pp"] == 2
    if "tensor_parallel_degree" in overrides:
        assert report.mesh["tp"] == 2


def test_bad_degrees_are_rejected_before_building():
    with pytest.raises(ConfigError, match="expert_parallel_degree = 64 .* must divide dp_shard x cp x tp = 32"):
        _dry_run(["--job.config_file", str(REPO_ROOT / "train_configs/deepseek_v3_671b_gb200.toml")], 32)
