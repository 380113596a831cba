"""Which experts get replicas, re-chosen every ``[expert_replication] adapt_every`` steps.

:func:`choose_replicas` fills the replica slots one at a time: the home slot
with the most pairs per copy gets a copy on the least-loaded rank that has a
free slot and no copy of it yet, and its pairs are re-split over its copies
(the per-step rule, :func:`torchtitan_ext.ep.replication.split.water_fill`). It
stops when every slot is used or no expert with pairs can be copied further,
so it always ends (at most EP x S rounds), and since the split may leave a
copy empty, a plan is never worse than no replicas on the counts it was chosen
from.

:class:`ReplicaChooser` runs it for every MoE layer at once, between steps
(:func:`choose_layers`: the layers take their rounds together), from the
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
    """The replicas of every layer at once, ``counts`` [layers, E] pairs per home slot: each layer's choice is the
    rule above, and the layers take their rounds together (at most EP x S + E rounds of a few array operations over
    all layers, where one layer at a time took a Python loop per copy); a layer whose slots are all used leaves."""
    layers, experts = counts.shape
    ep = expert_parallel_degree
    per_rank = experts // ep
    rows = np.arange(layers)
    flat_counts = counts.reshape(-1)
    home_rank = np.tile(np.arange(experts) // per_rank, layers)
    # per (layer, home slot), copy-major: its copies' ranks (home first; rank ep: a padded copy's sink) and pair
    # shares; a copy column is filled with the sink when some slot first reaches it, not all EP up front
    copies = np.ones(layers * experts, dtype=np.int64)
    copy_rank = np.empty((ep, layers * experts), dtype=np.int64)
    copy_rank[0] = home_rank
    columns = 1
    shares = np.zeros((ep, layers * experts), dtype=np.int64)
    shares[0] = flat_counts
    free_slots = np.full((layers, ep + 1), slots, dtype=np.int64)
    free_slots[:, ep] = 0  # the sink rank: never a copy's
    open_slots = np.full(layers, ep * slots, dtype=np.int64)
    replicas = np.full((layers, ep, slots), -1, dtype=np.int64)
    loads = np.empty((layers, ep + 1), dtype=np.int64)
    loads[:, :ep] = counts.reshape(layers, ep, per_rank).sum(-1)
    loads[:, ep] = _sink_load(counts)  # a padded copy takes no pair, so its sink keeps this load
    # pairs per copy, the heap's key: most first, ties to the lower slot (argmax's first); -inf: out for good
    key = np.where(counts > 0, counts.astype(np.float64), -np.inf)
    unavailable = np.iinfo(np.int64).max
    while True:
        home = key.argmax(1)
        live = key[rows, home] > -np.inf
        if not live.any():
            break
        layer, home = rows[live], home[live]
        index = layer * experts + home
        width = int(copies[index].max())
        # free ranks: a free slot and no copy of this expert yet (the sink column is never free)
        free = free_slots[layer] > 0
        free[np.arange(len(layer))[:, None], copy_rank[:width, index].T] = False
        # a slot that finds no free rank never will again (free ranks only fill, copies only grow)
        stuck = ~free[:, :ep].any(1)
        if stuck.any():
            key[layer[stuck], home[stuck]] = -np.inf
            layer, home, index, free = layer[~stuck], home[~stuck], index[~stuck], free[~stuck]
            if not len(layer):
                continue
        rank = np.where(free, loads[layer], unavailable).argmin(1)  # least loaded, ties the lower
        free_slots[layer, rank] -= 1
        replicas[layer, rank, slots - 1 - free_slots[layer, rank]] = home
        held = copies[index]
        width = int(held.max()) + 1
        if width > columns:
            copy_rank[columns:width] = ep
            columns = width
        copy_rank[held, index] = rank
        copies[index] = held + 1
        ranks = copy_rank[:width, index].T
        others = loads[layer[:, None], ranks] - shares[:width, index].T
        quotas = water_fill_host(others, flat_counts[index])
        shares[:width, index] = quotas.T
        loads[layer[:, None], ranks] = others + quotas
        key[layer, home] = flat_counts[index] / (held + 1)
        open_slots[layer] -= 1
        key[layer[open_slots[layer] == 0]] = -np.inf
    return [ReplicaPlan(experts, ep, tuple(map(tuple, held.tolist()))) for held in replicas]


def _sink_load(counts: np.ndarray) -> int:
    """The load of a padded copy's sink rank: above any layer's pairs, so water-filling never gives it one."""
    return int(counts.sum(1).max()) + 1


def water_fill_host(loads: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """:func:`~torchtitan_ext.ep.replication.split.water_fill` on host arrays (the choice's, between steps; the
    split's runs on the device): integer quotas summing to ``amount`` [rows] over ``loads`` [rows, C], minimising
    max(loads + quotas), ties to the earlier copy."""
    rows = np.arange(len(loads))
    order = np.argsort(loads, axis=-1, kind="stable")
    ordered = loads[rows[:, None], order]
    prefix = ordered.cumsum(-1)
    participants = np.arange(1, loads.shape[-1] + 1)
    levels = (amount[:, None] + prefix) // participants
    filled = np.maximum((levels >= ordered).sum(-1), 1) - 1
    level = levels[rows, filled]
    remainder = amount + prefix[rows, filled] - level * (filled + 1)
    quotas = np.empty_like(ordered)
    quotas[rows[:, None], order] = np.maximum(level[:, None] - ordered, 0) + (participants <= remainder[:, None])
    return quotas


def filled_loads(counts: np.ndarray, plans: list[ReplicaPlan]) -> np.ndarray:
    """[layers, EP] each rank's pairs of ``counts`` [layers, E] with each layer's plan's copies filled in the choice's
    order (most pairs first, ties the lower slot; an expert's copies home first, then rank by rank), all layers at
    once."""
    layers, experts = counts.shape
    ep = plans[0].expert_parallel_degree
    per_rank = experts // ep
    loads = np.empty((layers, ep + 1), dtype=np.int64)
    loads[:, :ep] = counts.reshape(layers, ep, per_rank).sum(-1)
    loads[:, ep] = _sink_load(counts)  # a padded copy's sink, as in the choice
    replicas = np.array([plan.replicas for plan in plans], dtype=np.int64).reshape(layers, -1)  # [L, EP x S]
    slot_rank = np.broadcast_to(np.repeat(np.arange(ep), plans[0].slots), replicas.shape)
    used = replicas >= 0
    if not used.any():
        return loads[:, :ep]
    # each copy's place among its expert's copies: after the home, in rank order
    layer, home, rank = np.nonzero(used)[0], replicas[used], slot_rank[used]
    key = layer * experts + home
    order = np.argsort(key, kind="stable")
    key, rank = key[order], rank[order]
    first = np.searchsorted(key, key)
    width = int((np.arange(len(key)) - first).max()) + 2
    copy_rank = np.full((layers * experts, width), ep, dtype=np.int64)
    copy_rank[:, 0] = np.tile(np.arange(experts) // per_rank, layers)
    copy_rank[key, np.arange(len(key)) - first + 1] = rank
    # the replicated experts of each layer, most pairs first (ties the lower slot); padded with layer-free fills
    replicated = np.zeros((layers, experts), dtype=bool)
    replicated.reshape(-1)[key] = True
    ranked = np.argsort(np.where(replicated, -counts, 1), axis=1, kind="stable")
    rounds = int(replicated.sum(1).max())
    rows = np.arange(layers)
    for turn in range(rounds):
        home = ranked[:, turn]
        active = replicated[rows, home]
        layer, home = rows[active], home[active]
        index = layer * experts + home
        ranks = copy_rank[index]
        shares = np.zeros_like(ranks)
        shares[:, 0] = counts[layer, home]
        others = loads[layer[:, None], ranks] - shares
        loads[layer[:, None], ranks] = others + water_fill_host(others, counts[layer, home])
    return loads[:, :ep]


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
