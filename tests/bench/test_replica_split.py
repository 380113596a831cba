"""bench replica_split counts the tensor operators a call dispatches (on a GPU, at least one kernel launch each)."""

import torch

from torchtitan_ext.bench.replica_split import OperatorCount


def test_the_operator_count_is_one_per_dispatched_operator():
    x = torch.ones(4)
    with OperatorCount() as operators:
        (x + 1).mul_(2).sum()
    assert operators.count == 3
