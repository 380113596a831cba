"""The layout advisor prices expert replication for the DeepSeek-V3 671B GB200 job at 0, 1 and 2 replica slots.

    python -m torchtitan_ext.bench price_replicas [--steps 4] [--tokens 4096] [--topology gb200_nvl72]

Writes the 671B-shaped synthetic routing dump of ``python -m torchtitan_ext.bench placement``
(58 MoE layers, 256 experts, top-8, Zipf 0.8 popularity, clustered in 32
groups of 8, the same every step: no drift), then runs

    python -m torchtitan_ext.plan --job.config_file train_configs/deepseek_v3_671b_gb200.toml --world-size 256
        --topology gb200_nvl72 --ranks-per-group 64 --routing-stats <dump> --replica-slots 0,1,2

and prints the advice, which replays the dump through training's choice and
split of replicas at every EP degree (the steps after the first are priced).
The routing is synthetic (no 671B run is recorded here): the table says what
the advisor predicts for this skew, not what a run measured.
"""

import sys
import tempfile
import time
from pathlib import Path

from torchtitan_ext.bench.placement import ROOT, write_dump
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job


JOB_CONFIG = "train_configs/deepseek_v3_671b_gb200.toml"


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="steps in the dump (the first is not priced)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step and layer")
    parser.add_argument("--topology", default="gb200_nvl72", help="topology name or file")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.tokens < 1:
        parser.error("--steps needs at least 2 (the first step is not priced) and --tokens at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        write_dump(Path(tmp), args.steps, args.tokens)
        command = [
            sys.executable, "-m", "torchtitan_ext.plan", "--job.config_file", JOB_CONFIG,
            "--world-size", "256", "--topology", args.topology,
            "--ranks-per-group", "64", "--routing-stats", tmp, "--replica-slots", "0,1,2",
        ]
        shown = " ".join(command[1:])
        print("$ python", shown.replace(tmp, "<synthetic dump>"), flush=True)
        began = time.perf_counter()
        result = run_job(command, cwd=ROOT, timeout_s=1800)
        wall = time.perf_counter() - began
    advice = result.output.splitlines()
    start = next((i for i, line in enumerate(advice) if line.startswith("Layout advice")), 0)
    print("\n".join(advice[start:]).replace(tmp, "<synthetic dump>"))
    print(f"advisor wall time (process, including imports and the job config): {wall:.1f} s")
    return result.returncode
