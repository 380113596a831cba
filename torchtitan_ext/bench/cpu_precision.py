"""The default job's step time on a CPU without bf16 matrix units, against an explicit fp32 job.

    python -m torchtitan_ext.bench cpu_precision --rounds 2 --steps 8 --warmup 2 [--with-bf16] [--json FILE]
        [--campaign FILE] [-- job overrides]

Runs ``./run_train.sh`` (the quick start's command, 2 processes) with
``TORCHTITAN_EXT_CPU_BF16=emulated`` (any CPU behaves as one without
AVX512_BF16/AMX), alternating in one session:

- ``default``: the job as shipped; the runtime must choose float32 parameters;
- ``float32``: the same with ``--training.mixed_precision_param float32``;
- ``bfloat16`` (``--with-bf16``): bf16 forced: what emulated bf16 GEMMs cost on a CPU without bf16 units.

Each run trains ``--steps`` steps; the first ``--warmup`` step times of each run
(the job's metrics.jsonl) are dropped. Reports medians and the ratio default / float32 (goal <= 1.2), and
writes the step times to a new campaign file with ``--campaign``.
"""

import json
import os
import statistics
import tempfile

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.config.machine import PRECISION_LOG
from torchtitan_ext.measuring.timing import add_timed_run_arguments, parse_timed_run_arguments
from torchtitan_ext.records.campaign import bench_command, write_campaign
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job

VARIANTS = {
    "default": [],
    "float32": ["--training.mixed_precision_param", "float32"],
    "bfloat16": ["--training.mixed_precision_param", "bfloat16"],
}


def timed_run(variant: str, steps: int, dump_folder: str, overrides: list[str]) -> tuple[dict[int, float], str]:
    """({step: step time s}, the runtime's precision line) of one ./run_train.sh run, in ``dump_folder``."""
    env = dict(os.environ, TORCHTITAN_EXT_CPU_BF16="emulated", NGPU="2", PYTHONUNBUFFERED="1")
    env.pop("CONFIG_FILE", None)
    result = run_job(
        ["./run_train.sh", "--training.steps", str(steps), "--metrics.log_freq", "1",
         "--metrics.disable_color_printing", "--job.dump_folder", dump_folder, *VARIANTS[variant], *overrides],
        cwd=ROOT, env=env, timeout_s=3600, check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{result.output[-3000:]}")
    times = {row["step"]: row["time_metrics/end_to_end(s)"] for row in read_metrics(dump_folder)}
    precision = PRECISION_LOG.search(result.output)
    return times, precision.group(0) if precision else "no precision line"


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--with-bf16", action="store_true", help="also time bf16 forced (slow on such CPUs)")
    add_timed_run_arguments(parser, rounds=2, alternated="the variants", overridden="every variant")
    args = parse_timed_run_arguments(parser, argv)
    command = bench_command("cpu_precision", argv)
    variants = ["default", "float32"] + (["bfloat16"] if args.with_bf16 else [])
    times = {variant: [] for variant in variants}
    precision = {}
    with tempfile.TemporaryDirectory() as tmp, tqdm(
        total=args.rounds * len(variants), desc="bench_cpu_precision", unit="run", disable=args.no_progress
    ) as progress:
        for round_index in range(args.rounds):
            for variant in variants:
                dump_folder = f"{tmp}/{variant}{round_index}"
                steps, precision[variant] = timed_run(variant, args.steps, dump_folder, args.overrides)
                if sorted(steps) != list(range(1, args.steps + 1)):
                    raise SystemExit(f"{variant}: expected metrics of steps 1..{args.steps}, got {sorted(steps)}")
                times[variant] += [seconds for step, seconds in steps.items() if step > args.warmup]
                progress.update(1)
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    ratio = medians["default"] / medians["float32"]
    print("median step time: " + ", ".join(f"{v} {m:.3f} s" for v, m in medians.items())
          + f"; default / float32 = {ratio:.3f}")
    for variant in variants:
        print(f"{variant}: {precision[variant]}")
    if args.json:
        args.json.write_text(json.dumps(
            {"command": command, "times": times, "medians": medians, "ratio": ratio, "precision": precision}, indent=2
        ))
    if args.campaign is not None:
        rows = [{"variant": variant, "precision": precision[variant], "step_s": seconds}
                for variant, values in times.items() for seconds in values]
        write_campaign(args.campaign, [command], [*rows, {"table": "summary", "ratio_default_over_float32_median": ratio}])
    return 0
