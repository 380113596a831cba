"""torchtitan's converters are refused in one line where the installed torchao lacks what they import."""

import pytest

import torchtitan_ext.training  # noqa: F401  (every section and check, the converters' among them)
from torchtitan_ext.config import ConfigError, load_job_config

GB200_JOB = ["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml", "--hybridep.implementation", "reference"]


def test_converters_the_installed_torchao_cannot_serve_are_refused_where_the_job_would_run():
    """torchtitan 0.2.2's MXFP8 converters import torchao's MoETrainingConfig and MXLinearConfig, which the torchao
    installed beside torch 2.13 (0.17 and later) does not have: the job would fail at model conversion. A dry run
    for another machine prices the GB200 job as shipped."""
    with pytest.raises(ConfigError, match=r"^model.converters = \['quantize.grouped_mm.mx'\]: torchtitan's "
                                          r"quantize.grouped_mm.mx converter needs torchao names that torchao \S+ "
                                          r"has no MoETrainingConfig, MoEScalingType in torchao.prototype.moe_training"
                                          r".conversion_utils: remove quantize.grouped_mm.mx from model.converters"):
        load_job_config(GB200_JOB, device_type="cuda", world_size=256)
    assert load_job_config(GB200_JOB, device_type=None, world_size=256).model.converters == ["quantize.grouped_mm.mx"]
    with pytest.raises(ConfigError, match=r"torchao \S+ has no MXLinearConfig in torchao.prototype.mx_formats.config"):
        load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--model.converters",
                         "quantize.linear.mx"], device_type="cpu", world_size=2)
