"""An A/B of the real job: the same training run under two EP backends, interleaved, written as a comparison the
layout advisor can fit on or be checked against.

    NGPU=N python -m torchtitan_ext.bench ab --backends nccl deepep --topology T --comparison FILE
        [--steps 20] [--warmup 3] [--rounds 2] [--role fit|held_out] [--id ID] [-- job overrides]

Runs ``./run_train.sh`` (the one launcher; ``NGPU`` processes, else the config's degrees; the job of
``--job.config_file``, else ``CONFIG_FILE``, else the default job) with the job's overrides, once per backend per
round, A B then B A, and reads each run's ``metrics.jsonl``: the slowest rank's step time after
the warm-up steps. Each backend's figure is the median over every round's steps, in seconds per step. The row goes
to ``--comparison`` in the comparisons format (``docs/published_comparisons.toml``'s header gives the fields), with
its job priced on ``--topology``, and is read back through the same checks ``plan`` applies. Then
``python -m torchtitan_ext.plan --fit --comparisons FILE --fit-output MY_FIT`` fits on rows of role ``fit``, and
``plan --validate --comparisons FILE --fit-from MY_FIT --error-output MY_ERROR`` measures the advisor's error on
the rows of role ``held_out``: the advice then decides with ``--fit-from MY_FIT --error-from MY_ERROR``.
"""

import argparse
import os
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

import tomli_w
from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.config import ConfigError, job_world_size, load_job_config, parse, with_config_file
from torchtitan_ext.config.machine import PRECISION_LOG
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.planning.published_comparisons import load_comparisons, MXFP8_CONVERTERS, ROLES
from torchtitan_ext.records.campaign import bench_command, describe_machine
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import run_and_exit
from torchtitan_ext.runtime.jobs import run_job

RUN_TIMEOUT_S = 3600
STEP_TIME = "time_metrics/end_to_end_slowest_rank(s)"
PRECISIONS = {"bfloat16": "bf16", "float32": "fp32"}
"""training.mixed_precision_param -> the comparisons file's precision."""


def _parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--backends", nargs=2, required=True, choices=list(BACKENDS), metavar="BACKEND",
                        help=f"the two backends compared, among: {', '.join(BACKENDS)}")
    parser.add_argument("--topology", required=True, help="the topology the advisor prices the job on (a shipped "
                                                          "name or a file: what this cluster is)")
    parser.add_argument("--comparison", type=Path, required=True, help="the comparisons TOML file to write (new)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run not counted (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each backend, alternating (default 2)")
    parser.add_argument("--role", choices=ROLES, default="fit",
                        help="fit: the advisor may be fitted on it; held_out: it checks the advisor (default fit)")
    parser.add_argument("--id", help="the row's id (default: ab-DATE-BACKEND-BACKEND)")
    parser.add_argument("overrides", nargs="*", help="the job's config overrides, as run_train.sh takes them (after --)")
    return parser


def _checked(parser: argparse.ArgumentParser, args, world_size: int, device_type: str | None):
    """The job config, every option checked first, one line each, as the runs' device checks it."""
    if args.backends[0] == args.backends[1]:
        parser.error(f"--backends {' '.join(args.backends)}: compare two different backends")
    if args.steps <= args.warmup or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}: use at least one round and "
                     "more steps than warm-up steps")
    if args.comparison.exists() or not args.comparison.parent.is_dir():
        raise ConfigError(f"--comparison {args.comparison}: give a new file in an existing folder")
    for backend in args.backends:  # each run's config, as the launcher will check it
        load_job_config([*args.overrides, "--parallelism.expert_parallel_comm_backend", backend],
                        device_type=device_type, world_size=world_size)
    job_config = load_job_config(args.overrides, device_type=device_type, world_size=world_size)
    if job_config.training.mixed_precision_param not in PRECISIONS:
        raise ConfigError(f"training.mixed_precision_param = {job_config.training.mixed_precision_param!r}: the "
                          f"comparisons file states {', '.join(PRECISIONS)}: use one of them")
    return job_config


def timed_run(backend: str, args, world_size: int, dump_folder: str) -> tuple[list[float], str | None]:
    """(the slowest rank's step times after the warm-up, the parameter dtype the runtime chose or None) of one
    ./run_train.sh run under ``backend``."""
    env = {**os.environ, "NGPU": str(world_size), "PYTHONUNBUFFERED": "1"}
    env.pop("CONFIG_FILE", None)  # the overrides name the job's config
    result = run_job(
        ["./run_train.sh", *args.overrides, "--parallelism.expert_parallel_comm_backend", backend,
         "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--job.dump_folder", dump_folder],
        cwd=ROOT, env=env, timeout_s=RUN_TIMEOUT_S, check=False,
    )
    if result.returncode != 0:
        sys.exit(f"error: the {backend} run exited {result.returncode}:\n{result.output[-3000:]}")
    times = {row["step"]: row[STEP_TIME] for row in read_metrics(dump_folder) if STEP_TIME in row}
    if sorted(times) != list(range(1, args.steps + 1)):
        sys.exit(f"error: the {backend} run logged steps {sorted(times)}, not 1..{args.steps}")
    chosen = PRECISION_LOG.search(result.output)
    return [seconds for step, seconds in times.items() if step > args.warmup], chosen and chosen.group(1)


def comparison_row(args, job_config, world_size: int, medians: dict[str, float], dtype: str, command: str,
                   device: str) -> dict:
    """The comparisons file's row for the A/B: the measured medians, and the job as the advisor prices it."""
    converters = set(job_config.model.converters) & set(MXFP8_CONVERTERS)
    precision = "mxfp8" if converters else PRECISIONS[dtype]
    config = next(args.overrides[i + 1] for i, value in enumerate(args.overrides[:-1]) if value == "--job.config_file")
    overrides = [value for i, value in enumerate(args.overrides)
                 if value != "--job.config_file" and (i == 0 or args.overrides[i - 1] != "--job.config_file")]
    return {
        "id": args.id or f"ab-{date.today().isoformat()}-{'-'.join(args.backends)}",
        "url": "local",
        "source": command,
        "date": date.today().isoformat(),
        "hardware": describe_machine(),
        "model": f"{job_config.model.name} {job_config.model.flavor}",
        "parallelism": f"EP={job_config.parallelism.expert_parallel_degree} on {world_size} ranks",
        "batch": f"local_batch_size {job_config.training.local_batch_size}",
        "seq_len": job_config.training.seq_len,
        "precision": precision,
        "activation_checkpointing": job_config.activation_checkpoint.mode,
        "compared": f"the same job under each backend, {args.rounds} alternating run(s) each, {args.steps} steps, "
                    f"the median of the slowest rank's step times after {args.warmup} warm-up steps",
        "metric": "s/step",
        "role": args.role,
        "measured": medians,
        "priced": {"config": config, "overrides": [*overrides, "--training.mixed_precision_param", dtype],
                   "topology": args.topology, "world_size": world_size,
                   "ep": job_config.parallelism.expert_parallel_degree, "device": device},
    }


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.overrides = with_config_file(args.overrides)  # as run_train.sh reads it
    given = os.environ.get("NGPU")
    if given is not None and not given.isdigit():
        raise ConfigError(f"NGPU={given!r}: set it to the processes per run, a whole number >= 1")
    world_size = job_world_size(parse(args.overrides), int(given) if given else None)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the launcher places the runs
    job_config = _checked(parser, args, world_size, None if device == "cuda" else device)
    times = {backend: [] for backend in args.backends}
    dtypes = set()
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=args.rounds * 2, desc="bench ab", unit="run") as progress:
        for round_index in range(args.rounds):
            # A B, then B A: neither backend always runs first
            for backend in args.backends if round_index % 2 == 0 else args.backends[::-1]:
                steps, chosen = timed_run(backend, args, world_size, f"{tmp}/{backend}{round_index}")
                times[backend] += steps
                dtypes.add(chosen or job_config.training.mixed_precision_param)
                progress.update()
    if len(dtypes) > 1:
        raise ConfigError(f"the runs trained in {', '.join(sorted(dtypes))}: fix training.mixed_precision_param")
    medians = {backend: statistics.median(values) for backend, values in times.items()}
    for backend, median in medians.items():
        print(f"{backend}: {median:.4f} s per step, median of {len(times[backend])} steps")
    first, second = args.backends
    print(f"{second} over {first}: {medians[second] / medians[first]:.3f}x the step time")
    row = comparison_row(args, job_config, world_size, medians, dtypes.pop(), bench_command("ab", argv), device)
    partial = args.comparison.with_name(f".{args.comparison.name}.partial")
    partial.write_text(tomli_w.dumps({"comparison": [row]}), encoding="utf-8")
    try:
        load_comparisons(partial)  # what plan --fit and --validate read, through the same checks
    except ConfigError:
        partial.unlink()
        raise
    partial.replace(args.comparison)  # whole, once it reads back
    print(f"Wrote the comparison '{row['id']}' (role {args.role}) to {args.comparison}")
    return 0


if __name__ == "__main__":
    run_and_exit(main)
