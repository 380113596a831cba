"""Score products in bf16: rows times their fp32 scores computed in fp32 and rounded once, and the scores'
gradient summed over exact fp32 products, as the dense fp32 formula gives them, bit for bit, without the formula's
fp32 copies."""

import torch

from torchtitan_ext.ep.base import scale_rows, sum_scored_rows
from torchtitan_ext.ep.nccl import NcclExpertParallel


def test_nccl_combine_in_bf16_equals_the_fp32_formula_bitwise(world_of_one):
    generator = torch.Generator().manual_seed(0)
    num_tokens, hidden, experts, top_k = 24, 16, 4, 2
    x = torch.randn(num_tokens, hidden, generator=generator).bfloat16().requires_grad_()
    scores = torch.rand(num_tokens, top_k, generator=generator).requires_grad_()
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    grad = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    style = NcclExpertParallel(pad_multiple=8, score_before_experts=False)
    groups, _ = style.dispatch(x, scores, ids, experts, world_of_one)
    out = style.combine(groups, world_of_one)  # identity experts
    out.backward(grad)

    expected = (x.float().unsqueeze(1) * scores.detach().unsqueeze(-1)).sum(1).bfloat16()
    expected_scores_grad = (grad.float().unsqueeze(1) * x.detach().float().unsqueeze(1)).sum(-1).expand(-1, top_k)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert torch.equal(scores.grad, expected_scores_grad)


def test_scale_rows_in_bf16_and_its_gradients_equal_autograd_through_the_fp32_product_bitwise():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 24, generator=generator).bfloat16().requires_grad_()
    scores = torch.rand(40, generator=generator).requires_grad_()
    grad = torch.randn(40, 24, generator=generator).bfloat16()
    expected = (rows * scores.unsqueeze(-1)).to(torch.bfloat16)
    expected_grads = torch.autograd.grad(expected, (rows, scores), grad)
    scaled = scale_rows(rows, scores)
    grads = torch.autograd.grad(scaled, (rows, scores), grad)
    assert scaled.dtype == torch.bfloat16 and torch.equal(scaled, expected)
    assert all(torch.equal(got, want) for got, want in zip(grads, expected_grads))


def test_sum_scored_rows_in_bf16_and_its_gradients_equal_autograd_through_the_fp32_formula_bitwise():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 24, generator=generator).bfloat16().requires_grad_()
    scores = torch.rand(30, generator=generator).requires_grad_()
    target_of_row = torch.randint(0, 7, (30,), generator=generator)
    grad = torch.randn(7, 24, generator=generator).bfloat16()
    formula = torch.zeros(7, 24).index_add(0, target_of_row, rows * scores.unsqueeze(-1)).bfloat16()
    expected_grads = torch.autograd.grad(formula, (rows, scores), grad)
    summed = sum_scored_rows(rows, target_of_row, scores, 7)
    grads = torch.autograd.grad(summed, (rows, scores), grad)
    assert summed.dtype == torch.bfloat16 and torch.equal(summed, formula)
    assert all(torch.equal(got, want) for got, want in zip(grads, expected_grads))


def test_fp64_rows_are_summed_in_fp64():
    """Sums accumulate in fp32 or in the rows' dtype where it is wider: in fp64, 1 + 2**-40 is kept, where an fp32
    sum rounds it to 1 (the fp64 replication pair, bench ``replication_pair``, depends on it)."""
    rows = torch.tensor([[1.0], [2**-40]], dtype=torch.float64)
    to_one = torch.zeros(2, dtype=torch.int64)
    for scores in (None, torch.ones(2)):
        summed = sum_scored_rows(rows, to_one, scores, 1)
        assert summed.dtype == torch.float64 and summed.item() == 1 + 2**-40, scores
