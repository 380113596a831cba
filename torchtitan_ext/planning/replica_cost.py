"""What expert replication changes in a layout's step: the busiest rank's expert rows and the replicas' traffic.

:func:`replay` runs a routing-statistics dump's counts through training's choice of replicas
(:func:`torchtitan_ext.ep.replication.choice.choose_replicas`) and per-step split
(:func:`torchtitan_ext.ep.replication.split.split_quotas`), and returns the rows each rank computes and the
whole experts the busiest rank sends or receives per fetch; :func:`replica_traffic` prices that traffic
per MoE layer and call. The dump's counts are the job's, summed over its EP groups and microbatches.
See docs/balancing.md, "Pricing replication before you run it".
"""

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from torchtitan_ext.config import ConfigError
from torchtitan_ext.ep.replication.choice import choose_replicas, window_start
from torchtitan_ext.ep.replication.split import split_quotas, SplitTables
from torchtitan_ext.planning.cost_model import MeasuredRouting, MoEWorkload, transfer_seconds
from torchtitan_ext.planning.topology import Topology

COUNT_BYTES = 8
"""An int64 pair count, as the split all-gathers them."""


@dataclass(frozen=True)
class ReplicaReplay:
    """A dump replayed at one EP degree and slot count."""

    rows: np.ndarray
    """[priced dispatches, ep]: the pairs each EP rank computes."""
    experts_moved: float
    """Whole experts the busiest rank sends or receives per fetch (the larger), averaged over the priced
    dispatches; 0 without slots."""

    @property
    def rows_ratio(self) -> float:
        """The busiest rank's rows over the mean rank's, averaged over the dispatches with pairs (1: balanced)."""
        totals = self.rows.sum(axis=1)
        busy = totals > 0
        if not busy.any():
            return 1.0
        return float(np.mean(self.rows[busy].max(axis=1) * self.rows.shape[1] / totals[busy]))


def _priced(routing: MeasuredRouting, adapt_every: int) -> list[tuple[int, int]]:
    """(dump index of each priced step, dump index of the first step of its choice's window)."""
    steps = routing.step_numbers or tuple(range(1, routing.steps + 1))
    first = steps[0]
    if list(steps) != list(range(first, first + len(steps))):
        raise ConfigError(
            f"--routing-stats {routing.source} records steps {steps[0]}..{steps[-1]} with gaps: replaying replica "
            "choices needs consecutive steps; use the files of one uninterrupted run"
        )
    priced = []
    for index, step in enumerate(steps):
        window = window_start(step, adapt_every)
        if window is not None and window >= first:
            priced.append((index, window - first))
    if not priced:
        raise ConfigError(
            f"--routing-stats {routing.source} records steps {first}..{steps[-1]}; pricing replicas chosen every "
            f"{adapt_every} step(s) needs a step whose choice's {adapt_every} step(s) before it are recorded too: "
            "record more steps, or lower expert_replication.adapt_every"
        )
    return priced


def replay(routing: MeasuredRouting, ep: int, slots: int, adapt_every: int, progress: bool = False) -> ReplicaReplay:
    """The dump at ``ep`` ranks with ``slots`` replica slots each, chosen every ``adapt_every`` steps."""
    priced = _priced(routing, adapt_every)
    experts = routing.tokens_per_expert.shape[1]
    counts = routing.tokens_per_expert.reshape(routing.steps, routing.layers, experts).astype(np.int64)
    slots_per_rank = experts // ep + slots
    rows, moved = [], []
    plans: dict[tuple[int, int], tuple[SplitTables, int]] = {}
    for index, window in tqdm(priced, desc=f"replaying EP={ep}, {slots} slot(s)", unit="step", disable=not progress,
                              leave=False):
        for layer in range(routing.layers):
            current = counts[index, layer]
            if not slots:
                rows.append(current.reshape(ep, -1).sum(axis=1))
                continue
            if (window, layer) not in plans:
                plan = choose_replicas(counts[window:window + adapt_every, layer].sum(axis=0).tolist(), ep, slots)
                plans[window, layer] = SplitTables(plan, torch.device("cpu")), plan.busiest_transfer()
            tables, busiest = plans[window, layer]
            quotas = split_quotas(torch.from_numpy(current), tables)
            ranks = torch.div(tables.dispatched, slots_per_rank, rounding_mode="floor")
            rows.append(torch.zeros(ep, dtype=torch.int64).index_add_(0, ranks.flatten(), quotas.flatten()).numpy())
            moved.append(busiest)
    return ReplicaReplay(np.stack(rows), float(np.mean(moved)) if moved else 0.0)


def replica_traffic(work: MoEWorkload, topology: Topology, world_size: int, ep: int, experts_moved: float) -> tuple[float, float]:
    """(one forward's fetch and count exchange, one backward's gradient return), seconds per MoE layer and call,
    when the busiest rank sends or receives ``experts_moved`` whole experts per fetch."""
    if not experts_moved:
        return 0.0, 0.0
    level = topology.rank_levels(world_size)[ep - 1]
    weights = experts_moved * work.expert_parameters * work.gather_bytes
    fetch = transfer_seconds(topology, {level: weights})
    exchange = transfer_seconds(topology, {level: work.experts * COUNT_BYTES * (ep - 1)}, "all_gather")
    return fetch + exchange, fetch
