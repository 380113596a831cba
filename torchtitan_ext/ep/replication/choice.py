"""Which experts get replicas, re-chosen every ``[expert_replication] adapt_every`` steps.

:func:`choose_replicas` fills the replica slots one at a time: the home slot
with the most pairs per copy gets a copy on the least-loaded rank that has a
free slot and no copy of it yet, and its pairs are re-split over its copies
(the per-step rule, :func:`torchtitan_ext.ep.replication.split.water_fill`). It
stops when every slot is used or no expert with pairs can be copied further,
so it always ends (at most EP x S rounds), and since the split may leave a
copy empty, a plan is never worse than no replicas on the counts it was chosen
from.

:class:`ReplicaChooser` runs it for every MoE layer, between steps, from the
global counts of the steps since the last choice (the same on every rank: the
choice needs no communication), which each layer's forward copied to host
memory in the window's last step. Replicas are derived state: nothing of them
is checkpointed, and a resumed job chooses afresh.
"""

import heapq
import time

import torch
from torchtitan.tools.logging import logger

from torchtitan_ext.ep.replication.plan import ReplicaPlan
from torchtitan_ext.ep.replication.split import water_fill


def choose_replicas(counts: list[int], expert_parallel_degree: int, slots: int) -> ReplicaPlan:
    """The replicas for pairs ``counts`` per home slot, ``slots`` per rank."""
    experts = len(counts)
    per_rank = experts // expert_parallel_degree
    copy_ranks = [[home // per_rank] for home in range(experts)]
    shares = [[count] for count in counts]
    loads = _home_loads(counts, expert_parallel_degree)
    held: list[list[int]] = [[] for _ in range(expert_parallel_degree)]
    # most pairs per copy first, ties to the lower slot; a slot that finds no free rank never will again (free
    # ranks only fill, copies only grow), so it leaves the heap for good
    heap = [(-count, home) for home, count in enumerate(counts) if count]
    heapq.heapify(heap)
    while heap:
        _, home = heapq.heappop(heap)
        free = [rank for rank in range(expert_parallel_degree)
                if len(held[rank]) < slots and rank not in copy_ranks[home]]
        if not free:
            continue
        rank = min(free, key=lambda r: (loads[r], r))
        held[rank].append(home)
        copy_ranks[home].append(rank)
        _refill(home, counts, copy_ranks, shares, loads)
        heapq.heappush(heap, (-counts[home] / len(copy_ranks[home]), home))
    replicas = tuple(tuple(homes + [-1] * (slots - len(homes))) for homes in held)
    return ReplicaPlan(experts, expert_parallel_degree, replicas)


def _home_loads(counts: list[int], expert_parallel_degree: int) -> list[int]:
    per_rank = len(counts) // expert_parallel_degree
    loads = [0] * expert_parallel_degree
    for home, count in enumerate(counts):
        loads[home // per_rank] += count
    return loads


def _refill(home: int, counts: list[int], copy_ranks: list[list[int]], shares: list[list[int]], loads: list[int]):
    """Re-split ``home``'s pairs over its copies (water-filling; a new copy holds none yet), updating their ranks'
    loads."""
    held = shares[home] + [0] * (len(copy_ranks[home]) - len(shares[home]))
    others = [loads[r] - share for r, share in zip(copy_ranks[home], held)]
    shares[home] = water_fill(torch.tensor(others), torch.tensor(counts[home])).tolist()
    for r, other, share in zip(copy_ranks[home], others, shares[home]):
        loads[r] = other + share


def _filled_loads(counts: list[int], plan: ReplicaPlan) -> list[int]:
    """Each rank's pairs with ``plan``'s copies filled in the choice's order (most pairs first)."""
    per_rank = plan.experts_per_rank
    copy_ranks = [[home // per_rank] for home in range(plan.num_experts)]
    for rank, homes in enumerate(plan.replicas):
        for home in homes:
            if home >= 0:
                copy_ranks[home].append(rank)
    shares = [[count] for count in counts]
    loads = _home_loads(counts, plan.expert_parallel_degree)
    for home in sorted(range(plan.num_experts), key=lambda home: -counts[home]):
        if len(copy_ranks[home]) > 1:
            _refill(home, counts, copy_ranks, shares, loads)
    return loads


def worth_it(counts: list[int], plan: ReplicaPlan, min_gain: float, current: ReplicaPlan | None = None) -> bool:
    """Whether ``plan`` lowers the busiest rank's pairs on ``counts`` by more than ``min_gain`` of them against
    ``current`` (None: no replicas), as the choice's own fill prices both."""
    before = max(_home_loads(counts, plan.expert_parallel_degree) if current is None else _filled_loads(counts, current))
    return before > 0 and max(_filled_loads(counts, plan)) < before * (1 - min_gain)


def window_start(step: int, adapt_every: int) -> int | None:
    """The first step of the counts that step ``step``'s replicas were chosen from (None: it runs without).

    A window of ``adapt_every`` steps closes with step k x adapt_every (k >= 1), whose forwards copy its counts to
    the host; they are chosen from before step d = k x adapt_every + 1, for steps d .. d + adapt_every - 1."""
    due = (step - 1) // adapt_every * adapt_every + 1
    return due - adapt_every if due > 1 else None


class ReplicaChooser:
    """Chooses every MoE layer's replicas between steps, from counts the device copied to the host itself.

    In the last step of a window (every ``adapt_every``-th), each layer's forward queues a copy of its window's
    counts to pinned host memory and records an event. Before the next step the host waits on those events,
    which the device passed in that forward (the step's non-finite check has read the device after backward
    already, so the wait costs nothing), and chooses; the choice holds for the next ``adapt_every`` steps.
    """

    def __init__(self, section, moe_layers: dict):
        """``section``: the job's ``[expert_replication]``; ``moe_layers``: this rank's MoE modules by layer id."""
        self.slots = section.slots_per_rank
        self.adapt_every = section.adapt_every
        self.min_gain = section.min_gain
        self.stepped_aside: dict[int, bool] = {}
        """Layer -> whether its last choice was set aside (too little gain)."""
        self.plan_changes = 0
        """Plans changed since the start, over every layer: each one a new fetch of weights and new split tables."""
        self.reported_aside = False
        self.choice_s = 0.0
        """Host time the last choice took (every layer's plan and tables), in seconds."""
        self.layers = {layer: moe for layer, moe in moe_layers.items() if moe.replicas is not None}
        self.reported = False
        self._closing = False
        """Whether the step running now ends a window."""

    @property
    def first_replicated_step(self) -> int:
        """The first step that runs with replicas (:func:`window_start`)."""
        return self.adapt_every + 1

    def before_step(self, step: int) -> None:
        """Choose from the window the last step closed, if it did; say whether this step closes the next one."""
        if self._closing:
            started = time.perf_counter()
            self._choose(step)
            self.choice_s = time.perf_counter() - started
        self._closing = step % self.adapt_every == 0
        for moe in self.layers.values():
            moe.replicas.closes_window = self._closing

    def _choose(self, step: int) -> None:
        refreshed = 0
        for layer, moe in self.layers.items():
            copied = moe.replicas.take_copied_window()
            if copied is None:
                continue
            counts, copied_ready = copied
            if copied_ready is not None:
                copied_ready.synchronize()  # passed in the last step's forward
            window = counts.tolist()
            current = moe.replicas.plan
            plan = choose_replicas(window, current.expert_parallel_degree, self.slots)
            if current.replicated() and plan != current and not worth_it(window, plan, self.min_gain, current):
                plan = current  # hysteresis: a new plan must save min_gain over the one in place, not just over none
            aside = not worth_it(window, plan, self.min_gain)
            if aside:
                plan = ReplicaPlan.empty(plan.num_experts, plan.expert_parallel_degree, self.slots)
            if plan != current:
                self.plan_changes += 1
                moe.replicas.set_plan(plan)
                moe.experts.set_plan(plan)
            if aside and not self.reported_aside:
                self.reported_aside = True
                logger.info(
                    f"Expert replicas of MoE layer {layer} set aside before step {step}: on their window they save "
                    f"less than expert_replication.min_gain = {self.min_gain:g} of its busiest rank's rows (no "
                    "weight fetch, no gradient return until a choice saves more)"
                )
            self.stepped_aside[layer] = aside
            rank = torch.distributed.get_rank(moe.replicas.group)
            refreshed += plan.copies_sent(rank) * moe.experts.bytes_per_expert
        if not self.reported and refreshed:
            self.reported = True
            logger.info(
                f"Expert replicas chosen before step {step} (every {self.adapt_every} step(s)): fetching their "
                f"weights sends {refreshed / 2**20:,.2f} MiB per step from this rank, and as much gradient back"
            )

    def metrics(self) -> dict[str, float]:
        """This step's share of the replicated MoE layers running without replicas because their choice was set
        aside, the host time of the last choice, and the layers' plan changes so far; nothing before the first
        choice."""
        if not self.stepped_aside:
            return {}
        return {"ep/replica_layers_set_aside": sum(self.stepped_aside.values()) / len(self.stepped_aside),
                "ep/replica_choice_s": self.choice_s, "ep/replica_plan_changes": self.plan_changes}
