"""Backward passes zero-fill nothing they do not need.

The nccl combine's backward gets no gradient for its returned rows, an output kept only for the scores' gradient:
autograd would otherwise fill a zero tensor of their size first, one pass over every row the rank sent (1.88 GB per
MoE layer at the 671B GB200 job's shape). Expert replication's backward writes each home weight's gradient once."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_ext.ep.nccl import NcclExpertParallel

ZERO_FILLS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default,
              torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar}


class _ZeroFills(TorchDispatchMode):
    """The element counts of the tensors zero-filled while it is active."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ZERO_FILLS and (func is not torch.ops.aten.fill_.Scalar or args[1] == 0):
            self.sizes.append(out.numel())
        return out


def test_the_nccl_combines_backward_fills_no_zero_rows_for_the_returned_rows(world_of_one):
    generator = torch.Generator().manual_seed(0)
    num_tokens, hidden, experts, top_k = 24, 16, 4, 2
    x = torch.randn(num_tokens, hidden, generator=generator)
    scores = torch.rand(num_tokens, top_k, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    style = NcclExpertParallel(pad_multiple=8, score_before_experts=False)
    groups, _ = style.dispatch(x, scores, ids, experts, world_of_one)
    groups = groups.detach().requires_grad_()  # identity experts; only the combine's backward runs
    out = style.combine(groups, world_of_one)
    with _ZeroFills() as fills:
        out.backward(torch.randn(num_tokens, hidden, generator=generator))
    # the scores' fp32 dot products start from a 1 x 1 zero (seen: the mode records autograd's work); nothing the
    # size of a row or more is zeroed
    assert groups.grad is not None and 1 in fills.sizes and max(fills.sizes) < hidden, fills.sizes


class _HomeSizedWrites(TorchDispatchMode):
    """The operators that write a tensor of ``numel`` elements (views aside), in order."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.writes = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.writes.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("sent", [[2], []], ids=["one_expert_sent", "none_sent"])
@pytest.mark.parametrize("stacked", [True, False], ids=["grouped_gemms", "per_expert_loop"])
def test_the_replicas_gradients_are_added_to_their_home_experts_in_one_write(world_of_one, sent, stacked):
    """Each home weight's gradient is written once, the replicas' gradients added as it is (on a rank that sends no
    expert, never: the concatenation's slice, or the loop's stacked gradients, is its gradient): no zero-filled
    gradient of the home weights for autograd to add to their own (two more passes over a rank's home experts:
    704 MB per MoE layer and step at the 671B GB200 job's shape at EP=64, 4 home experts of 88 MB in bf16). The
    grouped GEMMs' weights are a concatenation, whose home slice is copied once with the replicas' gradients added;
    the per-expert loop's are views, whose gradients are stacked once and added to in place."""
    from torch.distributed.distributed_c10d import _get_process_group_name

    from torchtitan_ext.ep.replication.experts import ReplicaExchange, with_replicas

    generator = torch.Generator().manual_seed(0)
    home_experts, dim, hidden = 4, 8, 6
    home = [torch.randn(home_experts, *shape, generator=generator, requires_grad=True)
            for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    # a group of one: expert 2 is copied into the rank's one slot, or the slot is unused
    sent_local = torch.tensor(sent, dtype=torch.int64)
    exchange = ReplicaExchange(sent_local, [len(sent)], [len(sent)], sent_local)
    mapping = torch.tensor([sent or [-1]], dtype=torch.int32)
    weights = with_replicas(home, exchange, mapping, 1, _get_process_group_name(world_of_one), stacked=stacked)
    if not stacked:  # one list per projection of the L + 1 experts' weights, each a view
        assert all(expert._is_view() for projection in weights for expert in projection)
        weights = [expert for projection in weights for expert in projection]
    grads = [torch.randn(weight.shape, generator=generator) for weight in weights]
    with _HomeSizedWrites(home[0].numel()) as writes:
        torch.autograd.backward(weights, grads)
    if stacked:
        assert writes.writes == ["index_add"] * len(home) * len(sent), writes.writes
        per_projection = grads
    else:
        assert writes.writes == ["stack"] * len(home) + ["index_add_"] * len(home) * len(sent), writes.writes
        per_projection = [torch.stack(grads[start:start + home_experts + 1])
                          for start in range(0, len(grads), home_experts + 1)]
    for weight, grad in zip(home, per_projection):
        expected = grad[:home_experts].clone()
        expected[sent] += grad[home_experts]
        assert torch.equal(weight.grad, expected)
