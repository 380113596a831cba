"""Expert replication: extra expert slots on every EP rank that hold copies of hot experts.

Under ``[expert_replication] slots_per_rank = S`` each EP rank r holds its L
home experts (slots r*L .. r*L+L-1 of the placement, :mod:`torchtitan_ext.balancing.placement`)
and S replica slots. A :class:`ReplicaPlan` says which home slot each replica
slot copies; it changes every ``adapt_every`` steps
(:mod:`.choice`). The backends dispatch over
``EP x (L + S)`` slots (:func:`dispatched_shape`): rank r's dispatched slots
are ``r*(L+S) + j``, its home experts first (j < L), then its replicas.

Every step, each MoE layer divides the (token, expert) pairs of a replicated
expert among its copies from that step's global counts
(:mod:`.split`), and the experts compute with their replicas' weights
fetched from home (:mod:`.experts`): only home weights are
parameters, so gradients of replicas return home and are summed there, the
optimizer and checkpoints see logical experts only, and replicas equal their
home weights bit for bit at every step.
"""

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np

from torchtitan_ext.config import ConfigError, MoEShape, overlaps_expert_parallel, Range, ValidationContext
from torchtitan_ext.ep.budget import Budget, DeviceBudget


@dataclass
class ExpertReplication:
    slots_per_rank: int = 0
    """
    Extra expert slots per EP rank, each holding a copy of another rank's
    expert (weights fetched from home every step; no optimizer state). 0: off.
    Range 0 .. experts - experts per rank (a rank can copy only the others'
    experts); needs expert_parallel_degree > 1. Memory per slot and rank: one
    routed expert's weights and gradients per MoE layer.
    """
    adapt_every: int = 1
    """
    Steps between choices of which experts get replicas, made between steps
    from the global token counts of the adapt_every steps before, which the
    last of them copied to host memory in its forward (the device keeps that
    step's backward queued while the host reads them): steps 1 ..
    adapt_every run without replicas. How a replicated expert's tokens are
    divided among its copies is decided every step from that step's counts.
    Range >= 1. 1 re-chooses every step from the previous step's counts, at
    no extra communication (replica weights are fetched every step anyway).
    """
    min_gain: float = 0.05
    """
    The least share of a layer's busiest-rank rows that its chosen replicas
    must save, on the window they were chosen from, for the layer to use
    them; below it the layer steps aside until the next choice: no weight
    fetch, no gradient return (where routing is already balanced, replicas
    only cost their traffic). The same share guards a change of plan: a new
    choice replaces the plan in place only where it saves this much more on
    the window than that plan does (each change refetches the weights and
    rebuilds the split's tables). Decided between steps from the counts the
    choice reads, the same on every rank. Range 0 .. 1; 0: never steps
    aside. 0.05: just below the lowest break-even measured on a CPU
    (replication's own time over the slowest rank's MoE layers, 0.054 at EP=2
    and 0.078 at EP=4 on debugmodel_wide_experts; docs/balancing.md,
    "`min_gain` from these measurements"); a
    GPU's is not measured.
    """


REPLICATION_RANGES = {
    "expert_replication.slots_per_rank": Range(minimum=0, meaning="replica slots per EP rank"),
    "expert_replication.adapt_every": Range(minimum=1, meaning="steps between replica choices"),
    "expert_replication.min_gain": Range(0, 1, meaning="a share of the busiest rank's rows"),
}


def replication_budget(job_config) -> DeviceBudget:
    """What replication adds to one MoE layer's budget per step (its split gives the backend every rank's counts,
    which :meth:`DeviceBudget.given_counts` takes off the backend's)."""
    return DeviceBudget(
        forward=Budget(collectives=2), backward=Budget(collectives=1),
        why="replication: the pair counts' all-gather (which also gives the backend every rank's counts) and the "
            "replicas' weights (all-to-all) forward, their gradients home backward; a new plan's index tables are "
            "copied between steps, none within a layer",
    )


def fetches_ahead(job_config) -> bool:
    """Whether each MoE layer fetches the next one's replicas while it computes (double buffering,
    :mod:`torchtitan_ext.ep.replication.experts`): not under per-op selective activation checkpointing, which replays
    each op in the region that issued it."""
    checkpointing = job_config.activation_checkpoint
    return not (checkpointing.mode == "selective" and checkpointing.selective_ac_option == "op")


def dispatched_shape(job_config, shape: MoEShape) -> MoEShape:
    """The shape the backend dispatches over: ``shape`` with EP x (L + S) experts under replication."""
    slots = job_config.expert_replication.slots_per_rank
    if not slots:
        return shape
    ep = job_config.parallelism.expert_parallel_degree
    return replace(shape, num_experts=shape.num_experts + ep * slots)


def check_replication(job_config, context: ValidationContext) -> None:
    """ConfigError, naming the field and the fix, for a replication the job cannot run."""
    slots = job_config.expert_replication.slots_per_rank
    if not slots:
        return
    where = f"expert_replication.slots_per_rank = {slots}"
    if context.moe_shape is None:
        raise ConfigError(f"{where}, but the model has no MoE layers: set it to 0")
    parallelism = job_config.parallelism
    ep = parallelism.expert_parallel_degree
    if ep == 1:
        raise ConfigError(f"{where} needs expert parallelism: set parallelism.expert_parallel_degree > 1, or slots to 0")
    experts = context.moe_shape.num_experts
    if slots > experts - experts // ep:
        raise ConfigError(
            f"{where}: a rank can hold copies of the other ranks' {experts - experts // ep} experts only: "
            f"set it to at most {experts - experts // ep}"
        )
    if parallelism.expert_tensor_parallel_degree > 1:
        raise ConfigError(
            f"{where} is not supported with parallelism.expert_tensor_parallel_degree = "
            f"{parallelism.expert_tensor_parallel_degree} (replica weights are fetched whole): set one of them to 1"
        )
    if overlaps_expert_parallel(parallelism):
        raise ConfigError(
            f"{where} is not supported with DualPipeV's overlapped expert parallelism: set "
            "parallelism.pipeline_parallel_expert_parallel_overlap = false, or slots to 0"
        )


def most_experts_sent(expert_parallel_degree: int, experts_per_rank: int, slots: int) -> int:
    """The most whole experts one rank sends in a fetch, and receives gradients of backward: every other rank's
    slots holding its experts, each at most once (a rank sends S on average)."""
    return (expert_parallel_degree - 1) * min(slots, experts_per_rank)


@dataclass(frozen=True)
class ReplicaPlan:
    """Which home slot each replica slot copies, for one MoE layer.

    ``replicas[r][j]``: the home slot (0 .. E-1, the placement's physical
    numbering) that replica slot j of EP rank r copies, or -1 when unused. A
    rank never copies its own experts, nor one expert twice. Each rank's
    copies come first, in ascending home slot, then its unused slots: the
    order in which the fetch's all-to-all receives them (by source rank, each
    source's experts ascending), so that it receives straight into the slots.
    """

    num_experts: int
    expert_parallel_degree: int
    replicas: tuple[tuple[int, ...], ...]

    @classmethod
    def empty(cls, num_experts: int, expert_parallel_degree: int, slots: int) -> "ReplicaPlan":
        return cls(num_experts, expert_parallel_degree, ((-1,) * slots,) * expert_parallel_degree)

    def __post_init__(self):
        if len(self.replicas) != self.expert_parallel_degree or len(set(map(len, self.replicas))) > 1:
            raise ValueError(f"replicas {self.replicas}: one tuple of the same slots for each of the "
                             f"{self.expert_parallel_degree} ranks")
        ranks, slots = len(self.replicas), len(self.replicas[0])
        held = np.fromiter(chain.from_iterable(self.replicas), np.int64, ranks * slots).reshape(ranks, slots)
        ordered = np.sort(held, axis=1)
        wrong = ((held >= 0) & ((held // self.experts_per_rank == np.arange(len(held))[:, None])
                                | (held >= self.num_experts))).any(1)
        wrong |= ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
        if wrong.any():
            rank = int(np.argmax(wrong))
            raise ValueError(f"rank {rank}'s replicas {self.replicas[rank]}: each another rank's expert, at most once")
        unused_last = np.where(held < 0, self.num_experts, held)
        unordered = (unused_last[:, 1:] < unused_last[:, :-1]).any(1)
        if unordered.any():
            rank = int(np.argmax(unordered))
            raise ValueError(f"rank {rank}'s replicas {self.replicas[rank]}: in ascending home slot, the unused (-1) "
                             f"last: {tuple(sorted(self.replicas[rank], key=lambda home: (home < 0, home)))}")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.expert_parallel_degree

    @property
    def slots(self) -> int:
        return len(self.replicas[0])

    @property
    def dispatched_experts(self) -> int:
        """Experts the backend dispatches over: every rank's home experts and replica slots."""
        return self.expert_parallel_degree * (self.experts_per_rank + self.slots)

    def dispatched_slot(self, rank: int, local_slot: int) -> int:
        """Dispatched id of local slot ``local_slot`` (home experts first, then replicas) of ``rank``."""
        return rank * (self.experts_per_rank + self.slots) + local_slot

    def copies(self) -> list[list[tuple[int, int]]]:
        """For each home slot, its copies as (rank, dispatched id): home first, then replicas by rank."""
        per_rank = self.experts_per_rank
        result = [[(home // per_rank, self.dispatched_slot(home // per_rank, home % per_rank))]
                  for home in range(self.num_experts)]
        for rank, held in enumerate(self.replicas):
            for j, home in enumerate(held):
                if home >= 0:
                    result[home].append((rank, self.dispatched_slot(rank, per_rank + j)))
        return result

    def copies_sent(self, rank: int) -> int:
        """Whole experts ``rank`` sends per fetch: the replica slots, over all ranks, that copy one of its experts."""
        return sum(home >= 0 and home // self.experts_per_rank == rank for held in self.replicas for home in held)

    def busiest_transfer(self) -> int:
        """Whole experts the busiest rank sends or receives in one fetch."""
        return max(max(self.copies_sent(rank), sum(home >= 0 for home in self.replicas[rank]))
                   for rank in range(self.expert_parallel_degree))

    def replicated(self) -> int:
        return sum(home >= 0 for held in self.replicas for home in held)
