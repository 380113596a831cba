"""The choice of replicas: always ends, never worse than no replicas on the counts it was made from, and made
without the host waiting for the device."""

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from torchtitan_ext.ep.replication.choice import choose_replicas, filled_loads, ReplicaChooser
from torchtitan_ext.ep.replication.plan import most_experts_sent, ReplicaPlan
from torchtitan_ext.ep.replication.split import ReplicaRouter, split_quotas, SplitTables, water_fill
from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter


def busiest_rows(counts: list[int], plan) -> int:
    """The busiest rank's pairs under training's per-step split."""
    tables = SplitTables(plan, torch.device("cpu"))
    quotas = split_quotas(torch.tensor(counts), tables)
    loads = [0] * plan.expert_parallel_degree
    for home, ranks in enumerate(tables.copy_ranks):
        for copy, rank in enumerate(ranks):
            loads[rank] += int(quotas[home, copy])
    return max(loads)


def _fill_literally(counts: list[int], plan) -> list[int]:
    """The fill that prices a plan, read literally, one expert at a time: each replicated expert, most pairs first
    (ties: the lower slot), re-splits its pairs over its copies (home first, then rank by rank) by water-filling."""
    per_rank = plan.experts_per_rank
    copy_ranks = [[home // per_rank] for home in range(plan.num_experts)]
    for rank, homes in enumerate(plan.replicas):
        for home in homes:
            if home >= 0:
                copy_ranks[home].append(rank)
    loads = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(plan.expert_parallel_degree)]
    for home in sorted(range(plan.num_experts), key=lambda h: -counts[h]):
        ranks = copy_ranks[home]
        if len(ranks) > 1:
            others = [loads[r] - (counts[home] if copy == 0 else 0) for copy, r in enumerate(ranks)]
            for r, other, share in zip(ranks, others, water_fill(torch.tensor(others), torch.tensor(counts[home])).tolist()):
                loads[r] = other + share
    return loads


def worth_it(counts: list[int], plan, min_gain: float) -> bool:
    """Whether ``plan`` saves more than ``min_gain`` of the busiest rank's pairs on ``counts``, priced literally."""
    before = max(_fill_literally(counts, ReplicaPlan.empty(plan.num_experts, plan.expert_parallel_degree, plan.slots)))
    return before > 0 and max(_fill_literally(counts, plan)) < before * (1 - min_gain)


@pytest.mark.parametrize("seed", range(20))
def test_the_fill_that_prices_plans_is_the_rule_read_literally(seed):
    """Every layer's plan (chosen from one window) priced on the next window's counts, all layers at once."""
    import numpy as np

    generator = np.random.default_rng(seed)
    ranks, per_rank, slots = [(2, 4, 2), (4, 2, 1), (8, 4, 3), (4, 4, 2)][seed % 4]
    chosen_from, priced_on = ((generator.pareto(1.2, size=(5, ranks * per_rank)) * 10).astype(np.int64) for _ in range(2))
    plans = [choose_replicas(layer.tolist(), ranks, slots) for layer in chosen_from]
    assert filled_loads(priced_on, plans).tolist() == [_fill_literally(layer.tolist(), plan)
                                                        for layer, plan in zip(priced_on, plans)]


def test_one_dominant_expert_ends():
    """Seed 002's Algorithm 1 loops forever on loads [100, 1, 1, 1] with 4 slots, once the expert clamped to
    one replica has the largest difference. Here every slot is filled or no expert can be copied further."""
    plan = choose_replicas([100, 1, 1, 1], expert_parallel_degree=4, slots=1)
    assert plan.replicas[1:] == ((0,), (0,), (0,)), plan
    assert busiest_rows([100, 1, 1, 1], plan) == 26


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
    assert busiest_rows(counts, plan) <= home_only


def test_two_slots_split_a_collapsed_layer_evenly():
    """The debug job's routing near collapse: 3 of 8 experts take almost all pairs (EP = 2)."""
    counts = [2045, 3, 2045, 2, 2045, 1, 1, 2]
    plan = choose_replicas(counts, expert_parallel_degree=2, slots=2)
    total = sum(counts)
    assert busiest_rows(counts, plan) <= -(-total // 2) + 1


def _scan_every_round(counts: list[int], expert_parallel_degree: int, slots: int) -> tuple:
    """The choice's rule read literally, each round scanning every expert: the expert of most pairs per copy
    (ties: the lower) that has a free rank without a copy gets one on the least-loaded such rank (ties: the
    lower), and its pairs are re-split."""
    per_rank = len(counts) // expert_parallel_degree
    copies = [[home // per_rank] for home in range(len(counts))]
    shares = [[count] for count in counts]
    loads = [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(expert_parallel_degree)]
    held = [[] for _ in range(expert_parallel_degree)]

    def free(home):
        return [r for r in range(expert_parallel_degree) if len(held[r]) < slots and r not in copies[home]]

    while True:
        candidates = [home for home in range(len(counts)) if counts[home] and free(home)]
        if not candidates:
            break
        home = max(candidates, key=lambda h: (counts[h] / len(copies[h]), -h))
        rank = min(free(home), key=lambda r: (loads[r], r))
        held[rank].append(home)
        copies[home].append(rank)
        others = [loads[r] - share for r, share in zip(copies[home], shares[home] + [0])]
        shares[home] = water_fill(torch.tensor(others), torch.tensor(counts[home])).tolist()
        for r, other, share in zip(copies[home], others, shares[home]):
            loads[r] = other + share
    return tuple(tuple(sorted(homes) + [-1] * (slots - len(homes))) for homes in held)  # a plan's order


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_equals_the_rule_read_literally(seed):
    generator = random.Random(seed)
    ranks = generator.choice([2, 4, 8])
    per_rank = generator.choice([1, 2, 4])
    slots = generator.randint(1, min(4, per_rank * (ranks - 1)))
    counts = [int(generator.paretovariate(1.2) * 10) * generator.choice([0, 1, 1]) for _ in range(ranks * per_rank)]
    assert choose_replicas(counts, ranks, slots).replicas == _scan_every_round(counts, ranks, slots)


@pytest.mark.parametrize("ranks, per_rank, slots", [(4, 4, 2), (4, 2, 3), (8, 1, 2)])
def test_the_most_experts_a_rank_sends_is_what_the_choice_sends_from_a_rank_of_hot_experts(ranks, per_rank, slots):
    """The planner's bound (:func:`most_experts_sent`) is reached where rank 0's experts take nearly every pair, and
    no choice from random counts goes over it."""
    hot = [1_000_000] * per_rank + [1] * (ranks - 1) * per_rank
    assert choose_replicas(hot, ranks, slots).copies_sent(0) == most_experts_sent(ranks, per_rank, slots)
    generator = random.Random(0)
    for _ in range(20):
        plan = choose_replicas([int(generator.paretovariate(1.2) * 10) for _ in range(ranks * per_rank)], ranks, slots)
        assert max(map(plan.copies_sent, range(ranks))) <= most_experts_sent(ranks, per_rank, slots)


class _Experts:
    bytes_per_expert = 0

    def __init__(self):
        self.plans = []

    def set_plan(self, plan):
        self.plans.append(plan)


def _section(min_gain: float):
    return SimpleNamespace(slots_per_rank=1, adapt_every=1, min_gain=min_gain)


def _one_layer(world_of_one) -> torch.nn.Module:
    """The MoE module of one layer: 4 experts over EP = 2 with one slot each."""
    moe = torch.nn.Module()
    moe.replicas, moe.experts = ReplicaRouter(ReplicaPlan.empty(4, 2, 1), world_of_one), _Experts()
    return moe


def _home_slots(counts: list[int]) -> torch.Tensor:
    """One pair per token, ``counts[e]`` of them for home slot e."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).view(-1, 1)


def test_each_choice_reads_the_counts_the_last_step_copied_to_the_host(world_of_one):
    """Every step closes a window (adapt_every = 1): its forward copies the counts to the host, and the replicas
    of the next step are chosen from them. Step 1 is hot on expert 2 (homed on rank 1): step 2 gives it rank 0's
    slot, and expert 0 (the only other with pairs) rank 1's; step 2 is hot on expert 1: step 3 copies it to rank
    1. No host read of a device value, in the forwards or between the steps."""
    moe = _one_layer(world_of_one)
    chooser = ReplicaChooser(_section(min_gain=0.0), {1: moe})
    counts = {1: [1, 0, 9, 0], 2: [0, 9, 0, 1], 3: [5, 5, 5, 5]}
    plans = {}
    with DeviceCostCounter() as counter:
        for step in (1, 2, 3):
            chooser.before_step(step)
            plans[step] = moe.replicas.plan.replicas
            moe.replicas.assign(_home_slots(counts[step]), counting=True)
    assert [sum(costs.host_syncs.values()) for costs in counter.costs.values()] == [0]
    assert plans == {1: ((-1,), (-1,)), 2: ((2,), (0,)), 3: ((3,), (1,))}
    assert [plan.replicas for plan in moe.experts.plans] == [((2,), (0,)), ((3,), (1,))]


def test_replicas_that_save_too_little_are_set_aside(world_of_one, caplog):
    """Ranks 0 and 1 hold experts 0-1 and 2-3. Counts [10, 10, 10, 10] are balanced: the chosen replicas save
    nothing, and the layer runs without them until a choice saves more than min_gain of the busiest rank's rows
    ([30, 10, 10, 10]: 40 -> 30 pairs with expert 0 split); said once."""
    assert not worth_it([10, 10, 10, 10], choose_replicas([10, 10, 10, 10], 2, 1), 0.05)
    skewed = choose_replicas([30, 10, 10, 10], 2, 1)
    assert busiest_rows([30, 10, 10, 10], skewed) == 30 and worth_it([30, 10, 10, 10], skewed, 0.05)
    assert not worth_it([30, 10, 10, 10], skewed, 0.25)  # 25% saved exactly is not more than 25%
    caplog.set_level(logging.INFO)
    moe = _one_layer(world_of_one)
    chooser = ReplicaChooser(_section(min_gain=0.05), {1: moe})
    plans, set_aside = {}, {}
    for step, counts in enumerate(([10, 10, 10, 10], [10, 10, 10, 10], [30, 10, 10, 10], [5, 5, 5, 5]), start=1):
        chooser.before_step(step)
        plans[step] = (moe.replicas.plan.replicated(), chooser.stepped_aside.get(1))
        set_aside[step] = chooser.metrics().get("ep/replica_layers_set_aside")
        moe.replicas.assign(_home_slots(counts), counting=True)
    assert plans == {1: (0, None), 2: (0, True), 3: (0, True), 4: (2, False)}
    assert set_aside == {1: None, 2: 1.0, 3: 1.0, 4: 0.0}  # the metric the training log writes each step
    assert sum("set aside" in record.getMessage() for record in caplog.records) == 1


def test_a_plan_in_place_stays_until_a_new_one_saves_min_gain_over_it(world_of_one):
    """Ranks 0 and 1 hold experts 0-1 and 2-3, one slot each, min_gain 0.05. From [30, 10, 10, 10] the choice copies
    expert 0 to rank 1 and expert 2 to rank 0 (busiest 40 -> 30). On [30, 10, 9, 11] a fresh choice would copy
    expert 3 instead: 30 either way, so the plan stays; on [10, 30, 10, 10] the plan in place already gives 30 and
    30 (expert 0's pairs go to rank 1's copy). On [10, 10, 10, 40] it leaves rank 1 at 40, and copying expert 3 to
    rank 0 gives 35 and 35 (12.5% saved): the plan changes. Each change is counted once."""
    moe = _one_layer(world_of_one)
    chooser = ReplicaChooser(_section(min_gain=0.05), {1: moe})
    plans, changes = {}, {}
    for step, counts in enumerate(([30, 10, 10, 10], [30, 10, 9, 11], [10, 30, 10, 10], [10, 10, 10, 40], [1, 1, 1, 1]),
                                  start=1):
        chooser.before_step(step)
        plans[step], changes[step] = moe.replicas.plan.replicas, chooser.metrics().get("ep/replica_plan_changes")
        moe.replicas.assign(_home_slots(counts), counting=True)
    assert plans == {1: ((-1,), (-1,)), 2: ((2,), (0,)), 3: ((2,), (0,)), 4: ((2,), (0,)), 5: ((3,), (0,))}
    assert changes == {1: None, 2: 1, 3: 1, 4: 1, 5: 2}
    assert [plan.replicas for plan in moe.experts.plans] == [((2,), (0,)), ((3,), (0,))]


def test_layers_chosen_together_are_each_chosen_alone():
    """Each layer gets the plan, and the fill, it gets alone; the host's compiled water-fill is the device's."""
    import numpy as np

    from torchtitan_ext.ep.replication.choice import choose_layers, filled_loads
    from torchtitan_ext.ep.replication.choice_loops import water_fill as water_fill_host

    generator = np.random.default_rng(0)
    for ranks, per_rank, slots in ((2, 4, 2), (4, 2, 1), (8, 4, 3)):
        counts = (generator.pareto(1.2, size=(6, ranks * per_rank)) * 10).astype(np.int64)
        counts[1] = 0  # a layer with no pairs
        counts[2, 0] *= 100  # one expert hot enough to run out of free ranks
        plans = choose_layers(counts, ranks, slots)
        assert plans == [choose_replicas(layer.tolist(), ranks, slots) for layer in counts]
        together = filled_loads(counts, plans)
        assert all((together[i] == filled_loads(counts[i:i + 1], [plan])[0]).all() for i, plan in enumerate(plans))
    loads, amounts = generator.integers(0, 50, size=(40, 5)), generator.integers(0, 100, size=40)
    on_host = np.empty_like(loads)
    for row, amount, quotas in zip(loads, amounts, on_host):
        water_fill_host(row, amount, quotas)
    assert (on_host == water_fill(torch.from_numpy(loads), torch.from_numpy(amounts)).numpy()).all()


def test_a_plan_in_place_that_no_longer_pays_gives_way_to_a_new_one_that_does(world_of_one):
    """Chosen from [28, 19, 15, 18]: expert 3 copied to rank 0 and expert 0 to rank 1. On [17, 8, 28, 1] (29 pairs
    on rank 1 without replicas) that plan leaves 28 (3.4% saved, too little to keep replicas at all) and a fresh
    choice, expert 2 copied to rank 0, leaves 27 and 27 (6.9% saved; 3.6% over the plan in place): the fresh plan
    is taken in one change, not the layer set aside in between."""
    moe = _one_layer(world_of_one)
    chooser = ReplicaChooser(_section(min_gain=0.05), {1: moe})
    plans = {}
    for step, counts in enumerate(([28, 19, 15, 18], [17, 8, 28, 1], [1, 1, 1, 1]), start=1):
        chooser.before_step(step)
        plans[step] = (moe.replicas.plan.replicas, chooser.stepped_aside.get(1))
        moe.replicas.assign(_home_slots(counts), counting=True)
    assert plans == {1: (((-1,), (-1,)), None), 2: (((3,), (0,)), False), 3: (((2,), (0,)), False)}
    assert chooser.metrics()["ep/replica_plan_changes"] == 2
