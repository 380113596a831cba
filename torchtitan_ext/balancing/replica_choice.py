"""Which experts get replicas, re-chosen every ``[expert_replication] adapt_every`` steps.

:func:`choose_replicas` fills the replica slots one at a time: the home slot
with the most pairs per copy gets a copy on the least-loaded rank that has a
free slot and no copy of it yet, and its pairs are re-split over its copies
(the per-step rule, :func:`torchtitan_ext.ep.replica_split.water_fill`). It
stops when every slot is used or no expert with pairs can be copied further,
so it always ends (at most EP x S rounds), and since the split may leave a
copy empty, a plan is never worse than no replicas on the counts it was chosen
from.

:class:`ReplicaChooser` runs it for every MoE layer from the global counts of
the steps since the last choice (the same on every rank: the choice needs no
communication), one step after it copied them to the host, so that the host
never waits for the device's counts. Replicas are derived
state: nothing of them is checkpointed, and a resumed job chooses afresh.
"""

import heapq

import torch
from torchtitan.tools.logging import logger

from torchtitan_ext.balancing.migration import moe_modules
from torchtitan_ext.ep.base import to_host
from torchtitan_ext.ep.replica_split import water_fill
from torchtitan_ext.ep.replicated_experts import exchange_arguments
from torchtitan_ext.ep.replication import ReplicaPlan


def choose_replicas(counts: list[int], expert_parallel_degree: int, slots: int) -> ReplicaPlan:
    """The replicas for pairs ``counts`` per home slot, ``slots`` per rank."""
    experts = len(counts)
    per_rank = experts // expert_parallel_degree
    copy_ranks = [[home // per_rank] for home in range(experts)]
    shares = [[count] for count in counts]
    loads = [0] * expert_parallel_degree
    for home, count in enumerate(counts):
        loads[home // per_rank] += count
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
        others = [loads[r] - share for r, share in zip(copy_ranks[home], shares[home] + [0])]
        shares[home] = water_fill(torch.tensor(others), torch.tensor(counts[home])).tolist()
        for r, other, share in zip(copy_ranks[home], others, shares[home]):
            loads[r] = other + share
        heapq.heappush(heap, (-counts[home] / len(copy_ranks[home]), home))
    replicas = tuple(tuple(homes + [-1] * (slots - len(homes))) for homes in held)
    return ReplicaPlan(experts, expert_parallel_degree, replicas)


def window_start(step: int, adapt_every: int) -> int | None:
    """The first step of the counts that step ``step``'s replicas were chosen from (None: it runs without).

    A window of ``adapt_every`` steps closes before each due step d = 1 + k x adapt_every (k >= 1); its counts
    are copied to the host then and chosen from before step d + 1, for steps d + 1 .. d + adapt_every."""
    due = (step - 2) // adapt_every * adapt_every + 1
    return due - adapt_every if due > 1 else None


class ReplicaChooser:
    """Chooses every MoE layer's replicas without making the host wait for the device.

    When a choice is due (before step t, every ``adapt_every`` steps), each layer's window of counts starts its
    copy to host memory, queued behind step t - 1's work; the choice is made from it before step t + 1, once the
    device has long passed the copy, and holds from step t + 1 to step t + ``adapt_every``.
    """

    def __init__(self, job_config, model_parts):
        section = job_config.expert_replication
        self.slots = section.slots_per_rank
        self.adapt_every = section.adapt_every
        self.layers = {layer: moe for layer, moe in moe_modules(model_parts).items() if moe.replicas is not None}
        self.reported = False
        self._copied: dict[int, torch.Tensor] = {}
        """Layer -> its last window's counts in host memory, not yet chosen from."""
        self._copied_ready = None
        """An event the device passes after those copies (None where the host is the device)."""

    @property
    def first_replicated_step(self) -> int:
        """The first step that runs with replicas (:func:`window_start`)."""
        return self.adapt_every + 2

    def before_step(self, step: int) -> None:
        """Choose from the counts copied before the last step, if any; start the next copy when a choice is due."""
        if self._copied:
            self._choose(step)
        if step == 1 or (step - 1) % self.adapt_every:
            return
        windows = {layer: moe.replicas.take_window() for layer, moe in self.layers.items()}
        windows = {layer: window for layer, window in windows.items() if window is not None}
        self._copied = {layer: to_host(window) for layer, window in windows.items()}
        device = next((window.device for window in windows.values()), None)
        if device is not None and device.type != "cpu":
            self._copied_ready = torch.Event(device=device)
            self._copied_ready.record()

    def _choose(self, step: int) -> None:
        if self._copied_ready is not None:
            self._copied_ready.synchronize()  # passed a step ago, unless the host runs a whole step ahead
        refreshed = 0
        for layer, counts in self._copied.items():
            moe = self.layers[layer]
            plan = choose_replicas(counts.tolist(), moe.replicas.plan.expert_parallel_degree, self.slots)
            moe.replicas.set_plan(plan)
            moe.experts.set_plan(plan)
            refreshed += self._bytes(moe, plan)
        self._copied, self._copied_ready = {}, None
        if not self.reported and refreshed:
            self.reported = True
            logger.info(
                f"Expert replicas chosen before step {step} (every {self.adapt_every} step(s)): fetching their "
                f"weights sends {refreshed / 2**20:,.2f} MiB per step from this rank, and as much gradient back"
            )

    @staticmethod
    def _bytes(moe, plan: ReplicaPlan) -> int:
        """Bytes this rank sends to replicas per step (forward; the gradients' return is as many), in the
        dtype the experts computed in last."""
        send_local, *_ = exchange_arguments(plan, torch.distributed.get_rank(moe.replicas.group))
        return len(send_local) * moe.experts.bytes_per_expert
