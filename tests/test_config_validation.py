"""Config parsing and validation: torchtitan keys unchanged, bad input named with its fix."""

import dataclasses

import pytest
import tomli_w
from torchtitan.config import JobConfig as TorchTitanJobConfig

from torchtitan_ext.config import ConfigError, comm_backend, parse_job_config, validate
from torchtitan_ext.models import register_train_specs
from torchtitan_ext.train import load_job_config

DEBUG_TOML = "train_configs/debug_model.toml"


@pytest.fixture(autouse=True, scope="module")
def specs():
    register_train_specs()


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def test_every_torchtitan_key_is_accepted(tmp_path):
    """A TOML with every torchtitan 0.2.2 section and key parses to the same values."""
    values = _without_none(dataclasses.asdict(TorchTitanJobConfig()))
    values["training"]["steps"] = 7
    values["parallelism"]["expert_parallel_degree"] = 2
    path = tmp_path / "all_keys.toml"
    path.write_bytes(tomli_w.dumps(values).encode())
    config = parse_job_config(["--job.config_file", str(path)])
    parsed = dataclasses.asdict(config)
    for section, keys in values.items():
        for key, value in keys.items():
            assert _without_none(parsed[section][key]) == value, f"{section}.{key}"


def test_cli_overrides_of_torchtitan_and_our_keys():
    config = parse_job_config([
        "--job.config_file", DEBUG_TOML,
        "--training.steps", "3",
        "--training.no-enable-cpu-offload",
        "--parallelism.expert_parallel_comm_backend", "hybridep",
        "--hybridep.non_blocking_capacity_factor", "0.5",
        "--activation_checkpoint.mode", "full",
    ])
    assert config.training.steps == 3
    assert config.hybridep.non_blocking_capacity_factor == 0.5
    assert config.activation_checkpoint.mode == "full"
    assert comm_backend(config) == "hybridep"


def test_standard_is_an_alias_of_nccl():
    config = parse_job_config(["--job.config_file", DEBUG_TOML, "--parallelism.expert_parallel_comm_backend", "standard"])
    assert comm_backend(config) == "nccl"


def _load(*overrides, device_type="cpu", world_size=2):
    return load_job_config(["--job.config_file", DEBUG_TOML, *overrides], device_type, world_size)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--parallelism.expert_parallel_comm_backend", "alltoall"),
         "parallelism.expert_parallel_comm_backend = 'alltoall' is not a backend"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "1.5"),
         "hybridep.non_blocking_capacity_factor = 1.5 is outside (0, 1]"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "0"),
         "hybridep.non_blocking_capacity_factor = 0.0 is outside (0, 1]"),
        (("--hybridep.non_blocking_capacity_factor", "0.5"),
         "[hybridep] non_blocking_capacity_factor is set but parallelism.expert_parallel_comm_backend is 'nccl'"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--deepep.implementation", "reference"),
         "[deepep] implementation is set but parallelism.expert_parallel_comm_backend is 'hybridep'"),
        (("--parallelism.expert_parallel_degree", "3"),
         "parallelism.expert_parallel_degree = 3 does not divide the model's 8 experts"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.ranks_per_nvlink_domain", "4"),
         "hybridep.ranks_per_nvlink_domain = 4 does not divide parallelism.expert_parallel_degree = 2"),
        (("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.implementation", "deep_ep"),
         "deepep.implementation = 'deep_ep' needs CUDA"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.implementation", "deep_ep"),
         "hybridep.implementation = 'deep_ep' needs CUDA"),
        (("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.num_sms", "3"),
         "deepep.num_sms = 3: use an even integer >= 2"),
        (("--parallelism.data_parallel_shard_degree", "4"),
         "dp_replicate x dp_shard x cp x tp x pp = 4 but the world size is 2"),
        (("--model.flavor", "tiny"), "model.flavor = 'tiny' is not a flavour of deepseek_v3"),
        (("--parallelism.expert_parallel_comm_backend", "hybridep", "--parallelism.expert_parallel_degree", "1"),
         "'hybridep' needs expert parallelism, but expert_parallel_degree = 1"),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as error:
        _load(*overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_non_blocking_hybridep_rejects_overlapped_dualpipev():
    with pytest.raises(ConfigError, match="non-blocking HybridEP cannot serve pipeline_parallel_schedule = 'DualPipeV'"):
        _load(
            "--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "0.8",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
            world_size=4,
        )
    _load("--parallelism.expert_parallel_comm_backend", "hybridep",
          "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
          world_size=4)


def test_expert_tensor_parallel_rejected_for_kernel_backends():
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree = 2 is not supported by the 'deepep' backend"):
        _load(
            "--parallelism.expert_parallel_comm_backend", "deepep",
            "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.expert_tensor_parallel_degree", "2",
            world_size=4,
        )


def test_valid_backend_configs_pass():
    for overrides in (
        (),
        ("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.implementation", "reference"),
        ("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "1.0",
         "--hybridep.ranks_per_nvlink_domain", "2", "--hybridep.use_mnnvl", "True"),
    ):
        _load(*overrides)


def test_auto_on_cuda_without_deep_ep_is_an_error():
    """No silent fallback: on CUDA, auto means the library, and its absence says how to install it."""
    import importlib.util

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")  # the error path needs a machine without it
    for backend, branch in (("deepep", "DeepEP"), ("hybridep", "hybrid-ep branch")):
        with pytest.raises(ConfigError) as error:
            _load("--parallelism.expert_parallel_comm_backend", backend, device_type="cuda")
        message = str(error.value)
        assert f"{backend}.implementation resolves to the deep_ep library on CUDA" in message
        assert branch in message and f"{backend}.implementation = 'reference'" in message


def test_validate_needs_no_process_group():
    config = parse_job_config(["--job.config_file", DEBUG_TOML])
    validate(config, device_type="cpu", num_experts=8, world_size=None)
