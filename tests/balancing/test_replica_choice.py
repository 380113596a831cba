"""The choice of replicas: always ends, never worse than no replicas on the counts it was made from."""

import random

import pytest
import torch

from torchtitan_ext.balancing.replica_choice import choose_replicas
from torchtitan_ext.ep.replica_split import split_quotas, SplitTables


def _busiest(counts: list[int], plan) -> int:
    tables = SplitTables(plan, torch.device("cpu"))
    quotas = split_quotas(torch.tensor(counts), tables)
    loads = [0] * plan.expert_parallel_degree
    for home, ranks in enumerate(tables.copy_ranks):
        for copy, rank in enumerate(ranks):
            loads[rank] += int(quotas[home, copy])
    return max(loads)


def test_one_dominant_expert_ends():
    """Seed 002's Algorithm 1 loops forever on loads [100, 1, 1, 1] with 4 slots, once the expert clamped to
    one replica has the largest difference. Here every slot is filled or no expert can be copied further."""
    plan = choose_replicas([100, 1, 1, 1], expert_parallel_degree=4, slots=1)
    assert plan.replicas[1:] == ((0,), (0,), (0,)), plan
    assert _busiest([100, 1, 1, 1], plan) == 26


def test_empty_counts_choose_nothing():
    plan = choose_replicas([0] * 8, expert_parallel_degree=2, slots=2)
    assert plan.replicated() == 0


@pytest.mark.parametrize("seed", range(30))
def test_never_worse_than_no_replicas_on_its_own_counts(seed):
    generator = random.Random(seed)
    ranks = generator.choice([2, 4])
    per_rank = generator.choice([1, 2, 4])
    slots = generator.randint(1, per_rank * (ranks - 1))
    counts = [int(generator.paretovariate(1.2) * 10) for _ in range(ranks * per_rank)]
    plan = choose_replicas(counts, ranks, slots)
    home_only = max(sum(counts[rank * per_rank:(rank + 1) * per_rank]) for rank in range(ranks))
    assert _busiest(counts, plan) <= home_only


def test_two_slots_split_a_collapsed_layer_evenly():
    """The debug job's routing near collapse: 3 of 8 experts take almost all pairs (EP = 2)."""
    counts = [2045, 3, 2045, 2, 2045, 1, 1, 2]
    plan = choose_replicas(counts, expert_parallel_degree=2, slots=2)
    total = sum(counts)
    assert _busiest(counts, plan) <= -(-total // 2) + 1
