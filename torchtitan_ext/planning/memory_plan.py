"""EP memory plan: memory and drop risk of each backend for a job, before launch
(``python -m torchtitan_ext.plan`` prints it).

:func:`plan` gives, for one rank and each backend (nccl, deepep, hybridep blocking, and hybridep
non-blocking at the configured capacity factor): the communication buffer, the permuted rows per MoE
layer and those kept for backward, the expert parameters (with replica slots), whether it can drop
tokens and, with a routing-statistics dump, the expected drop rate; :func:`format_plan` prints it. Sizes
come from the runtime's own code on a meta-device model (:mod:`torchtitan_ext.measuring.dry_run`): nothing is allocated, no GPU
is needed. See docs/planning.md, "Memory and drops: the planner".
"""

from dataclasses import dataclass

import numpy as np
import torch
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import ConfigError, max_tokens_per_rank, model_args_of, MoEShape, routed_expert_elements
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.ep.base import token_group_alignment
from torchtitan_ext.ep.replication.plan import dispatched_shape, fetches_ahead, most_experts_sent


@dataclass(frozen=True)
class Dimensions:
    tokens: int
    """N: tokens one rank dispatches per MoE call."""
    ep: int
    local_experts: int
    top_k: int
    hidden: int
    activation_bytes: int
    """Bytes per element of the activations the experts see."""
    replica_slots: int = 0
    """S: replica slots per rank ([expert_replication] slots_per_rank)."""
    expert_elements: int = 0
    """Elements of one routed expert's weights, all its parameters."""


@dataclass(frozen=True)
class BackendPlan:
    name: str
    pad_multiple: int
    buffer_bytes: int | None
    buffer_note: str
    rows_balanced: int
    """Rows with perfectly balanced routing: N * K, plus worst-case padding."""
    rows_worst: int
    """Rows at most (every token to min(L, K) local experts from every rank), padded;
    for non-blocking HybridEP the fixed M."""
    saved_layers: int
    can_drop: bool
    expected_drop_rate: float | None
    worst_layer_drop_rate: tuple[int, float] | None


@dataclass(frozen=True)
class Plan:
    dims: Dimensions
    dry_run: object
    """The job's dry run (:class:`torchtitan_ext.measuring.dry_run.DryRunReport`), whose numbers the plan prints."""
    saved_layers_reason: str
    backends: list[BackendPlan]
    replica_copies: tuple[int, int] = (0, 0)
    """Under expert replication, :func:`replica_copies_alive`."""


def expected_drop_rates(stats, dims: Dimensions, num_rows: int, pad: int) -> tuple[float, tuple[int, float]]:
    """(overall, (worst layer, its rate)) expected drop rates of non-blocking dispatch.

    Each step's per-expert counts, scaled to one dispatch of N tokens on each of
    the R ranks, give every rank's expected per-expert counts; the contract's
    tail rule (padded groups, rows >= M dropped) gives the drops. This uses
    mean loads: microbatch-to-microbatch fluctuation adds drops it cannot see.
    """
    counts = stats["tokens_per_expert"].astype(np.float64)  # [S, L, E]
    num_experts = counts.shape[2]
    if num_experts != dims.ep * dims.local_experts:
        raise ConfigError(
            f"the routing statistics have {num_experts} experts but the job has "
            f"{dims.ep * dims.local_experts}: record them with the same model flavour"
        )
    per_layer_dropped = np.zeros(counts.shape[1])
    per_layer_routed = np.zeros(counts.shape[1])
    for step_counts in counts:
        for layer, per_expert in enumerate(step_counts):
            tokens = per_expert.sum() / dims.top_k
            if tokens == 0:
                continue
            expected = per_expert * (dims.tokens * dims.ep / tokens)
            for rank in range(dims.ep):
                local = np.ceil(expected[rank * dims.local_experts : (rank + 1) * dims.local_experts])
                padded = np.ceil(local / pad) * pad
                offsets = np.cumsum(padded) - padded
                kept = np.minimum(local, np.maximum(num_rows - offsets, 0))
                per_layer_dropped[layer] += (local - kept).sum()
                per_layer_routed[layer] += local.sum()
    rates = per_layer_dropped / np.maximum(per_layer_routed, 1)
    worst = int(np.argmax(rates))
    return (
        float(per_layer_dropped.sum() / max(per_layer_routed.sum(), 1)),
        (int(stats["layers"][worst]), float(rates[worst])),
    )


def _plan_rows(dims: Dimensions, pad: int) -> tuple[int, int]:
    slots = dims.local_experts + dims.replica_slots
    padding = slots * (pad - 1)
    worst = dims.tokens * dims.ep * min(slots, dims.top_k) + padding
    return dims.tokens * dims.top_k + padding, worst


def plan(job_config, report, routing_stats=None) -> Plan:
    """The plan of ``job_config`` from its dry run ``report`` (the layers rank 0 holds, its parameters); with
    ``routing_stats``, a dump's expected drop rates."""
    if "name" not in report.ep_settings:
        raise ConfigError("the planner needs an MoE model with expert_parallel_degree > 1")
    model_args = model_args_of(job_config)
    ep = job_config.parallelism.expert_parallel_degree
    activation_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    dims = Dimensions(
        tokens=max_tokens_per_rank(job_config),
        ep=ep,
        local_experts=model_args.moe_args.num_experts // ep,
        top_k=model_args.moe_args.top_k,
        hidden=model_args.dim,
        activation_bytes=torch.empty((), dtype=activation_dtype).element_size(),
        replica_slots=job_config.expert_replication.slots_per_rank,
        expert_elements=routed_expert_elements(job_config),
    )
    saved, reason = saved_moe_layers(job_config, report.rank_layers, report.rank_moe_layers)
    align = token_group_alignment(job_config)
    shape = dispatched_shape(job_config, MoEShape(dims.hidden, dims.ep * dims.local_experts, dims.top_k, dims.tokens))
    backends = []
    for backend_name, backend in BACKENDS.items():
        pad = max(align, backend.min_pad_multiple)
        profile = PLANNING_PROFILES[backend_name]
        buffer_bytes, note = profile.planned_buffer(job_config, shape)
        for mode, fixed_rows in profile.planned_modes(job_config, shape, pad):
            balanced, worst = _plan_rows(dims, pad)
            can_drop, rate, worst_layer = False, None, None
            if fixed_rows is not None:
                can_drop = fixed_rows < worst
                balanced = worst = fixed_rows
                if routing_stats is not None:
                    rate, worst_layer = expected_drop_rates(routing_stats, dims, fixed_rows, pad)
            name = f"{backend_name} {mode}".strip()
            backends.append(
                BackendPlan(name, pad, buffer_bytes, note, balanced, worst, saved, can_drop, rate, worst_layer)
            )
    # the GPU path: grouped GEMMs compute from a copy
    copies = replica_copies_alive(job_config, report.rank_layers, report.rank_moe_layers, copied=True)
    return Plan(dims, report, reason, backends, copies)


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:,.2f} GiB"


def format_plan(result: Plan, world_size: int) -> list[str]:
    d, report = result.dims, result.dry_run
    row_bytes = d.hidden * d.activation_bytes
    lines = [
        f"EP plan: {report.model} on {world_size} ranks, for one rank",
        f"  N={d.tokens:,} tokens per dispatch, EP R={d.ep}, L={d.local_experts} local experts, "
        f"top_k K={d.top_k}, hidden H={d.hidden:,} ({d.activation_bytes}-byte activations)",
        f"  expert parameters on this rank: {report.rank_expert_parameters:,} "
        f"({_gib(report.rank_expert_parameter_bytes)}); MoE layers on this rank: {len(report.rank_moe_layers)}",
        f"  saved MoE layers: {result.saved_layers_reason}",
    ]
    if d.replica_slots:
        expert_bytes = d.expert_elements * d.activation_bytes
        replica_bytes = d.replica_slots * expert_bytes
        copy_bytes = (d.local_experts + d.replica_slots) * expert_bytes
        copies, fetched = result.replica_copies
        peak = copies * copy_bytes + fetched * replica_bytes
        alive = f"{copies} layer(s)' copies" + (f" and {fetched} layer(s)' fetched replicas" if fetched else "")
        lines.append(
            f"  replica slots: {d.replica_slots} per MoE layer, weights fetched every step: {replica_bytes / 2**20:,.2f} "
            f"MiB per layer, and as much gradient back (no optimizer state); grouped GEMMs (SM90 on) compute from a copy of the "
            f"{d.local_experts} home experts beside the replicas, {copy_bytes / 2**20:,.2f} MiB per layer: "
            f"{peak / 2**20:,.2f} MiB at the peak ({alive} alive at once under this activation checkpointing)"
        )
        most = most_experts_sent(d.ep, d.local_experts, d.replica_slots)
        lines.append(
            f"  beside that peak, one layer at a time: the experts a rank sends, gathered for the fetch's all-to-all, "
            f"and as many of their gradients arriving backward (widened to fp32 {d.replica_slots} rows at a time, "
            f"summed into one fp32 row per expert sent): {replica_bytes / 2**20:,.2f} MiB on average, "
            f"{most * expert_bytes / 2**20:,.2f} MiB ({most} experts) on a rank whose experts every other rank copies"
        )
    for b in result.backends:
        lines += [
            f"  [{b.name}]  groups padded to {b.pad_multiple}",
            f"    communication buffer: {_gib(b.buffer_bytes)}  ({b.buffer_note})",
            f"    permuted rows per MoE layer: {b.rows_balanced:,} balanced ({_gib(b.rows_balanced * row_bytes)}), "
            f"{b.rows_worst:,} worst case ({_gib(b.rows_worst * row_bytes)})"
            if b.rows_balanced != b.rows_worst
            else f"    permuted rows per MoE layer: {b.rows_worst:,} fixed ({_gib(b.rows_worst * row_bytes)})",
            f"    x {b.saved_layers} saved layers: {_gib(b.rows_balanced * row_bytes * b.saved_layers)} balanced, "
            f"{_gib(b.rows_worst * row_bytes * b.saved_layers)} worst case",
            f"    can drop tokens: {'yes' if b.can_drop else 'no'}",
        ]
        if b.expected_drop_rate is not None:
            layer, rate = b.worst_layer_drop_rate
            lines.append(
                f"    expected drop rate for the recorded routing: {b.expected_drop_rate:.3%} "
                f"(worst: layer {layer}, {rate:.3%})"
            )
    return lines


def replica_copies_alive(job_config, rank_layers, rank_moe_layers, *, copied: bool) -> tuple[int, int]:
    """(copies, fetched) at the peak under expert replication: how many MoE layers' copies of their L home experts
    beside their S replicas (L + S experts each) are alive at once, and how many layers' fetched replicas (S experts
    each), at the moment their sum is largest.

    ``copied``: each layer computes from such a copy (one tensor per projection), built from its fetched replicas,
    which live until its experts are done: grouped GEMMs, the path of the GPUs the plan is for (SM90 on); False:
    torchtitan's per-expert loop (a CPU, an older GPU), which computes from views of the home experts and of the
    fetched replicas.
    Where layers fetch ahead (:func:`~torchtitan_ext.ep.replication.plan.fetches_ahead`) the next block's are in
    flight beside them where it is a MoE layer too (counted also where a library's transport, which fetches one
    layer at a time, skips it). Backward keeps what a layer computed from (its copy, or its fetched replicas)
    unless activation checkpointing drops it: a recomputed layer fetches again (and rebuilds its copy) beside what
    the kept layers below it hold; per-op selective checkpointing keeps every layer's fetched replicas
    (``replica_weights`` is on its save list) and rebuilds one copy at a time."""
    moe = len(rank_moe_layers)
    if not moe:
        return 0, 0
    ac = job_config.activation_checkpoint
    per_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    if ac.mode == "none":
        kept = [True] * moe
    elif ac.mode == "full" or per_op:
        kept = [False] * moe
    else:
        wrapped = _checkpointed_layers(int(ac.selective_ac_option), rank_layers)
        kept = [layer not in wrapped for layer in rank_moe_layers]
    ahead = fetches_ahead(job_config)
    position = {layer: index for index, layer in enumerate(rank_layers)}

    def moment(kept_copies: int, own: int, fetched: int) -> tuple[int, int]:
        """(copies, fetched) alive: ``kept_copies`` layers below hold what they computed from, and ``own`` layer
        its copy where there is one, beside ``fetched`` layers' fetched replicas."""
        return (kept_copies + own, fetched) if copied else (0, kept_copies + fetched)

    moments = []
    for k in range(moe):
        # the next block's replicas, where it is a MoE layer (ep.replication.experts.link_fetch_ahead)
        next_fetched = ahead and k + 1 < moe and position[rank_moe_layers[k + 1]] == position[rank_moe_layers[k]] + 1
        kept_below = sum(kept[:k])
        # forward, layer k's experts: what the layers below kept, its own copy, its fetched replicas (and those
        # saved below it by per-op checkpointing), and the next layer's in flight
        moments.append(moment(kept_below, 1, (k if per_op else 0) + 1 + next_fetched))
        # backward, layer k: a recomputed layer's copy beside what the kept ones below it hold, from replicas
        # fetched again (per-op: the saved ones of layers 0..k)
        if not kept[k]:
            moments.append(moment(kept_below, 1, k + 1 if per_op else 1))
    moments.append(moment(sum(kept), 0, moe if per_op else 0))  # forward's end: what it leaves for backward
    # weighed in experts; for a job without slots (the advisor prices some), as with one
    slots = job_config.expert_replication.slots_per_rank or 1
    copy_experts = model_args_of(job_config).moe_args.num_experts // job_config.parallelism.expert_parallel_degree + slots
    return max(moments, key=lambda moment: moment[0] * copy_experts + moment[1] * slots)


def _checkpointed_layers(every: int, rank_layers) -> set[int]:
    """The layers per-layer selective checkpointing wraps: every ``every``-th of the rank's, counted from 1."""
    return {layer for index, layer in enumerate(rank_layers, start=1) if index % every == 0}


def saved_moe_layers(job_config, rank_layers, rank_moe_layers) -> tuple[int, str]:
    """MoE layers on this rank whose dispatch output stays alive for backward, and why."""
    ac = job_config.activation_checkpoint
    moe = len(rank_moe_layers)
    if ac.mode == "none":
        return moe, "no activation checkpointing: every MoE layer keeps its dispatched rows"
    if ac.mode == "full":
        return 0, "full activation checkpointing: rows are recomputed in backward (one layer's are live at a time)"
    if ac.selective_ac_option == "op":
        return moe, "per-op selective checkpointing: dispatch is on the save list, so every MoE layer keeps its rows"
    every = int(ac.selective_ac_option)
    wrapped = _checkpointed_layers(every, rank_layers)
    kept = sum(layer not in wrapped for layer in rank_moe_layers)
    return kept, f"per-layer selective checkpointing every {every} layers: {kept} of {moe} MoE layers keep their rows"
