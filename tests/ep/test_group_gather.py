"""Rows gathered into padded expert-major groups (DeepEP's dispatch): the output and the rows' gradient are autograd's
through ``index_select`` and an in-place zero fill of the pad rows, bit for bit, and the backward reads the groups'
gradient once, where autograd's fill first copies all of it."""

import torch

from torchtitan_ext.ep.base import gather_into_groups
from torchtitan_ext.planning.local_traffic import LocalTrafficCounter


def test_the_group_gather_is_autograds_bitwise_without_its_copy_of_the_gradient():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(10, 256, generator=generator).bfloat16().requires_grad_()
    # rows 3 and 7 each feed two groups; group rows 4, 5 and 11 are padding (their source: any row, here 0)
    group_sources = torch.tensor([3, 1, 7, 3, 0, 0, 9, 7, 2, 5, 8, 0])
    pad_rows = torch.tensor([4, 5, 11])
    grad = torch.randn(12, 256, generator=generator).bfloat16()

    expected = rows.index_select(0, group_sources).index_fill_(0, pad_rows, 0)
    with LocalTrafficCounter() as autograds:
        (expected_grad,) = torch.autograd.grad(expected, rows, grad)
    groups = gather_into_groups(rows, group_sources, pad_rows)
    with LocalTrafficCounter() as ours:
        (rows_grad,) = torch.autograd.grad(groups, rows, grad)

    assert torch.equal(groups, expected) and groups[pad_rows].eq(0).all()
    assert torch.equal(rows_grad, expected_grad)
    # autograd's fill copies the whole gradient (a read and a write) before the gather's index_add reads it; ours
    # pays an index copy and one extra row instead
    assert autograds.bytes - ours.bytes >= grad.nbytes, (autograds.bytes, ours.bytes)
