"""One EP dispatch + combine per backend, timed against the bare collectives it issues.

    python -m torchtitan_ext.bench ep --nproc 2 --tokens 2048 8192 --hidden 1024 --experts 8 --top-k 2
        [--ep-degree N] [--backends BACKEND ...] [--dtype bfloat16] [--forward-only] [--json F] [--campaign F]

Runs ``--nproc`` processes (gloo on CPU, NCCL with one GPU each on CUDA) in EP groups of ``--ep-degree`` (default:
all of them; 1: each backend's local work alone, every process its own group, no traffic). For every shape and
backend: one dispatch + combine, forward and backward (or ``--forward-only``), the experts as the identity,
``--warmup`` then ``--iters`` timed iterations, each the slowest rank's time; then the collectives one iteration
issued, timed alone on prepared buffers ("bare"). Reported: min / median / max, the ratio of medians (backend /
bare), the bytes one rank sends per iteration and the effective GB/s, and the bytes its operators outside the
collectives and library kernels read and write (the permutes, gathers and sums) over the median, against the
device's copy bandwidth measured in the same run (at ``--ep-degree 1`` on a GPU: the local passes against HBM).

``--backends``: the backend variants (``torchtitan_ext.ep.backends.backend_variants``) on the reference kernels;
the same with ``_lib`` on the real deep_ep kernels (CUDA, deep_ep importable); ``upstream``, torchtitan 0.2.2's own
ExpertParallel. The rows (``EPBenchRow``) go to ``--json``, which ``python -m torchtitan_ext.plan --calibrate-from``
reads; ``--campaign`` writes them as a measurement campaign (:mod:`torchtitan_ext.records.campaign`).
"""

import gc
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_ext.ep.backends import BACKENDS, MATRIX_VARIANTS, variant_backend
from torchtitan_ext.measuring.collective_recorder import CollectiveRecorder
from torchtitan_ext.measuring.ep_variants import job_args, labels, LIBRARY, UPSTREAM
from torchtitan_ext.measuring.timing import (
    copy_gbps, DEADLINE_S, progress_bar, rank_device, timed, workers_device,
)
from torchtitan_ext.planning.local_traffic import LocalTrafficCounter
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, describe_machine, write_campaign
from torchtitan_ext.records.ep_bench import EPBenchRow
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers

@dataclass(frozen=True)
class Shape:
    """One timed case: tokens per rank, hidden size, experts, experts per token, ranks per EP group."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    ep: int

    def label(self) -> str:
        return f"T={self.tokens} H={self.hidden} E={self.experts} K={self.top_k} EP={self.ep}"


def bench_row(label: str, shape: Shape, processes: int, times: list[float], bare: list[float], bytes_sent: int,
              collectives: int, dtype: str, forward_only: bool, local_bytes: int, copy_gbps: float) -> EPBenchRow:
    """The row of ``label`` at ``shape``: ``times`` and ``bare`` are the timed iterations' seconds (the slowest
    rank's) of the backend and of its collectives alone; ``bytes_sent`` and ``local_bytes`` the busiest rank's
    per iteration; ``copy_gbps`` the device's copy bandwidth."""
    median, bare_median = statistics.median(times), statistics.median(bare)
    upstream = label == UPSTREAM
    return EPBenchRow(
        backend=label, **asdict(shape), processes=processes,
        min_ms=min(times) * 1e3, median_ms=median * 1e3, max_ms=max(times) * 1e3,
        bare_min_ms=min(bare) * 1e3, bare_median_ms=bare_median * 1e3, bare_max_ms=max(bare) * 1e3,
        ratio=median / bare_median, overhead_us=(median - bare_median) * 1e6,
        bytes_sent_per_rank=bytes_sent, gbps=bytes_sent / median / 1e9, collectives=collectives,
        comm_backend=None if upstream else variant_backend(label.removesuffix(LIBRARY)),
        job_args=[] if upstream else job_args(label), dtype=dtype, forward_only=forward_only,
        local_bytes_per_rank=local_bytes, copy_gbps=copy_gbps,
    )


def _make_style(label: str, shape: Shape):
    from torchtitan_ext.config import parse as parse_job_config
    from torchtitan_ext.ep import MoEShape

    moe = MoEShape(shape.hidden, shape.experts, shape.top_k, shape.tokens)
    backend = BACKENDS[variant_backend(label.removesuffix(LIBRARY))]
    return backend.layer_factory(parse_job_config(job_args(label)), moe)(score_before_experts=False)


def _iteration_fn(label, shape, mesh, device, dtype, backward: bool = True):
    """A closure running one dispatch + combine forward (and backward); identity experts."""
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    x = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    scores = torch.rand(shape.tokens, shape.top_k, generator=generator).to(device)
    ids = torch.stack([
        torch.randperm(shape.experts, generator=generator)[: shape.top_k] for _ in range(shape.tokens)
    ]).to(device)
    grad = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    group = mesh.get_group()
    if label == UPSTREAM:
        from torchtitan.distributed.expert_parallel import ExpertParallel

        style = ExpertParallel()

        def step():
            # torchtitan 0.2.2's MoE.forward around its ExpertParallel, experts as the identity
            inp = x.detach().requires_grad_()
            score = scores.detach().requires_grad_()
            counts = torch.histc(ids.view(-1), bins=shape.experts, min=0, max=shape.experts)
            order = torch.argsort(ids.view(-1), stable=True)
            routed_input = inp[order // shape.top_k]
            routed, _ = style._token_dispatch(None, (routed_input, counts), mesh)
            routed_output = style._token_combine(None, routed, mesh)
            unsorted = torch.zeros((shape.tokens * shape.top_k, shape.hidden), dtype=routed_output.dtype, device=device)
            unsorted[order] = routed_output
            out = torch.bmm(score.reshape(-1, 1, shape.top_k), unsorted.float().reshape(-1, shape.top_k, shape.hidden))
            if backward:
                out.to(dtype).squeeze(1).backward(grad)

        return step
    style = _make_style(label, shape)

    def step():
        inp = x.detach().requires_grad_()
        score = scores.detach().requires_grad_()
        rows, _ = style.dispatch(inp, score, ids, shape.experts, group)
        out = style.combine(rows, group)
        if backward:
            out.backward(grad)

    return step


def _worker(rank: int, world_size: int, args) -> list[EPBenchRow]:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext import runtime

    device = rank_device(rank)
    if runtime.configure() == "cpu":
        runtime.keep_freed_memory_in_heap()  # page faults would dominate the copies: docs/benchmarks.md
    ep = args.ep_degree or world_size
    mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("replica", "ep"))["ep"]
    dtype = getattr(torch, args.dtype)
    memory_gbps = copy_gbps(device)
    rows = []
    cases = [(tokens, label) for tokens in args.tokens for label in args.backends]
    progress = progress_bar(rank, not args.no_progress, total=len(cases), desc="bench ep", unit="case")
    for tokens, label in cases:
        shape = Shape(tokens, args.hidden, args.experts, args.top_k, ep)
        step = _iteration_fn(label, shape, mesh, device, dtype, backward=not args.forward_only)
        step()
        with CollectiveRecorder() as recorder:
            step()
        bare_plan, sent = recorder.replay_plan()
        with LocalTrafficCounter() as local:
            step()
        times = timed(step, args.warmup, args.iters, device)
        bare = timed(lambda plan=bare_plan: [call() for call in plan], args.warmup, args.iters, device)
        busiest = torch.tensor([sent, local.bytes], dtype=torch.float64, device=device)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        row = bench_row(label, shape, world_size, times, bare, int(busiest[0]), len(bare_plan), args.dtype,
                        args.forward_only, int(busiest[1]), memory_gbps)
        rows.append(row)
        del step, bare_plan, recorder
        gc.collect()
        runtime.release_freed_memory()  # the next case has other shapes
        if progress:
            progress.update(1)
            progress.set_postfix_str(f"{label} T={tokens}: {row.ratio:.2f}x")
    if progress:
        progress.close()
    return rows


def shape_label(row: EPBenchRow) -> str:
    label = Shape(row.tokens, row.hidden, row.experts, row.top_k, row.ep).label()
    return label if row.processes == row.ep else f"{label} x {row.processes // row.ep} groups"


def summary_line(row: EPBenchRow, backend_width: int) -> str:
    return (f"{row.backend:>{backend_width}}  {shape_label(row)}  median {row.median_ms:8.2f} ms  "
            f"bare {row.bare_median_ms:8.2f} ms  ratio {row.ratio:.2f}  {row.gbps:.2f} GB/s sent  "
            f"local {row.local_gbps:.1f} GB/s ({row.local_gbps / row.copy_gbps:.0%} of the copy's "
            f"{row.copy_gbps:.1f})")


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="processes")
    parser.add_argument("--ep-degree", type=int,
                        help="processes per EP group, a divisor of --nproc (default: --nproc; 1: local work alone)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", nargs="+", choices=labels(), metavar="BACKEND",
                        default=[*MATRIX_VARIANTS, UPSTREAM],
                        help=f"what to time, among: {', '.join(labels())} (default: %(default)s)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time dispatch + combine forward only (no backward)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--campaign", type=Path, help="also write the rows as a new campaign file "
                                                      "(benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.ep_degree is not None and (args.ep_degree < 1 or args.nproc % args.ep_degree):
        parser.error(f"--ep-degree {args.ep_degree}: use a divisor of --nproc {args.nproc}")
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    command = bench_command("ep", argv)
    rows = run_workers(args.nproc, _worker, args, device=workers_device(), deadline_s=DEADLINE_S,
                       preload=[__name__])[0]
    width = max(len(r.backend) for r in rows)
    for r in rows:
        print(summary_line(r, width))
    if args.json:
        document = {"command": command, "machine": describe_machine(), "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(document, indent=2))
    if args.campaign is not None:
        write_campaign(args.campaign, [command], [asdict(r) for r in rows])
    return 0
