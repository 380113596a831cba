"""The MoE layer's forward with the shared experts overlapping combine, against combine landed first.

    python -m torchtitan_ext.bench overlap --nproc 2 --tokens 4096 --hidden 1024 --ffn 2048 --experts 8 --top-k 2
        [--backends VARIANT ...] [--campaign FILE]

Runs ``--nproc`` processes (gloo on CPU, NCCL with one GPU each on CUDA), EP over all of them, and builds
torchtitan's MoE layer (router, routed experts under the backend, one shared expert) for each backend variant.
Every timed iteration runs the layer's forward twice, in alternating order: as trained (the shared experts run
while combine is in flight, where the backend allows it) and with combine landed before the shared experts.
Reported per backend: median ms of each, the slowest rank's, and their ratio (landed first / overlapped; above 1:
the overlap saves time). ``hybridep`` cannot overlap: its ratio shows the noise. ``--campaign`` writes the rows
to a new campaign file.
"""

import statistics
from pathlib import Path

import torch

from torchtitan_ext.ep.backends import backend_variants, DEFAULT_VARIANTS, variant_backend
from torchtitan_ext.measuring.timing import DEADLINE_S, progress_bar, rank_device, time_once, workers_device
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers


def _moe_layer(variant: str, args, mesh, device, dtype):
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from torchtitan_ext.config import parse as parse_job_config
    from torchtitan_ext.ep import BACKENDS, MoEShape
    from torchtitan_ext.models.moe import ExpertParallelMoE

    torch.manual_seed(0)
    moe_args = MoEArgs(num_experts=args.experts, num_shared_experts=1, top_k=args.top_k, score_before_experts=False)
    moe = MoE(moe_args, dim=args.hidden, hidden_dim=args.ffn)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(std=args.hidden**-0.5)
    moe = moe.to(device=device, dtype=dtype)
    shape = MoEShape(args.hidden, args.experts, args.top_k, args.tokens)
    job_config = parse_job_config(backend_variants()[variant])
    style = BACKENDS[variant_backend(variant)].layer_factory(job_config, shape)(score_before_experts=False)
    parallelize_module(moe.experts, mesh, style)
    return ExpertParallelMoE.adopt(moe)


def _land_first_switch(moe):
    """A switch that, when on, makes the routed experts' output land before the MoE goes on."""
    from torch.distributed._functional_collectives import wait_tensor

    switch = {"on": False}

    def land(module, inputs, output):
        return wait_tensor(output) if switch["on"] else None

    moe.experts.register_forward_hook(land)
    return switch


def _worker(rank: int, world_size: int, args) -> list[dict]:
    device = rank_device(rank)
    torch.set_num_threads(args.threads)
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext import runtime

    runtime.configure()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank)).to(device, dtype)
    progress = progress_bar(rank, not args.no_progress, total=len(args.backends) * (args.warmup + args.iters),
                            desc="bench overlap", unit="iter")
    rows = []
    for variant in args.backends:
        moe = _moe_layer(variant, args, mesh, device, dtype)
        land_first = _land_first_switch(moe)

        def forward(landed_first: bool):
            land_first["on"] = landed_first
            with torch.no_grad():
                moe(x)

        times = {False: [], True: []}
        for i in range(args.warmup + args.iters):
            for landed_first in ((False, True) if i % 2 else (True, False)):
                elapsed = time_once(lambda: forward(landed_first), device)
                if i >= args.warmup:
                    times[landed_first].append(elapsed)
            if progress:
                progress.update(1)
        overlapped, landed = statistics.median(times[False]), statistics.median(times[True])
        rows.append({
            "backend": variant,
            "overlapped_ms": overlapped * 1e3,
            "landed_first_ms": landed * 1e3,
            "landed_first_over_overlapped": landed / overlapped,
        })
        if progress:
            progress.set_postfix_str(f"{variant}: {landed / overlapped:.3f}x")
    if progress:
        progress.close()
    return rows


def main(argv=None):
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="EP degree = processes")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048, help="hidden size of each expert, shared one included")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", nargs="+", choices=list(backend_variants()), metavar="VARIANT",
                        default=list(DEFAULT_VARIANTS),
                        help=f"backend variants, among: {', '.join(backend_variants())}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--campaign", type=Path, help="also write the rows as a new campaign file "
                                                      "(benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    command = bench_command("overlap", argv)
    rows = run_workers(args.nproc, _worker, args, device=workers_device(), deadline_s=DEADLINE_S, preload=[__name__])[0]
    for r in rows:
        print(f"{r['backend']:>10}  overlapped {r['overlapped_ms']:8.2f} ms  "
              f"landed first {r['landed_first_ms']:8.2f} ms  ratio {r['landed_first_over_overlapped']:.3f}")
    if args.campaign is not None:
        write_campaign(args.campaign, [command], rows)
    return 0
