"""What Qwen3-MoE and GPT-OSS cannot run is refused at validation, in one line naming the field and the fix, before
any process group or allocation; the same settings on DeepSeek-V3 (standard experts, a pipeline split) pass."""

import pytest

from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.training import prepare

QWEN3 = "train_configs/qwen3_moe_debug_model.toml"
GPT_OSS = "train_configs/gpt_oss_debug_model.toml"
DEEPSEEK_V3 = "train_configs/debug_model.toml"
LIMITS = {
    # name: (config, overrides, world size, the refusal's start)
    "pipeline": (QWEN3, ("--parallelism.pipeline_parallel_degree", "2"), 4,
                 "parallelism.pipeline_parallel_degree = 2: torchtitan 0.2.2 gives qwen3 no pipeline split"),
    "gpt_oss_pipeline": (GPT_OSS, ("--parallelism.pipeline_parallel_degree", "2"), 4,
                         "parallelism.pipeline_parallel_degree = 2: torchtitan 0.2.2 gives gpt_oss no pipeline split"),
    "qwen3_tp_on_cpu": (QWEN3, ("--parallelism.tensor_parallel_degree", "2"), 4,
                        "parallelism.tensor_parallel_degree = 2 on a CPU: torchtitan's Qwen3 TP plan"),
    "context_parallel": (GPT_OSS, ("--parallelism.context_parallel_degree", "2"), 4,
                         "parallelism.context_parallel_degree = 2: model.flavor = 'debugmodel_small' uses flex"),
    "expert_tp": (GPT_OSS, ("--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree",
                            "2"), 4,
                  "parallelism.expert_tensor_parallel_degree = 2: expert TP under EP splits w1, w3 by column"),
}


@pytest.fixture(autouse=True, scope="module")
def specs():
    prepare()


@pytest.mark.parametrize("limit", LIMITS)
def test_refused_in_one_line(limit):
    config, overrides, world_size, message = LIMITS[limit]
    with pytest.raises(ConfigError) as error:
        load_job_config(["--job.config_file", config, *overrides], "cpu", world_size=world_size)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("limit", ["pipeline", "expert_tp"])
def test_the_standard_model_runs_them(limit):
    _, overrides, world_size, _ = LIMITS[limit]
    load_job_config(["--job.config_file", DEEPSEEK_V3, *overrides], "cpu", world_size=world_size)
