"""The job config's settings that torchtitan's MoE model arguments read reach every model family's layers alike."""

import pytest

from torchtitan_ext.config import load_job_config, meta_model
from torchtitan_ext.training import prepare

DEBUG_CONFIGS = {
    "deepseek_v3": "train_configs/debug_model.toml",
    "llama4": "train_configs/llama4_debug_model.toml",
    "qwen3": "train_configs/qwen3_moe_debug_model.toml",
    "gpt_oss": "train_configs/gpt_oss_debug_model.toml",
}


@pytest.mark.parametrize("model", DEBUG_CONFIGS)
def test_forced_balance_reaches_every_router(model):
    """--debug.moe_force_load_balance (what bench replication's ideal arm routes by): torchtitan's GPT-OSS arguments
    alone never read it."""
    prepare()
    job_config = load_job_config(["--job.config_file", DEBUG_CONFIGS[model], "--debug.moe_force_load_balance"],
                                 "cpu", world_size=2)
    routers = [block.moe.router for block in meta_model(job_config).layers.values() if block.moe_enabled]
    assert routers and all(router._debug_force_load_balance for router in routers)
