"""Benchmark EP dispatch + combine against the bare collectives they issue.

    python scripts/bench_ep.py --nproc 2 --tokens 2048 8192 --hidden 1024 --experts 8 --top-k 2

Launches ``--nproc`` processes (gloo on CPU, NCCL with one GPU each on CUDA),
in EP groups of ``--ep-degree`` (default: all of them). ``--ep-degree 1``
times each backend's local work alone: every process is its own EP group, so
the backend's permutations and kernels run as at EP = ``--nproc``, sharing the
machine with the same number of processes, with no traffic between them
(the layout check adds it to the modelled communication).
For every shape and backend it times one dispatch + combine forward and
backward (the experts are the identity, so only EP costs are timed): warm-up
iterations first, then ``--iters`` timed ones; an iteration's time is the
slowest rank's. In the same run it records the collectives the backend issued
in one iteration (their sizes and split sizes) and times exactly those
collectives alone (all-to-alls as ``all_to_all_single``, all-gathers as
``all_gather_single``), on buffers prepared outside the timing. Reported:
min / median / max, the ratio of medians (backend / bare collectives), the
bytes one rank sends per iteration and the effective GB/s.

Backends: ``nccl``, ``deepep`` (V2 API) and ``deepep_legacy`` (v1 API) and
``hybridep`` (reference kernels on CPU), ``hybridep_nb`` (non-blocking,
capacity factor 1.0), ``upstream`` (torchtitan 0.2.2's own ExpertParallel,
for scale), and ``deepep_lib`` / ``deepep_legacy_lib`` / ``hybridep_lib`` (the
real deep_ep kernels, when importable on CUDA).

Results go to ``--json`` and, as a markdown table with the command line and the
machine, are appended to ``--markdown`` where one is given.
"""

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan_ext.planning.collective_recorder import CollectiveRecorder  # noqa: E402


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    experts: int
    top_k: int
    ep: int

    def label(self) -> str:
        return f"T={self.tokens} H={self.hidden} E={self.experts} K={self.top_k} EP={self.ep}"


def job_args(backend: str) -> list[str]:
    """The job-config overrides that select ``backend`` (a label of --backends) as this script runs it."""
    name = backend.partition("_")[0]
    args = ["--parallelism.expert_parallel_comm_backend", name]
    if name != "nccl":
        args += [f"--{name}.implementation", "deep_ep" if backend.endswith("_lib") else "reference"]
    if name == "deepep":  # named, not "auto": the row says which API it timed
        args += ["--deepep.api", "legacy" if backend.startswith("deepep_legacy") else "elastic"]
    if backend == "hybridep_nb":
        args += ["--hybridep.non_blocking_capacity_factor", "1.0"]
    return args


def _make_style(backend: str, shape: Shape):
    from torchtitan_ext.config import parse as parse_job_config
    from torchtitan_ext.ep import BACKENDS, MoEShape

    moe = MoEShape(shape.hidden, shape.experts, shape.top_k, shape.tokens)
    return BACKENDS[backend.partition("_")[0]].layer_factory(parse_job_config(job_args(backend)), moe)(
        score_before_experts=False)


def _iteration_fn(backend, shape, mesh, device, dtype, backward: bool = True):
    """A closure running one dispatch + combine forward (and backward); identity experts."""
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    x = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    scores = torch.rand(shape.tokens, shape.top_k, generator=generator).to(device)
    ids = torch.stack([
        torch.randperm(shape.experts, generator=generator)[: shape.top_k] for _ in range(shape.tokens)
    ]).to(device)
    grad = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    group = mesh.get_group()
    if backend == "upstream":
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
    style = _make_style(backend, shape)

    def step():
        inp = x.detach().requires_grad_()
        score = scores.detach().requires_grad_()
        rows, _ = style.dispatch(inp, score, ids, shape.experts, group)
        out = style.combine(rows, group)
        if backward:
            out.backward(grad)

    return step


def time_once(fn, device) -> float:
    """Seconds ``fn`` takes on the slowest rank (all ranks start together)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _time(fn, warmup: int, iters: int, device) -> list[float]:
    for _ in range(warmup):
        fn()
    return [time_once(fn, device) for _ in range(iters)]


def init_rank(rank: int, world_size: int, rendezvous: str) -> torch.device:
    """This process's device and process group (NCCL with one GPU per rank on CUDA, else gloo)."""
    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.ERROR)  # torchtitan's config warnings, once per case
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    return device


def run_ranks(worker, nproc: int, args) -> list:
    """Spawn ``worker(rank, nproc, rendezvous, args, result_file)`` on ``nproc`` processes;
    returns the rows rank 0 wrote as JSON to ``result_file``."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rows.json"
        mp.spawn(worker, args=(nproc, f"{tmp}/rendezvous", args, str(result_file)), nprocs=nproc)
        return json.loads(result_file.read_text())


def _worker(rank, world_size, rendezvous, args, result_file):
    device = init_rank(rank, world_size, rendezvous)
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext import runtime

    if runtime.configure() == "cpu":
        runtime.keep_freed_memory_in_heap()  # see docs/benchmarks.md: page faults would dominate the copies
    ep = args.ep_degree or world_size
    mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("replica", "ep"))["ep"]
    dtype = getattr(torch, args.dtype)
    rows = []
    cases = [(tokens, backend) for tokens in args.tokens for backend in args.backends]
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(cases), desc="bench_ep", unit="case")
    for tokens, backend in cases:
        shape = Shape(tokens, args.hidden, args.experts, args.top_k, ep)
        step = _iteration_fn(backend, shape, mesh, device, dtype, backward=not args.forward_only)
        step()
        with CollectiveRecorder() as recorder:
            step()
        bare_plan, sent = recorder.replay_plan()
        times = _time(step, args.warmup, args.iters, device)
        bare = _time(lambda plan=bare_plan: [call() for call in plan], args.warmup, args.iters, device)
        sent_total = torch.tensor([sent], dtype=torch.float64)
        dist.all_reduce(sent_total, op=dist.ReduceOp.MAX)
        median, bare_median = statistics.median(times), statistics.median(bare)
        rows.append({
            "backend": backend,
            **asdict(shape),
            "processes": world_size,
            "min_ms": min(times) * 1e3, "median_ms": median * 1e3, "max_ms": max(times) * 1e3,
            "bare_min_ms": min(bare) * 1e3, "bare_median_ms": bare_median * 1e3, "bare_max_ms": max(bare) * 1e3,
            "ratio": median / bare_median,
            "overhead_us": (median - bare_median) * 1e6,
            "bytes_sent_per_rank": int(sent_total),
            "gbps": float(sent_total) / median / 1e9,
            "collectives": len(bare_plan),
            # what plan --calibrate-from reads: the EP backend and its settings, the rows' dtype, the passes timed
            "comm_backend": None if backend == "upstream" else backend.partition("_")[0],
            "job_args": [] if backend == "upstream" else job_args(backend),
            "dtype": args.dtype, "forward_only": args.forward_only,
        })
        del step, bare_plan, recorder
        gc.collect()
        runtime.release_freed_memory()  # the next case has other shapes
        if progress:
            progress.update(1)
            progress.set_postfix_str(f"{backend} T={tokens}: {median / bare_median:.2f}x")
    if progress:
        progress.close()
    if rank == 0:
        Path(result_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    # the vector unit (AVX2, AVX512, ...) bounds the CPU's GEMM speed, which the times depend on
    vector_unit = torch.backends.cpu.get_cpu_capability()
    return (f"{platform.processor() or platform.machine()} CPU ({vector_unit}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, gloo")


def _label(row) -> str:
    label = Shape(row["tokens"], row["hidden"], row["experts"], row["top_k"], row["ep"]).label()
    return label if row["processes"] == row["ep"] else f"{label} x {row['processes'] // row['ep']} groups"


def markdown(rows, command: str, forward_only: bool) -> str:
    lines = [
        f"### bench_ep ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine()}. Per iteration: one dispatch + combine, "
        f"{'forward only' if forward_only else 'forward and backward'}; "
        "time of the slowest rank; bare = the same collectives alone.",
        "",
        "| backend | shape | min ms | median ms | max ms | bare median ms | ratio | overhead us | MB sent/rank | GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = _label(r)
        lines.append(
            f"| {r['backend']} | {shape} | {r['min_ms']:.2f} | {r['median_ms']:.2f} | {r['max_ms']:.2f} | "
            f"{r['bare_median_ms']:.2f} | {r['ratio']:.2f} | {r['overhead_us']:.0f} | "
            f"{r['bytes_sent_per_rank'] / 1e6:.1f} | {r['gbps']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes")
    parser.add_argument("--ep-degree", type=int,
                        help="processes per EP group, a divisor of --nproc (default: --nproc; 1: local work alone)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", nargs="+", default=["nccl", "deepep", "hybridep", "hybridep_nb", "upstream"])
    parser.add_argument("--forward-only", action="store_true",
                        help="time dispatch + combine forward only (no backward)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="append the table, with the command and the machine, to this markdown file (e.g. docs/benchmarks.md)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.ep_degree is not None and (args.ep_degree < 1 or args.nproc % args.ep_degree):
        parser.error(f"--ep-degree {args.ep_degree}: use a divisor of --nproc {args.nproc}")
    command = "python scripts/bench_ep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run_ranks(_worker, args.nproc, args)
    for r in rows:
        print(f"{r['backend']:>12}  {_label(r)}  "
              f"median {r['median_ms']:8.2f} ms  bare {r['bare_median_ms']:8.2f} ms  ratio {r['ratio']:.2f}  "
              f"{r['gbps']:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": machine(), "rows": rows}, indent=2))
    if args.markdown is not None:
        with open(args.markdown, "a") as f:
            f.write("\n" + markdown(rows, command, args.forward_only))
        print(f"table appended to {args.markdown}")
    return rows


if __name__ == "__main__":
    main()
