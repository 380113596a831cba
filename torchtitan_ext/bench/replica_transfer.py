"""Expert replication's transfers alone: the replicas' weights out (forward) and their gradients home (backward).

    python -m torchtitan_ext.bench replica_transfer [--job.config_file F] [--slots 1,2] [--iterations 20]
        [--dtype float32|bfloat16] [job overrides]

For the job's model (default: the debug model) and EP = 2 (two gloo processes
on this machine, the weights in ``--dtype``, fp32 by default), every replica slot filled: times one MoE layer's
``torchtitan_ext::replica_weights`` (the fetch, forward) and
``replica_gradients`` (the gradients' return, summed per home expert in fp32,
backward), the slower rank's median
over ``--iterations`` after one warm-up, and prints the bytes each rank sends
per layer and direction and both times per layer and per step (all MoE layers).
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.config.job import shared_meta_model
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers
from torchtitan_ext.training import prepare

EP = 2


def expert_shape(config_args: list[str]) -> tuple[str, int, int, int]:
    """(model and flavour, experts per MoE layer, floats in one expert's parameters, MoE layers)."""
    job_config = load_job_config(config_args, device_type=None, world_size=EP)
    moes = [block.moe for block in shared_meta_model(job_config).layers.values() if block.moe_enabled]
    if not moes:
        raise ConfigError(f"model {job_config.model.name} {job_config.model.flavor} has no MoE layer to replicate")
    experts = moes[0].experts
    floats = sum(weight[0].numel() for weight in experts.parameters())
    return f"{job_config.model.name} {job_config.model.flavor}", experts.num_experts, floats, len(moes)


def worker(rank: int, world_size: int, experts: int, floats: int, slots: int, iterations: int,
           dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(median seconds of one layer's fetch, of its gradients' return) on this rank."""
    from torch.distributed.distributed_c10d import _get_process_group_name

    from torchtitan_ext.ep.replication import transport_ops
    from torchtitan_ext.ep.replication.experts import exchange_arguments, fetch_replicas, redundancy_mapping
    from torchtitan_ext.ep.replication.plan import ReplicaPlan

    per_rank = experts // EP
    # every slot of a rank copies one of the other rank's experts
    plan = ReplicaPlan(experts, EP, tuple(tuple((1 - r) * per_rank + j for j in range(slots)) for r in range(EP)))
    exchange, mapping = exchange_arguments(plan, rank), redundancy_mapping(plan)
    group = _get_process_group_name(dist.group.WORLD)
    home = [torch.randn(per_rank, floats, dtype=dtype)]
    fetch, back = [], []
    for _ in range(iterations + 1):
        dist.barrier()
        began = time.perf_counter()
        # landed: the fetch timed whole
        fetched = torch.ops._c10d_functional.wait_tensor(fetch_replicas(home, exchange, mapping, slots, group))
        middle = time.perf_counter()
        transport_ops().replica_gradients(torch.ones_like(fetched), *exchange, mapping, per_rank, group)
        ended = time.perf_counter()
        fetch.append(middle - began)
        back.append(ended - middle)
    return statistics.median(fetch[1:]), statistics.median(back[1:])


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--job.config_file", dest="config", default="train_configs/debug_model.toml")
    parser.add_argument("--slots", default="1,2", help="replica slots per rank to time, comma-separated")
    parser.add_argument("--iterations", type=int, default=20, help="timed fetch + return pairs (median reported)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' dtype (bf16 gradients are summed in fp32 on their way home)")
    args, overrides = parser.parse_known_args(argv)
    overrides = overrides[1:] if overrides[:1] == ["--"] else overrides
    if args.iterations < 1:
        parser.error("--iterations: use at least 1")
    try:
        slot_counts = [int(value) for value in args.slots.split(",")]
    except ValueError:
        parser.error(f"--slots {args.slots!r}: comma-separated whole numbers, e.g. 1,2")
    prepare()
    try:
        name, experts, floats, layers = expert_shape(["--job.config_file", args.config, *overrides])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    usable = experts // EP
    if any(not 1 <= slots <= usable for slots in slot_counts):
        parser.error(f"--slots {args.slots}: each from 1 to {usable} (the other rank's experts) at EP={EP}")
    dtype = getattr(torch, args.dtype)
    size = dtype.itemsize
    print(f"{name}: {experts} experts of {floats * size / 2**20:.3f} MiB in {args.dtype}, {layers} MoE layers, "
          f"EP={EP}, gloo on this machine, median of {args.iterations}")
    print("| slots per rank | MiB per layer each way | fetch ms per layer | return ms per layer | both, ms per step |")
    print("|---|---|---|---|---|")
    for slots in slot_counts:
        per_rank = run_workers(EP, worker, experts, floats, slots, args.iterations, dtype, preload=[__name__])
        fetch, back = (max(times) for times in zip(*per_rank))
        print(f"| {slots} | {slots * floats * size / 2**20:.3f} | {fetch * 1e3:.3f} | {back * 1e3:.3f} | "
              f"{(fetch + back) * layers * 1e3:.2f} |", flush=True)
    return 0
