"""What the benchmarks share: timing a function on the slowest of its ranks, the device's copy bandwidth, the
workers' devices, a progress bar on rank 0, and the options of a benchmark that times whole runs."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_ext.records.campaign import check_new_campaign_path

DEADLINE_S = 3600.0
"""Wall-clock limit of one run of workers: a sweep of large shapes on a CPU takes minutes, a hang still ends."""


def workers_device() -> str:
    """The device :func:`run_workers` runs the benchmarks' workers on: one GPU each on CUDA, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_device(rank: int) -> torch.device:
    """Worker ``rank``'s device, as :func:`run_workers` set it up."""
    return torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")


def time_once(fn, device) -> float:
    """Seconds ``fn`` takes on the slowest rank (all ranks start together)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)  # nccl: on the device
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


COPY_BYTES = 256 * 2**20
"""Size of the copy that measures the device's memory bandwidth: well past any cache."""


def copy_gbps(device, iters: int = 5) -> float:
    """Bytes read plus written per second by a copy of :data:`COPY_BYTES` on ``device``, the median of ``iters``;
    the slowest rank's."""
    source = torch.ones(COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), 1, iters, device)
    rate = torch.tensor([2 * COPY_BYTES / statistics.median(seconds) / 1e9], dtype=torch.float64, device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def timed(fn, warmup: int, iters: int, device) -> list[float]:
    """``fn`` run ``warmup`` times, then timed ``iters`` times by :func:`time_once`."""
    for _ in range(warmup):
        fn()
    return [time_once(fn, device) for _ in range(iters)]


def progress_bar(rank: int, enabled: bool, **tqdm_args):
    """Rank 0's tqdm bar, or None. It writes to stdout: the harness keeps each worker's stderr for its report."""
    if rank != 0 or not enabled:
        return None
    from tqdm import tqdm

    return tqdm(file=sys.stdout, **tqdm_args)


def add_timed_run_arguments(parser: argparse.ArgumentParser, rounds: int, alternated: str, overridden: str) -> None:
    """The options of a benchmark that times whole runs, alternating ``alternated``: rounds, steps and warm-up per
    run, where results go, the progress bar, and config overrides for ``overridden``."""
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternations of {alternated}")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--campaign", type=Path, help="also write the results as a new campaign file "
                                                      "(benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help=f"config overrides for {overridden} (after --)")


def parse_timed_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed; a run with no timed step, or a campaign file that cannot be written, is refused in one line
    before anything runs."""
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    return args

