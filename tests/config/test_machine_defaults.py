"""Defaults this machine decides (torchtitan_ext.config.machine): a CPU job's precision from the CPU's bf16 support."""

import pytest
import torch

from torchtitan_ext.config import machine

DEBUG_TOML = "train_configs/debug_model.toml"


def _precision(monkeypatch, cpu_bf16: str, config_file: str = DEBUG_TOML, *overrides: str) -> str:
    """training.mixed_precision_param after loading a CPU job on a CPU whose bf16 support is ``cpu_bf16``."""
    from torchtitan_ext.training.specs import register_train_specs
    from torchtitan_ext.config import load_job_config

    register_train_specs()
    monkeypatch.setenv(machine.CPU_BF16_ENV, cpu_bf16)
    job_config = load_job_config(["--job.config_file", str(config_file), *overrides], "cpu", 2)
    return job_config.training.mixed_precision_param


def test_cpu_without_native_bf16_trains_in_fp32_by_default(monkeypatch):
    assert _precision(monkeypatch, "emulated") == "float32"
    assert _precision(monkeypatch, "native") == "bfloat16"


def test_explicit_precision_is_respected(monkeypatch, tmp_path):
    for override in (["--training.mixed_precision_param", "bfloat16"], ["--training.mixed-precision-param=bfloat16"]):
        assert _precision(monkeypatch, "emulated", DEBUG_TOML, *override) == "bfloat16"
    toml = tmp_path / "bf16.toml"
    toml.write_text(open(DEBUG_TOML).read().replace("[training]\n", '[training]\nmixed_precision_param = "bfloat16"\n'))
    assert _precision(monkeypatch, "emulated", toml) == "bfloat16"


def test_precision_choice_explains_itself(monkeypatch):
    from torchtitan_ext.config import parse as parse_job_config

    monkeypatch.setenv(machine.CPU_BF16_ENV, "emulated")
    job_config = parse_job_config(["--job.config_file", DEBUG_TOML])
    line = machine.choose_cpu_precision(job_config, explicit=set())
    assert line == (
        "CPU precision: training.mixed_precision_param = float32 instead of the default bfloat16, because "
        "TORCHTITAN_EXT_CPU_BF16=emulated and emulated bf16 GEMMs are several times slower; "
        "set training.mixed_precision_param to override"
    )
    assert machine.PRECISION_LOG.fullmatch(line)[1] == "float32"  # as the bench tools read a run's precision
    explicit = machine.choose_cpu_precision(
        parse_job_config(["--job.config_file", DEBUG_TOML]), explicit={"training.mixed_precision_param"}
    )
    assert "as configured" in explicit and "several times slower" in explicit


def test_probe_reads_cpu_features(monkeypatch):
    monkeypatch.delenv(machine.CPU_BF16_ENV, raising=False)
    native, evidence = machine.cpu_bf16_support()
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native == expected
    assert ("has AMX" in evidence or "has AVX512_BF16" in evidence) == expected


def test_bad_probe_override_is_an_error(monkeypatch):
    from torchtitan_ext.config import ConfigError

    monkeypatch.setenv(machine.CPU_BF16_ENV, "fast")
    with pytest.raises(ConfigError, match="TORCHTITAN_EXT_CPU_BF16='fast': use 'native' or 'emulated'"):
        machine.cpu_bf16_support()
