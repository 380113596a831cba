"""EP planner: memory and drop risk of each backend for a job, before launch.

    python -m torchtitan_ext.plan --job.config_file X [overrides] [--world-size N] [--routing-stats DUMP]
        [--topology T [--measure-compute]]
    python -m torchtitan_ext.plan --paper --topology T --world-size G --paper-data-mb D --paper-expert-mb P_E
        --paper-pre-expert-ms PE
    python -m torchtitan_ext.plan --calibrate [--nproc N] [--calibrate-output FILE]

For one rank, and for each backend (nccl, deepep, hybridep blocking,
hybridep non-blocking at the configured capacity factor), prints:

- the communication buffer's bytes;
- the permuted rows per MoE layer (the experts' input; bytes at the
  activation dtype), and that times the MoE layers whose dispatch output
  stays alive for backward under the configured activation checkpointing;
- the expert parameter bytes this rank holds;
- whether the config can drop tokens, and with a routing-statistics dump the
  expected drop rate for that routing (the contract's tail rule and padding).

With ``--topology`` (a file, or a name in ``topologies/``) it adds the layout
advisor's ranked table (:mod:`torchtitan_ext.layout_advisor`): every backend and
EP degree the job can run, the predicted MoE communication and exposed time per
step, and the overrides that select the winner; ``--measure-compute`` times the
job's per-rank compute, and each backend's local dispatch and combine work, on this
machine for it (:mod:`torchtitan_ext.measured_compute`).
``--paper`` evaluates the seed paper's own one-level setting; ``--calibrate``
measures this machine and writes its topology file (:mod:`torchtitan_ext.calibrate`).

Every size comes from the code the runtime runs: the model is built on the
meta device and parallelized as in training (``dry_run``), the non-blocking
row count is ``hybridep.non_blocking_rows``, the buffers' bytes are the
reference buffer's allocation (and DeepEP's own size hints when deep_ep is
importable). Without ``--measure-compute`` nothing is allocated; no GPU is needed.
"""

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext import runtime
from torchtitan_ext.calibrate import calibrate
from torchtitan_ext.config import ConfigError
from torchtitan_ext.cost_model import PaperSetting
from torchtitan_ext.data import register_embedded_dataset
from torchtitan_ext.dry_run import dry_run, DryRunReport
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.ep.base import max_tokens_per_rank, MoEShape, token_group_alignment
from torchtitan_ext.ep.hybridep import non_blocking_rows
from torchtitan_ext.job_config import saved_moe_layers
from torchtitan_ext.layout_advisor import advise, format_advice, format_paper, overrides_problem
from torchtitan_ext.measured_compute import check_measurable, measure_compute
from torchtitan_ext.models import register_train_specs
from torchtitan_ext.routing_stats import load, load_folder
from torchtitan_ext.topology import load_topology
from torchtitan_ext.train import load_job_config


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
    dry_run: DryRunReport
    saved_layers_reason: str
    backends: list[BackendPlan]


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
    padding = dims.local_experts * (pad - 1)
    worst = dims.tokens * dims.ep * min(dims.local_experts, dims.top_k) + padding
    return dims.tokens * dims.top_k + padding, worst


def plan(job_config, world_size: int, routing_stats=None) -> Plan:
    report = dry_run(job_config, world_size)
    if "name" not in report.ep_settings:
        raise ConfigError("the planner needs an MoE model with expert_parallel_degree > 1")
    from torchtitan.protocols.train_spec import get_train_spec

    model_args = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
    ep = job_config.parallelism.expert_parallel_degree
    activation_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    dims = Dimensions(
        tokens=max_tokens_per_rank(job_config),
        ep=ep,
        local_experts=model_args.moe_args.num_experts // ep,
        top_k=model_args.moe_args.top_k,
        hidden=model_args.dim,
        activation_bytes=torch.empty((), dtype=activation_dtype).element_size(),
    )
    saved, reason = saved_moe_layers(job_config, report.rank_layers, report.rank_moe_layers)
    align = token_group_alignment(job_config)
    shape = MoEShape(dims.hidden, dims.ep * dims.local_experts, dims.top_k, dims.tokens)
    backends = []
    for backend_name, backend in BACKENDS.items():
        pad = max(align, backend.min_pad_multiple)
        buffer_bytes, note = backend.planned_buffer(job_config, shape)
        for mode, capacity_factor in backend.planned_modes(job_config):
            balanced, worst = _plan_rows(dims, pad)
            can_drop, rate, worst_layer = False, None, None
            if capacity_factor is not None:
                num_rows = non_blocking_rows(dims.tokens, ep, dims.local_experts, dims.top_k, capacity_factor, pad)
                can_drop = num_rows < worst
                balanced = worst = num_rows
                if routing_stats is not None:
                    rate, worst_layer = expected_drop_rates(routing_stats, dims, num_rows, pad)
            name = f"{backend_name} {mode}".strip()
            backends.append(
                BackendPlan(name, pad, buffer_bytes, note, balanced, worst, saved, can_drop, rate, worst_layer)
            )
    return Plan(dims, report, reason, backends)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: dp x cp x tp x pp from the config)")
    parser.add_argument("--routing-stats", type=Path,
                        help="routing_stats folder or .npz file: the expected drop rate, and with --topology the measured token bytes")
    parser.add_argument("--topology", help="topology TOML (a path, or a name in topologies/): add the layout advice")
    parser.add_argument(
        "--measure-compute", action="store_true",
        help="with --topology: time the job's per-rank compute and each backend's local dispatch work on this "
             "machine (one process per rank) instead of FLOPs",
    )
    parser.add_argument("--paper", action="store_true", help="evaluate the seed paper's one-level setting (needs --topology)")
    parser.add_argument("--paper-data-mb", type=float, help="--paper: D, MB of tokens one worker dispatches")
    parser.add_argument("--paper-expert-mb", type=float, help="--paper: P_E, MB of one worker's experts")
    parser.add_argument("--paper-pre-expert-ms", type=float, help="--paper: Lat^PE, pre-expert compute in ms")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine and write its topology")
    parser.add_argument("--nproc", type=int, default=2, help="--calibrate: gloo processes (default 2)")
    parser.add_argument(
        "--calibrate-output", type=Path, default=Path("outputs/this_machine_topology.toml"),
        help="--calibrate: where to write the topology (default outputs/this_machine_topology.toml)",
    )
    args, train_args = parser.parse_known_args(argv)
    if args.calibrate:
        _exit_on_error(_check_process_count, args.nproc)
        calibrate(args.nproc, args.calibrate_output)
        return
    if args.paper:
        print("\n".join(_exit_on_error(_paper, args)))
        return
    runtime.configure()
    register_embedded_dataset()
    register_train_specs()
    try:
        topology = load_topology(args.topology) if args.topology else None
        job_config = load_job_config(train_args, device_type=None)
        world_size = args.world_size or job_world_size(job_config)
        if world_size < 1:
            raise ConfigError(f"--world-size {world_size}: use a rank count >= 1")
        if topology is not None:
            topology.group_sizes(world_size)
        job_config = load_job_config(train_args, device_type=None, world_size=world_size)
        if args.measure_compute and topology is None:
            raise ConfigError("--measure-compute sets the layout advice's compute: add --topology")
        if args.measure_compute:
            check_measurable(load_job_config(train_args, device_type="cpu", world_size=world_size), world_size)
        stats = None
        if args.routing_stats is not None:
            stats = load(args.routing_stats) if args.routing_stats.is_file() else load_folder(args.routing_stats)
        result = plan(job_config, world_size, stats)
        compute = measure_compute(train_args, world_size) if args.measure_compute else None
        advice, routing = (None, None) if topology is None else advise(
            train_args, world_size, topology, stats, str(args.routing_stats), compute
        )
        problem = overrides_problem(train_args, world_size, advice[0]) if advice and advice[0].refused is None else None
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print("\n".join(format_plan(result, world_size)))
    if advice is not None:
        print("\n".join(format_advice(advice, topology, world_size, result.dry_run.model, problem, routing, compute)))


def _exit_on_error(fn, *args):
    try:
        return fn(*args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _check_process_count(nproc: int) -> None:
    if nproc < 2:
        raise ConfigError(f"--nproc {nproc}: an all-to-all needs at least 2 processes")


def _paper(args) -> list[str]:
    missing = [
        flag for flag, value in (
            ("--topology", args.topology), ("--world-size", args.world_size), ("--paper-data-mb", args.paper_data_mb),
            ("--paper-expert-mb", args.paper_expert_mb), ("--paper-pre-expert-ms", args.paper_pre_expert_ms),
        ) if value is None
    ]
    if missing:
        raise ConfigError(f"--paper needs {', '.join(missing)}")
    for flag, value in (("--world-size", args.world_size), ("--paper-data-mb", args.paper_data_mb),
                        ("--paper-expert-mb", args.paper_expert_mb)):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: use a value > 0")
    if args.paper_pre_expert_ms < 0:
        raise ConfigError(f"--paper-pre-expert-ms {args.paper_pre_expert_ms}: use a time >= 0")
    topology = load_topology(args.topology)
    link = topology.levels[-1]
    setting = PaperSetting(
        args.world_size, args.paper_data_mb * 1e6, args.paper_expert_mb * 1e6, link.bandwidth_GBps * 1e9,
        args.paper_pre_expert_ms * 1e-3,
    )
    return format_paper(setting, f"'{link.name}' of {topology.name}")


def job_world_size(job_config) -> int:
    """The world size the job's degrees fix; ConfigError when data_parallel_shard_degree = -1 leaves it open."""
    p = job_config.parallelism
    if p.data_parallel_shard_degree < 0:
        raise ConfigError(
            "data_parallel_shard_degree = -1 leaves the world size open: pass --world-size N"
        )
    return math.prod((
        p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
        p.tensor_parallel_degree, p.pipeline_parallel_degree,
    ))


if __name__ == "__main__":
    main()
