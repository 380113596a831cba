"""Expert placement on this machine: record routing, place, resume with and without the placement.

    python -m torchtitan_ext.bench placement_check [--record-steps 40] [--save-every 5] [--first-step 21]
        [--steps 6] [--warmup 2] [--rounds 2]

1. Trains the DeepSeek-V3 debug model at NGPU=4, EP=4 for ``--record-steps``
   steps with routing statistics (a file every ``--save-every`` steps) and a
   full checkpoint at the end.
2. Runs ``python -m torchtitan_ext.placement`` on that dump from step
   ``--first-step`` on (fit on the first half of those files, evaluated on the
   second).
3. Resumes the checkpoint for ``--steps`` more steps without and with the
   placement, alternating (A B A B ...); from each run's metrics.jsonl, per step the
   slowest rank's step time and ``recv max/mean`` (rows received
   by the most loaded EP rank over the mean, worst layer), medians over the
   steps after ``--warmup``; and the placed runs' migration time from every rank's log.

Prints the placement report and both variants' numbers.
"""

import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job

MOVED = re.compile(r"\[rank(\d+)\]:.*Expert placement: moved .*: ([0-9.]+) MB sent by this rank in ([0-9.]+) s")
JOB = ["--parallelism.expert_parallel_degree", "4", "--metrics.disable_color_printing"]


def launch(*args: str, log_ranks: str = "0") -> str:
    result = run_job(["./run_train.sh", *JOB, *args], cwd=ROOT, env={**os.environ, "NGPU": "4", "LOG_RANK": log_ranks},
                     timeout_s=1800, check=False)
    if result.returncode != 0:
        sys.exit(f"error: run failed ({' '.join(args)}):\n{result.output[-3000:]}")
    return result.output


def median_after_warmup(dump_folder: Path, metric: str, warmup: int) -> float:
    """The median of ``metric`` over the steps of the run in ``dump_folder`` after its first ``warmup`` steps."""
    per_step = {row["step"]: row[metric] for row in read_metrics(dump_folder)}
    first = min(per_step)
    return statistics.median(value for step, value in per_step.items() if step >= first + warmup)


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--record-steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--first-step", type=int, default=21, help="the placement tool's --first-step")
    parser.add_argument("--steps", type=int, default=6, help="steps of each resumed run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each resumed run not timed")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        record = args.record_steps
        print(f"recording {record} steps at NGPU=4, EP=4 ...", flush=True)
        launch("--training.steps", str(record), "--routing_stats.enable", "--routing_stats.save_every",
               str(args.save_every), "--checkpoint.enable", "--checkpoint.interval", str(record),
               "--checkpoint.no_last_save_model_only", "--job.dump_folder", str(tmp / "record"))
        placement = tmp / "placement.json"
        report = run_job(
            [sys.executable, "-m", "torchtitan_ext.placement", "--routing-stats", str(tmp / "record/routing_stats"),
             "--job.config_file", "train_configs/debug_model.toml", *JOB[:2], "--world-size", "4",
             "--first-step", str(args.first_step), "-o", str(placement)],
            cwd=ROOT, timeout_s=600,
        ).output
        print(report)
        times = {"identity": [], "placed": []}
        received = {"identity": [], "placed": []}
        migration = []
        runs = [(r, v) for r in range(args.rounds) for v in times]
        for round_index, variant in tqdm(runs, desc="resumed runs", unit="run"):
            folder = tmp / f"{variant}{round_index}"
            shutil.copytree(tmp / f"record/checkpoint/step-{record}", folder / f"checkpoint/step-{record}")
            extra = ["--expert_placement.file", str(placement)] if variant == "placed" else []
            output = launch(
                "--training.steps", str(record + args.steps), "--checkpoint.enable", "--checkpoint.load_step",
                str(record), "--checkpoint.interval", str(10 * (record + args.steps)), "--job.dump_folder",
                str(folder), *extra, log_ranks="0,1,2,3",
            )
            times[variant].append(median_after_warmup(folder, "time_metrics/end_to_end_slowest_rank(s)", args.warmup))
            received[variant].append(median_after_warmup(folder, "ep/recv_rows_max_over_mean_worst", args.warmup))
            migration += [float(seconds) for _, _, seconds in MOVED.findall(output)]
    for variant, values in times.items():
        print(f"{variant}: slowest-rank step time, median per run: {', '.join(f'{v:.3f}' for v in values)} s; "
              f"median {statistics.median(values):.3f} s; recv max/mean (worst layer), median per run: "
              f"{', '.join(f'{v:.2f}' for v in received[variant])}")
    ratio = statistics.median(times["placed"]) / statistics.median(times["identity"])
    print(f"placed / identity: {ratio:.3f}")
    if migration:
        print(f"migration at resume: {min(migration):.3f}-{max(migration):.3f} s per rank")
    return 0
