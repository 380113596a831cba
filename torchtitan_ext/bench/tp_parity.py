"""Tensor parallelism does not change training: TP=2 against TP=1 losses for every backend variant a CPU runs.

    python -m torchtitan_ext.bench tp_parity [--work DIR] [--steps 5]

For each variant (``torchtitan_ext.ep.backends.CPU_VARIANTS``): ``./run_train.sh`` at NGPU=4 with
``tensor_parallel_degree`` 2 against NGPU=2 (the same global batch: dp_shard 2 in both), fp32, deterministic, both
from one seed checkpoint made at NGPU=1 (so that the initial weights do not depend on the mesh). Prints each run's
losses (its metrics.jsonl) and the largest relative difference per variant (goal: at most 1e-4); exits 1 if one is
over. ``--work`` is emptied first, and only if this tool made it (its marker file), or it is new or empty.
"""

import os
import shutil
import sys
from pathlib import Path

from torchtitan_ext.bench import ROOT
from torchtitan_ext.ep.backends import backend_variants, CPU_VARIANTS
from torchtitan_ext.records.metrics import logged_losses
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import run_and_exit
from torchtitan_ext.runtime.jobs import run_job

MARKER = ".tp_parity"
GOAL = 1e-4
"""Largest relative loss difference between TP=2 and TP=1 at any step."""
RUN_TIMEOUT_S = 1800
COMMON = ["--training.mixed_precision_param", "float32", "--debug.deterministic", "--training.seq_len", "64",
          "--training.local_batch_size", "2"]


def _train(ngpu: int, folder: Path, *args: str) -> None:
    run_job(["./run_train.sh", *COMMON, *args, "--job.dump_folder", str(folder)], cwd=ROOT,
            env={**os.environ, "NGPU": str(ngpu)}, timeout_s=RUN_TIMEOUT_S, log=folder.with_suffix(".log"))


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tp_parity"), help="work folder (emptied first)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    args = parser.parse_args(argv)
    work = args.work
    if work.exists() and any(work.iterdir()) and not (work / MARKER).is_file():
        print(f"error: work folder '{work}' is not empty and was not made by this tool: pass a new or empty folder",
              file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / MARKER).touch()
    steps = ["--training.steps", str(args.steps)]
    _train(1, work / "seed", *steps, "--parallelism.expert_parallel_degree", "1", "--checkpoint.enable",
           "--checkpoint.create_seed_checkpoint")
    over = []
    for variant in CPU_VARIANTS:
        losses = {}
        for ngpu, extra in ((2, []), (4, ["--parallelism.tensor_parallel_degree", "2"])):
            run = work / f"{variant}-{ngpu}"
            shutil.copytree(work / "seed" / "checkpoint" / "step-0", run / "checkpoint" / "step-0")
            _train(ngpu, run, *steps, *backend_variants()[variant], *extra, "--checkpoint.enable",
                   "--checkpoint.interval", "100")
            losses[ngpu] = [loss for _, loss in sorted(logged_losses(run).items())]
            print(f"{variant} NGPU={ngpu}: {' '.join(f'{loss:.6f}' for loss in losses[ngpu])}", flush=True)
        if len(losses[2]) != args.steps or len(losses[4]) != args.steps:
            print(f"error: {variant}: expected {args.steps} losses per run, got {losses}", file=sys.stderr)
            return 1
        worst = max(abs(a - b) / abs(a) for a, b in zip(losses[2], losses[4]))
        verdict = "within" if worst <= GOAL else "OVER"
        print(f"{variant}: largest relative difference over {args.steps} steps {worst:.2e} ({verdict} {GOAL:g})")
        if worst > GOAL:
            over.append(variant)
    return 1 if over else 0


if __name__ == "__main__":
    run_and_exit(main)
