"""Each model's train spec balances its routed experts without an auxiliary loss: every optimizer step moves each MoE
layer's routing bias toward equal load. This is DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moves
by ``load_balance_coeff`` times the sign of (the layer's mean load - the expert's load), up for an expert that took
fewer tokens than the mean and down for one that took more; torchtitan then centres the layer's step on zero.
torchtitan 0.2.2's own Qwen3 spec sets the coefficient and builds an optimizer that never applies it."""

import pytest
import torch
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe import MoE
from torchtitan.protocols.train_spec import get_train_spec

from tests.helpers import DEBUG_FLAVOURS, REPO_ROOT
from torchtitan_ext.config import load_job_config, meta_model
from torchtitan_ext.training import prepare


@pytest.mark.parametrize("name", DEBUG_FLAVOURS)
def test_an_optimizer_step_moves_each_expert_bias_toward_equal_load(name, world_of_one):
    prepare()
    job_config = load_job_config(["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"),
                                  "--model.name", name, "--model.flavor", DEBUG_FLAVOURS[name]], "cpu")
    model = meta_model(job_config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    assert layers and all(layer.load_balance_coeff for layer in layers)
    one_rank = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = get_train_spec(name).build_optimizers_fn([model], job_config.optimizer, one_rank)
    generator = torch.Generator().manual_seed(0)
    loads, before = [], []
    for layer in layers:
        # the tokens each expert took over the step, as the layer counts them in its forward
        load = torch.randint(0, 100, layer.tokens_per_expert.shape, generator=generator)
        load = load.to(layer.tokens_per_expert.dtype)
        layer.tokens_per_expert.copy_(load)
        loads.append(load.double())
        before.append(layer.expert_bias.double().clone())
    optimizers.step()  # no parameter has a gradient: only the balancing runs
    for layer, load, bias in zip(layers, loads, before):
        step = layer.load_balance_coeff * torch.sign(load.mean() - load)
        torch.testing.assert_close(layer.expert_bias.double() - bias, step - step.mean(), rtol=0, atol=1e-7)
        assert not layer.tokens_per_expert.any(), "the count starts again at the next step"
