"""The replication pair: the default job trained twice from one seed, without replicas and with, step by step.

    python -m torchtitan_ext.bench replication_pair [--steps 12] [--dtypes float32,float64] [--campaign FILE]
        [-- job overrides]

For each dtype, trains the default job (``train_configs/debug_model.toml``: EP = 2 in two gloo processes,
deterministic, seed 5) without replica slots and with 2 slots re-chosen every step, each in fresh processes, and
prints every step's loss and gradient norm in both arms and how far they part (relative difference). Replicas
change only the order of floating-point sums (a replicated expert's gradient is summed from two ranks), so in
exact arithmetic the arms are equal; the pair says how far rounding alone takes them apart, and the float64 pair
whether that gap collapses when the rounding is 2**29 times finer.

float64 keeps the parameters, gradients, their reductions and the optimizer in fp64 (the seed then draws other
initial weights than in fp32, so the two dtypes' pairs are two different runs): torchtitan 0.2.2's precision options (``training.dtype``,
``mixed_precision_param`` and ``mixed_precision_reduce``) take bfloat16 or float32 only, so the worker processes
add float64 to torchtitan's ``TORCH_DTYPE_MAP`` and set those options after the config is checked. The model's
own casts to fp32 stay (DeepSeek-V3's rotary embedding, its router's scores and the loss), so the logged loss is an
fp32 value; the gradient norm is computed in fp64.
"""

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.config import load_job_config
from torchtitan_ext.data import prepare_embedded_assets
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers
from torchtitan_ext.training import prepare
from torchtitan_ext.training.trainer import Trainer

JOB = ["--job.config_file", "train_configs/debug_model.toml", "--debug.seed", "5", "--debug.deterministic",
       "--metrics.log_freq", "1"]
ARMS = {"without replicas": [],
        "2 slots": ["--expert_replication.slots_per_rank", "2", "--expert_replication.adapt_every", "1"]}
DTYPES = ("float32", "float64")
LOSS = "loss_metrics/global_avg_loss"


def train_arm(rank: int, world_size: int, args: list[str], dtype: str) -> None:
    """One arm on this rank, its parameters and gradients in ``dtype`` (the module docstring on float64)."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(ROOT)
    prepare()
    job_config = load_job_config([*args, "--training.mixed_precision_param", "float32"], "cpu", world_size)
    if dtype == "float64":
        TORCH_DTYPE_MAP["float64"] = torch.float64
        training = job_config.training
        training.dtype = training.mixed_precision_param = training.mixed_precision_reduce = "float64"
    prepare_embedded_assets(job_config)
    trainer = Trainer(job_config)
    try:
        trainer.train()
    finally:
        trainer.close()


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), math.ulp(1.0))


def rows_of(dtype: str, metrics: dict[str, list[dict]]) -> list[dict]:
    """One row per step: both arms' loss and gradient norm and their relative differences."""
    without, replicated = (metrics[arm] for arm in ARMS)
    return [{"dtype": dtype, "step": a["step"], "loss_without": a[LOSS], "loss_replicas": b[LOSS],
             "grad_norm_without": a["grad_norm"], "grad_norm_replicas": b["grad_norm"],
             "loss_rel_diff": relative(a[LOSS], b[LOSS]),
             "grad_norm_rel_diff": relative(a["grad_norm"], b["grad_norm"])}
            for a, b in zip(without, replicated, strict=True)]


def _parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="training steps per arm")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--campaign", type=Path, help="write the rows to this new campaign file")
    parser.add_argument("extra", nargs="*", help="job overrides, after --")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if args.steps < 2 or not dtypes or any(dtype not in DTYPES for dtype in dtypes):
        parser.error(f"--steps {args.steps} --dtypes {args.dtypes}: use at least 2 steps and dtypes of "
                     f"{', '.join(DTYPES)}, comma separated")
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(dtypes) * len(ARMS), desc="bench_replication_pair",
                                                     unit="run") as progress:
        for dtype in dtypes:
            metrics = {}
            for arm, arm_args in ARMS.items():
                folder = f"{tmp}/{dtype}-{len(arm_args)}"
                job = [*JOB, "--training.steps", str(args.steps), *arm_args, *args.extra, "--job.dump_folder", folder]
                run_workers(2, train_arm, job, dtype, deadline_s=3600.0, preload=["torchtitan_ext.training.trainer"])
                metrics[arm] = read_metrics(folder)
                progress.update()
            rows += rows_of(dtype, metrics)
    print("| dtype | step | loss without / with replicas | rel. diff | grad norm without / with | rel. diff |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['dtype']} | {row['step']} | {row['loss_without']:.8g} / {row['loss_replicas']:.8g} | "
              f"{row['loss_rel_diff']:.2e} | {row['grad_norm_without']:.10g} / {row['grad_norm_replicas']:.10g} | "
              f"{row['grad_norm_rel_diff']:.2e} |")
    if args.campaign is not None:
        write_campaign(args.campaign, [bench_command("replication_pair", argv)], rows)
    return 0
