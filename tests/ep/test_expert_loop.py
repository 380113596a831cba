"""The routed experts' per-expert loop (no grouped GEMMs): torchtitan's outputs and gradients, each stacked
weight's gradient written once instead of once per expert, and the loop every MoE layer runs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.moe.moe import _run_experts_for_loop

from torchtitan_ext.ep.experts import run_experts_for_loop


class StackSizedOutputs(TorchDispatchMode):
    """Counts the ops that write an output of ``numel`` elements (one projection's stacked weight; views write
    nothing)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        self.count += sum(isinstance(t, torch.Tensor) and t.numel() == self.numel
                          for t in (out if isinstance(out, (tuple, list)) else (out,)))
        return out


def _backward(loop, experts: int) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The loop's output on 3 padding rows past 20 routed ones, its gradients (w1, w2, w3, tokens) and the ops of
    its backward that wrote a whole projection's stack."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(experts, *shape, generator=generator, requires_grad=True)
               for shape in ((32, 16), (16, 32), (32, 16))]
    tokens = torch.randn(23, 16, generator=generator, requires_grad=True)
    counts = torch.tensor([5, 0, 3, 7, 1, 4])
    out = loop(*weights, tokens, counts)
    with StackSizedOutputs(weights[0].numel()) as written:
        out.backward(torch.randn(out.shape, generator=generator))
    return out, [w.grad for w in weights] + [tokens.grad], written.count


def test_the_loop_equals_torchtitans_and_writes_each_weights_gradient_once():
    out, grads, written = _backward(run_experts_for_loop, 6)
    expected_out, expected_grads, torchtitans_written = _backward(_run_experts_for_loop, 6)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(grad, expected) for grad, expected in zip(grads, expected_grads))
    # one stacked gradient per projection; torchtitan's indexing writes a zero-filled stack per expert and sums them
    assert written == 3
    assert torchtitans_written >= 3 * 6


@pytest.mark.parametrize("config", ["debug_model.toml", "llama4_debug_model.toml"])
def test_under_the_parallelize_plan_every_moe_layer_writes_each_weights_gradient_once(world_of_one, config):
    """The plan applied as training applies it: every MoE layer's experts, run forward and backward on rows routed
    to all of its experts, write one stacked gradient per projection (torchtitan's loop writes one per expert)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_ext.config import load_job_config, meta_model
    from torchtitan_ext.training import prepare

    prepare()
    args = ["--job.config_file", f"train_configs/{config}", "--parallelism.expert_parallel_degree", "1"]
    job_config = load_job_config(args, "cpu", 1)
    model = meta_model(job_config)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    get_train_spec(job_config.model.name).parallelize_fn(model, dims, job_config)
    layers = [block.moe.experts for block in model.layers.values() if block.moe_enabled]
    assert layers
    generator = torch.Generator().manual_seed(0)
    for experts in layers:
        experts.to_empty(device="cpu")
        for parameter in experts.parameters():
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        counts = torch.arange(1, experts.num_experts + 1)
        tokens = torch.randn(int(counts.sum()), experts.w1.shape[-1], generator=generator)
        out = experts(tokens, counts)
        with StackSizedOutputs(experts.w1.numel()) as written:
            out.backward(torch.ones_like(out))
        assert written.count == 3
