"""What expert replication changes in a layout's step: the busiest rank's expert rows and the replicas' traffic.

Each EP rank computes the (token, expert) pairs of its experts, and a step
waits for the busiest rank. Under measured routing (a routing-statistics
dump), :func:`busiest_rows_ratio` replays the dump as training runs it
(:mod:`torchtitan_ext.balancing.replica_choice` chooses the replicas from
the counts of the ``adapt_every`` steps before each choice;
:mod:`torchtitan_ext.ep.replica_split` splits every step's pairs among the
copies), with experts in logical order (no placement), and returns the
busiest rank's rows over the mean rank's. Steps before the first choice are
left out at every slot count, so that 0 and S slots are priced on the same
dispatches. Under uniform routing every rank computes the mean: replicas then
only add their traffic.

:func:`replica_traffic` is that traffic per MoE layer and call, one rank:
the forward fetches the S replicas' weights (whole experts, in the dtype
FSDP gathers them in) and all-gathers the pair counts (E int64 per rank) for
the split; the backward returns as many gradient elements home. A forward
that activation checkpointing recomputes fetches and counts again. It runs
over the EP group's outermost link at the all-to-all bandwidth, and the step
waits for it (the fetch is issued inside the layer, just before the experts
compute).
"""

import numpy as np
import torch
from tqdm import tqdm

from torchtitan_ext.balancing.replica_choice import choose_replicas
from torchtitan_ext.config import ConfigError
from torchtitan_ext.ep.replica_split import split_quotas, SplitTables
from torchtitan_ext.planning.cost_model import MeasuredRouting, MoEWorkload, transfer_seconds
from torchtitan_ext.planning.topology import Topology

COUNT_BYTES = 8
"""An int64 pair count, as the split all-gathers them."""


def check_replayable(routing: MeasuredRouting, adapt_every: int) -> None:
    """ConfigError when the dump has no step after the first choice of replicas."""
    if routing.steps <= adapt_every:
        raise ConfigError(
            f"--routing-stats {routing.source} records {routing.steps} step(s); pricing replicas chosen every "
            f"{adapt_every} step(s) needs at least {adapt_every + 1}: record more steps, or lower "
            "expert_replication.adapt_every"
        )


def rows_per_rank(routing: MeasuredRouting, ep: int, slots: int, adapt_every: int, progress: bool = False) -> np.ndarray:
    """[priced dispatches, ep]: the pairs each EP rank computes at every dispatch after the first choice."""
    check_replayable(routing, adapt_every)
    experts = routing.tokens_per_expert.shape[1]
    counts = routing.tokens_per_expert.reshape(routing.steps, routing.layers, experts).astype(np.int64)
    slots_per_rank = experts // ep + slots
    rows = []
    steps = range(adapt_every, routing.steps)
    for step in tqdm(steps, desc=f"replaying EP={ep}, {slots} slot(s)", unit="step", disable=not progress, leave=False):
        chosen_at = step // adapt_every * adapt_every
        for layer in range(routing.layers):
            current = counts[step, layer]
            if not slots:
                rows.append(current.reshape(ep, -1).sum(axis=1))
                continue
            window = counts[chosen_at - adapt_every:chosen_at, layer].sum(axis=0)
            tables = SplitTables(choose_replicas(window.tolist(), ep, slots), torch.device("cpu"))
            quotas = split_quotas(torch.from_numpy(current), tables)
            ranks = torch.div(tables.dispatched, slots_per_rank, rounding_mode="floor")
            rows.append(torch.zeros(ep, dtype=torch.int64).index_add_(0, ranks.flatten(), quotas.flatten()).numpy())
    return np.stack(rows)


def busiest_rows_ratio(routing: MeasuredRouting, ep: int, slots: int, adapt_every: int, progress: bool = False) -> float:
    """The busiest EP rank's rows over the mean rank's, averaged over the priced dispatches (1: balanced)."""
    rows = rows_per_rank(routing, ep, slots, adapt_every, progress)
    totals = rows.sum(axis=1)
    busy = totals > 0
    if not busy.any():
        return 1.0
    return float(np.mean(rows[busy].max(axis=1) * ep / totals[busy]))


def replica_traffic(work: MoEWorkload, topology: Topology, world_size: int, ep: int, slots: int) -> tuple[float, float]:
    """(one forward's fetch and count exchange, one backward's gradient return), seconds per MoE layer and call."""
    if not slots:
        return 0.0, 0.0
    sizes = topology.group_sizes(world_size)
    level = topology.level_of(sizes, 0, ep - 1)
    weights = slots * work.expert_parameters * work.gather_bytes
    fetch = transfer_seconds(topology, {level: weights})
    exchange = transfer_seconds(topology, {level: work.experts * COUNT_BYTES * (ep - 1)}, "all_gather")
    return fetch + exchange, fetch
