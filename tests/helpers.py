"""Helpers shared by the tests: repository paths, the launcher, step logs."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def launcher_env(**overrides: str) -> dict[str, str]:
    """Environment for run_train.sh: this interpreter first on PATH, no color codes."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MASTER_PORT", None)
    env.update(overrides)
    return env


def run_launcher(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ./run_train.sh from the repository root, capturing stdout+stderr."""
    return subprocess.run(
        ["./run_train.sh", *args],
        cwd=REPO_ROOT,
        env=launcher_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def step_losses(output: str) -> dict[int, float]:
    """{step: loss} from the console step lines of one rank's log."""
    plain = ANSI_ESCAPE.sub("", output)
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(plain)}


def run_distributed(world_size: int, fn, *args, device: str = "cpu"):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    gloo on CPU, NCCL with one GPU per rank on CUDA. Returns the ranks' return
    values in rank order; a failure in any rank raises here with its traceback.
    """
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, tmp, device, fn, args), nprocs=world_size, join=True)
        import torch

        return [torch.load(f"{tmp}/result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _worker(rank, world_size, tmp, device, fn, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, f"{tmp}/result{rank}.pt")
        # no rank tears its process group down while a peer may still use it
        dist.barrier()
    finally:
        dist.destroy_process_group()
