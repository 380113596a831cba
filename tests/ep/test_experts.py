"""The routed experts as the harness runs them: torchtitan's outputs and gradients; the per-expert loop writing each
stacked parameter's gradient once instead of once per expert, GPT-OSS's grouped GEMMs without a host sync, and
every MoE layer running them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.gpt_oss.model import moe as gpt_oss_moe
from torchtitan.models.moe.moe import _run_experts_for_loop

from tests.helpers import planned_experts
from torchtitan_ext.ep.experts import run_experts_for_loop, run_gpt_oss_experts_for_loop, run_gpt_oss_experts_grouped_mm
from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter


class StackSizedOutputs(TorchDispatchMode):
    """Counts the ops that write an output of one of ``numels`` elements (a stacked parameter's; views write
    nothing)."""

    def __init__(self, *numels: int):
        super().__init__()
        self.numels, self.count = set(numels), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        self.count += sum(isinstance(t, torch.Tensor) and t.numel() in self.numels
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


def _gpt_oss_inputs(experts: int, dim: int, hidden: int, device: str = "cpu",
                    counts_dtype=torch.int64) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS's experts' parameters (mlp1's weight and bias, mlp2's), 23 token rows of which the first
    sum(counts) are routed and the rest padding, as a dispatch leaves them, the rows per expert (one expert gets
    none), and an output gradient that is zero on the padding rows (whose output grouped GEMMs leave undefined)."""
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.randn(experts, *shape, generator=generator).to(device).requires_grad_()
                  for shape in ((2 * hidden, dim), (2 * hidden,), (dim, hidden), (dim,))]
    tokens = torch.randn(23, dim, generator=generator).to(device).requires_grad_()
    counts = torch.tensor([5, 0, 3, 7, 1, 4][:experts], dtype=counts_dtype)
    grad = torch.randn(23, dim, generator=generator)
    grad[int(counts.sum()):] = 0
    return parameters, tokens, counts.to(device), grad.to(device)


def _gpt_oss_backward(run, experts: int, dim: int, hidden: int, tp_degree: int = 1,
                      counts_dtype=torch.int64) -> tuple[torch.Tensor, list[torch.Tensor], int, int]:
    """GPT-OSS's experts (``run``: torchtitan's signature) on :func:`_gpt_oss_inputs`: the routed rows' output and the
    gradients (the parameters', the routed tokens'), the ops of the backward that wrote a whole parameter's stack,
    and the host syncs of the forward and backward as a GPU would pay them."""
    parameters, tokens, counts, grad = _gpt_oss_inputs(experts, dim, hidden, counts_dtype=counts_dtype)
    with DeviceCostCounter() as counter:
        out = run(*parameters, 7.0, tokens, counts, tp_degree)
        with StackSizedOutputs(*(p.numel() for p in parameters)) as written:
            out.backward(grad)
    syncs = sum(costs.syncs for costs in counter.costs.values())
    routed = int(counts.sum())
    return out[:routed], [p.grad for p in parameters] + [tokens.grad[:routed]], written.count, syncs


def test_gpt_oss_loop_equals_torchtitans_and_writes_each_parameters_gradient_once():
    # sizes no token-sized tensor of the backward shares with a stacked parameter
    out, grads, written, _ = _gpt_oss_backward(run_gpt_oss_experts_for_loop, 6, 18, 11)
    expected_out, expected_grads, torchtitans_written, _ = _gpt_oss_backward(gpt_oss_moe._run_experts_for_loop, 6,
                                                                             18, 11)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(grad, expected) for grad, expected in zip(grads, expected_grads))
    assert written == 4
    assert torchtitans_written >= 4 * 6


@pytest.mark.parametrize("tp_degree, counts_dtype", [(1, torch.int64), (2, torch.int32)])
def test_gpt_oss_grouped_gemms_equal_torchtitans_without_a_host_sync(tp_degree, counts_dtype):
    """Bit for bit, the second bias's division by the TP degree included, whichever integer type a backend gives the
    group sizes in; the counter sees torchtitan's reads of the group sizes, and none here."""
    # bf16 rows of a multiple of 16 bytes, as grouped GEMMs take them
    shape = (4, 24, 16, tp_degree, counts_dtype)
    out, grads, _, syncs = _gpt_oss_backward(run_gpt_oss_experts_grouped_mm, *shape)
    expected_out, expected_grads, _, torchtitans_syncs = _gpt_oss_backward(gpt_oss_moe._run_experts_grouped_mm, *shape)
    assert torch.equal(out, expected_out.float())  # torchtitan's GPT-OSS returns bf16 for fp32 tokens
    assert all(torch.equal(grad, expected) for grad, expected in zip(grads, expected_grads))
    assert syncs == 0
    assert torchtitans_syncs == 4  # its forward's two repeat_interleave without output_size and two int(offsets[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpt_oss_grouped_gemms_on_a_gpu_never_make_the_host_wait():
    """On CUDA with every host sync an error (``torch.cuda.set_sync_debug_mode``), forward and backward, against
    torchtitan's run without that mode. The outputs are equal; the gradients within fp32 rounding (CUDA's
    ``index_add`` sums a bias's rows in no fixed order)."""
    results = []
    for run, sync_mode in ((gpt_oss_moe._run_experts_grouped_mm, "default"), (run_gpt_oss_experts_grouped_mm, "error")):
        parameters, tokens, counts, grad = _gpt_oss_inputs(4, 64, 32, "cuda")
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            out = run(*parameters, 7.0, tokens, counts, 1)
            out.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        routed = int(counts.sum())
        results.append((out[:routed].float(), [p.grad for p in parameters] + [tokens.grad[:routed]]))
    (expected_out, expected_grads), (out, grads) = results
    assert torch.equal(out, expected_out)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("config", ["debug_model.toml", "llama4_debug_model.toml", "gpt_oss_debug_model.toml"])
def test_under_the_parallelize_plan_every_moe_layer_writes_each_parameters_gradient_once(world_of_one, config):
    """The plan applied as training applies it: every MoE layer's experts, run forward and backward on rows routed
    to all of its experts, write one stacked gradient per parameter (torchtitan's loop writes one per expert)."""
    layers = planned_experts(config, seed=0, scale=0.02)
    assert layers
    generator = torch.Generator().manual_seed(0)
    for experts in layers:
        parameters = list(experts.parameters())
        # 3 rows an expert: no row-sized tensor of the backward has a stacked parameter's size (a bias's, E x D)
        counts = torch.full((experts.num_experts,), 3)
        tokens = torch.randn(int(counts.sum()), parameters[0].shape[-1], generator=generator)
        out = experts(tokens, counts)
        with StackSizedOutputs(*(p.numel() for p in parameters)) as written:
            out.backward(torch.ones_like(out))
        assert written.count == len(parameters)
