"""torchtitan's grouped-GEMM converters are refused in one line where the installed torchao cannot serve them."""

import pytest

import torchtitan_ext.training  # noqa: F401  (every section and check, the converters' among them)
from torchtitan_ext.config import ConfigError, load_job_config

GB200_JOB = ["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml", "--hybridep.implementation", "reference"]


def test_the_mxfp8_experts_of_the_gb200_job_are_refused_where_it_would_run_and_priced_elsewhere():
    """torchtitan 0.2.2's converter imports torchao's MoETrainingConfig, which the torchao installed beside
    torch 2.13 (0.17 and later) does not have: the job would fail at model conversion."""
    with pytest.raises(ConfigError, match=r"^model.converters = \['quantize.grouped_mm.mx'\]: torchtitan 0.2.2 "
                                          r"converts the experts with torchao's MoETrainingConfig, and torchao "
                                          r"\S+ has none \(removed in 0.17\); .*: remove it from model.converters"):
        load_job_config(GB200_JOB, device_type="cuda", world_size=256)
    assert load_job_config(GB200_JOB, device_type=None, world_size=256).model.converters == ["quantize.grouped_mm.mx"]
