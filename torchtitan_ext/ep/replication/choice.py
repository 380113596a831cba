"""Which experts get replicas, re-chosen every ``[expert_replication] adapt_every`` steps.

:func:`choose_replicas` fills the replica slots one at a time: the home slot
with the most pairs per copy gets a copy on the least-loaded rank that has a
free slot and no copy of it yet, and its pairs are re-split over its copies
(the per-step rule, :func:`torchtitan_ext.ep.replication.split.water_fill`). It
stops when every slot is used or no expert with pairs can be copied further,
so it always ends (at most EP x S rounds), and since the split may leave a
copy empty, a plan is never worse than no replicas on the counts it was chosen
from.

:class:`ReplicaChooser` runs it for every MoE layer between steps
(:func:`choose_layers`, a loop compiled for the host: :mod:`.choice_loops`), from the
global counts of the steps since the last choice (the same on every rank: the
choice needs no communication), which each layer's forward copied to host
memory in the window's last step. Replicas are derived state: nothing of them
is checkpointed, and a resumed job chooses afresh.
"""

import time

import numpy as np
import torch
from torchtitan.tools.logging import logger

from torchtitan_ext.ep.replication.plan import ReplicaPlan


def choose_replicas(counts: list[int], expert_parallel_degree: int, slots: int) -> ReplicaPlan:
    """The replicas for pairs ``counts`` per home slot, ``slots`` per rank (:func:`choose_layers` of one layer)."""
    return choose_layers(np.asarray([counts], dtype=np.int64), expert_parallel_degree, slots)[0]


def choose_layers(counts: np.ndarray, expert_parallel_degree: int, slots: int) -> list[ReplicaPlan]:
    """The replicas of every layer, ``counts`` [layers, E] pairs per home slot, by the rule above
    (:func:`~torchtitan_ext.ep.replication.choice_loops.choose`)."""
    replicas = _loops().choose(np.ascontiguousarray(counts, dtype=np.int64), expert_parallel_degree, slots)
    return [ReplicaPlan(counts.shape[1], expert_parallel_degree, tuple(map(tuple, held))) for held in replicas.tolist()]


def filled_loads(counts: np.ndarray, plans: list[ReplicaPlan]) -> np.ndarray:
    """[layers, EP] each rank's pairs of ``counts`` [layers, E] with each layer's plan's copies filled in the choice's
    order (most pairs first, ties the lower slot; an expert's copies home first, then rank by rank)
    (:func:`~torchtitan_ext.ep.replication.choice_loops.fill`)."""
    replicas = np.array([plan.replicas for plan in plans], dtype=np.int64)
    return _loops().fill(np.ascontiguousarray(counts, dtype=np.int64), replicas)


def _loops():
    """The compiled loops, imported at the first choice: importing numba takes half a second, which a job without
    replicas need not pay."""
    from torchtitan_ext.ep.replication import choice_loops

    return choice_loops


def saves_enough(before: np.ndarray, after: np.ndarray, min_gain: float) -> np.ndarray:
    """[layers] whether the busiest rank's pairs go from ``before`` to ``after`` (each [layers, EP]) down by more than
    ``min_gain`` of them."""
    busiest = before.max(1)
    return (busiest > 0) & (after.max(1) < busiest * (1 - min_gain))


def home_loads(counts: np.ndarray, expert_parallel_degree: int) -> np.ndarray:
    """[layers, EP] each rank's pairs of ``counts`` [layers, E] without replicas."""
    return counts.reshape(len(counts), expert_parallel_degree, -1).sum(-1)


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
        if self.layers:
            _loops().warm()  # loaded (or compiled) now, not in the first choice's step
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
        chosen = {}
        for layer, moe in self.layers.items():
            copied = moe.replicas.take_copied_window()
            if copied is not None:
                counts, copied_ready = copied
                if copied_ready is not None:
                    copied_ready.synchronize()  # passed in the last step's forward
                chosen[layer] = counts
        if not chosen:
            return
        moes = [self.layers[layer] for layer in chosen]
        counts = torch.stack(list(chosen.values())).numpy().astype(np.int64)
        current = [moe.replicas.plan for moe in moes]
        ep = current[0].expert_parallel_degree
        plans = choose_layers(counts, ep, self.slots)
        fill = filled_loads(counts, plans)
        # hysteresis: a new plan must save min_gain over the one in place, not just over none
        without = home_loads(counts, ep)
        changing = np.flatnonzero([plan != now and now.replicated() > 0 for plan, now in zip(plans, current)])
        if len(changing):
            in_place = filled_loads(counts[changing], [current[i] for i in changing])
            # the plan in place stays where it still pays and the new one saves too little over it
            kept = changing[saves_enough(without[changing], in_place, self.min_gain)
                            & ~saves_enough(in_place, fill[changing], self.min_gain)]
            for i in kept:
                plans[i] = current[i]
            fill[kept] = in_place[np.isin(changing, kept)]
        aside = ~saves_enough(without, fill, self.min_gain)
        refreshed = 0
        for layer, moe, plan, now, set_aside in zip(chosen, moes, plans, current, aside.tolist()):
            if set_aside:
                plan = ReplicaPlan.empty(plan.num_experts, ep, self.slots)
            if plan != now:
                self.plan_changes += 1
                moe.replicas.set_plan(plan)
                moe.experts.set_plan(plan)
            if set_aside and not self.reported_aside:
                self.reported_aside = True
                logger.info(
                    f"Expert replicas of MoE layer {layer} set aside before step {step}: on their window they save "
                    f"less than expert_replication.min_gain = {self.min_gain:g} of its busiest rank's rows (no "
                    "weight fetch, no gradient return until a choice saves more)"
                )
            self.stepped_aside[layer] = set_aside
            if not self.reported:  # the bytes are logged once: counted until then only
                refreshed += plan.copies_sent(torch.distributed.get_rank(moe.replicas.group)) * moe.experts.bytes_per_expert
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
