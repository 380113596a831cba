"""Measure this machine as a one-level topology: gloo all-to-all bandwidth and latency, GEMM throughput.

``python -m torchtitan_ext.plan --calibrate [--nproc N] [--calibrate-output FILE]``
starts N gloo processes (as a CPU job of N ranks runs: one thread each) and
measures, all processes at once:

- GEMM throughput at the dtype a CPU job trains in here (runtime's choice);
- an all-to-all of a few bytes (the latency), and an all-to-all, an
  all-gather and a reduce-scatter of several MB per rank (their bandwidths:
  bytes a rank moves over the time above the latency: gloo's all-gather and
  reduce-scatter differ from its all-to-all, and FSDP uses them).

and writes a topology file (``overlap = false``: a gloo collective blocks its process).
"""

import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_ext.config.machine import cpu_bf16_support
from torchtitan_ext.runtime.collectives import all_gather_single, reduce_scatter_single
from torchtitan_ext.runtime.workers import run_workers

GEMM_SIZE = 512
GEMM_SECONDS = 2.0
LARGE_BYTES_PER_PEER = 4 * 2**20
REPEATS = 10


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(rank: int, world_size: int, dtype: torch.dtype) -> tuple | None:
    """Rank 0's (GEMM TFLOP/s, all-to-all latency in s, {collective: bytes/s}); None on the other ranks."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=dtype)
    a @ b
    dist.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < GEMM_SECONDS:
        a @ b
        count += 1
    tflops = 2 * GEMM_SIZE**3 * count / (time.perf_counter() - start) / 1e12
    small_in = torch.zeros(world_size * 2, dtype=torch.float32)
    small_out = torch.empty_like(small_in)
    latency = _median_seconds(lambda: dist.all_to_all_single(small_out, small_in), REPEATS * 3)
    large_in = torch.zeros(world_size * LARGE_BYTES_PER_PEER // 4, dtype=torch.float32)
    large_out = torch.empty_like(large_in)
    shard = torch.zeros(LARGE_BYTES_PER_PEER // 4, dtype=torch.float32)
    # FSDP's collectives: its all-gather of parameters, its reduce-scatter of gradients
    seconds = {
        "all_to_all": _median_seconds(lambda: dist.all_to_all_single(large_out, large_in), REPEATS),
        "all_gather": _median_seconds(lambda: all_gather_single(large_out, shard), REPEATS),
        "reduce_scatter": _median_seconds(lambda: reduce_scatter_single(shard, large_in), REPEATS),
    }
    if rank != 0:
        return None
    moved = LARGE_BYTES_PER_PEER * (world_size - 1)
    return tflops, latency, {name: moved / max(t - latency, 1e-9) for name, t in seconds.items()}


def calibrate(nproc: int, output: Path) -> str:
    """Measure with ``nproc`` processes, write the topology TOML to ``output``; its text."""
    dtype = torch.bfloat16 if cpu_bf16_support()[0] else torch.float32
    print(f"[calibrate] {nproc} gloo processes, one thread each: GEMM {GEMM_SIZE}^3 in {dtype} for {GEMM_SECONDS:g} s, "
          f"all-to-all of 8 bytes, all-to-all, all-gather and reduce-scatter of {LARGE_BYTES_PER_PEER // 2**20} MiB "
          f"per peer ({REPEATS} repeats)", flush=True)
    tflops, latency, bandwidth = run_workers(nproc, _measure, dtype, preload=[__name__])[0]
    text = f'''# Measured by `python -m torchtitan_ext.plan --calibrate --nproc {nproc}` on {date.today()}.
name = "this machine ({nproc} gloo processes)"
# {dtype} GEMM of {GEMM_SIZE}^3 per process, all processes at once
compute_tflops = {tflops:.6f}
# a gloo collective blocks its process: nothing overlaps
overlap = false

[[levels]]
name = "gloo on this machine"
# {LARGE_BYTES_PER_PEER // 2**20} MiB per peer, bytes a rank sends (receives, for the all-gather) over the time
# above the latency: all-to-all, then FSDP's all-gather and reduce-scatter
bandwidth_GBps = {bandwidth["all_to_all"] / 1e9:.6f}
all_gather_bandwidth_GBps = {bandwidth["all_gather"] / 1e9:.6f}
reduce_scatter_bandwidth_GBps = {bandwidth["reduce_scatter"] / 1e9:.6f}
# all-to-all of 8 bytes per peer
latency_us = {latency * 1e6:.3f}
'''
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(f"[calibrate] GEMM {tflops * 1e3:.2f} GFLOP/s per process, all-to-all latency {latency * 1e6:.0f} us; "
          f"bandwidth per rank: all-to-all {bandwidth['all_to_all'] / 1e9:.3f} GB/s, all-gather "
          f"{bandwidth['all_gather'] / 1e9:.3f} GB/s, reduce-scatter {bandwidth['reduce_scatter'] / 1e9:.3f} GB/s; "
          f"wrote {output}", flush=True)
    return text
