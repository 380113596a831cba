"""The layout advisor's predictions against runs on this machine.

    python -m torchtitan_ext.bench layout_advisor_check [--steps 10] [--warmup 3] [--rounds 2] [--tokens 2048]
        [--checks step bench]

1. Calibrates this machine (``plan --calibrate``, 4 gloo processes).
2. (``--checks step``) Measures the debug job's per-rank compute and its
   backends' local work (``plan --measure-compute``). For the debug model at NGPU=4 (nccl), predicts the step time of
   (EP, efsdp) = (4, 1), (2, 2), (1, 4) with that topology and compute, and
   measures it: ``./run_train.sh`` at each EP degree, median step time (metrics.jsonl) after
   ``--warmup``, ``--rounds`` times in turn (EP 4, 2, 1, 4, 2, 1, ...); the
   table gives the median over rounds and each round's value, so that a
   difference smaller than the spread reads as one.
3. (``--checks bench``) For every backend, predicts one dispatch + combine, forward and backward,
   at EP = 2 and 4: the cost model's four all-to-alls plus the backend's local
   work (permutations, kernels) measured alone, ``python -m torchtitan_ext.bench ep
   --ep-degree 1`` with as many processes (its median less its collectives'),
   and measures it with ``python -m torchtitan_ext.bench ep``.

Prints each check's table, predicted against measured, the ratio and
whether the predicted ranking equals the measured one.
"""

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.ep.backends import DEFAULT_VARIANTS
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job

JOB = ["--training.local_batch_size", "2", "--training.seq_len", "128"]
BENCH_VARIANTS = DEFAULT_VARIANTS
"""The backend variants the bench check times: each backend in its default settings."""


def measured_step_time(ep: int, steps: int, warmup: int, folder: Path) -> float:
    result = run_job(
        ["./run_train.sh", *JOB, "--training.steps", str(steps), "--parallelism.expert_parallel_degree", str(ep),
         "--job.dump_folder", str(folder)],
        cwd=ROOT, env={**os.environ, "NGPU": "4"}, timeout_s=1200, check=False,
    )
    if result.returncode != 0:
        sys.exit(f"error: the EP={ep} run failed:\n{result.output[-3000:]}")
    return statistics.median(row["time_metrics/end_to_end(s)"] for row in read_metrics(folder) if row["step"] > warmup)


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="step times dropped at the start of each run")
    parser.add_argument("--rounds", type=int, default=2, help="training runs per EP degree, in turn")
    parser.add_argument("--tokens", type=int, default=2048, help="bench_ep tokens per rank")
    parser.add_argument("--checks", nargs="+", choices=["step", "bench"], default=["step", "bench"],
                        help="the step-time check (2), the bench_ep check (3), or both")
    args = parser.parse_args(argv)

    from torchtitan_ext.planning.calibrate import calibrate
    from torchtitan_ext.planning.topology import load_topology
    from torchtitan_ext.training import prepare

    prepare()
    topology_file = ROOT / "outputs" / "this_machine_topology.toml"
    calibrate(4, topology_file)
    topology = load_topology(str(topology_file))
    if "step" in args.checks:
        check_step_time(args, topology)
    if "bench" in args.checks:
        check_bench_ep(args, topology)
    return 0


def check_step_time(args, topology) -> None:
    from torchtitan_ext.planning.layout_advisor import advise
    from torchtitan_ext.measuring.compute import measure_compute

    train_args = ["--job.config_file", "train_configs/debug_model.toml", *JOB]
    compute = measure_compute(train_args, 4)
    predicted = {
        layout.ep: layout for layout in advise(train_args, 4, topology, measured_compute=compute)[0]
        if layout.refused is None and layout.backend == "nccl"
    }
    runs = {ep: [] for ep in (4, 2, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        for index in tqdm(range(3 * args.rounds), desc="training runs (NGPU=4)"):
            ep = (4, 2, 1)[index % 3]
            runs[ep].append(measured_step_time(ep, args.steps, args.warmup, Path(tmp) / f"run{index}"))
    rows = [(ep, 4 // ep, predicted[ep].step_s, statistics.median(times)) for ep, times in runs.items()]
    print("\nDebug model, NGPU=4, nccl: step time")
    print("| EP | efsdp | compute s | data-parallel s | MoE comm s | backend local work s | predicted s | "
          "measured s (rounds) | predicted / measured |")
    print("|----|-------|-----------|-----------------|------------|----------------------|-------------|"
          "---------------------|----------------------|")
    for ep, efsdp, p, m in rows:
        layout = predicted[ep]
        each = ", ".join(f"{t:.3f}" for t in runs[ep])
        print(f"| {ep} | {efsdp} | {layout.compute_s:.3f} | {layout.data_parallel_exposed_s:.3f} | "
              f"{layout.exposed_s:.3f} | "
              f"{layout.local_work_s:.3f} | {p:.3f} | {m:.3f} ({each}) | {p / m:.2f} |")
    ranking = lambda index: [row[0] for row in sorted(rows, key=lambda row: row[index])]  # noqa: E731
    print(f"predicted ranking (EP): {ranking(2)}; measured: {ranking(3)}")


def check_bench_ep(args, topology) -> None:
    from torchtitan_ext.planning.cost_model import layer_costs, MoEWorkload
    from torchtitan_ext.ep import PLANNING_PROFILES

    print("\nbench_ep: one dispatch + combine, forward and backward, ms")
    print("| EP | backend | modelled communication | measured local work | predicted | measured | "
          "predicted / measured |")
    print("|----|---------|------------------------|---------------------|-----------|----------|"
          "----------------------|")
    for ep in (2, 4):
        full, local = bench_ep(ep, ep, args.tokens), bench_ep(ep, 1, args.tokens)
        predicted = {}
        for variant, entry in full.items():
            work = MoEWorkload(
                tokens=args.tokens, hidden=entry["hidden"], top_k=entry["top_k"], experts=entry["experts"],
                expert_parameters=0, activation_bytes=4, gather_bytes=4, reduce_bytes=4, pre_expert_flops=0.0,
                regather_in_backward=False,
            )
            once_per_rank = PLANNING_PROFILES[entry["comm_backend"]].sends_each_token_once_per_rank
            costs = layer_costs(work, topology, ep, ep, 1, once_per_rank)
            communication = 4 * costs.a2a * 1e3
            local_work = max(0.0, local[variant]["median_ms"] - local[variant]["bare_median_ms"])
            predicted[variant] = communication + local_work
            print(f"| {ep} | {variant} | {communication:.2f} | {local_work:.2f} | {predicted[variant]:.2f} | "
                  f"{entry['median_ms']:.2f} | {predicted[variant] / entry['median_ms']:.2f} |")
        print(f"EP={ep} predicted ranking: {sorted(predicted, key=predicted.get)}; "
              f"measured: {sorted(full, key=lambda variant: full[variant]['median_ms'])}")


def bench_ep(processes: int, ep_degree: int, tokens: int) -> dict:
    """bench ep's rows by backend variant: ``processes`` processes in EP groups of ``ep_degree``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run_job(
            [sys.executable, "-m", "torchtitan_ext.bench", "ep", "--nproc", str(processes), "--ep-degree",
             str(ep_degree), "--tokens", str(tokens), "--backends", *BENCH_VARIANTS, "--json", out.name,
             "--no-progress"],
            cwd=ROOT, timeout_s=1800,
        )
        return {row["backend"]: row for row in json.loads(Path(out.name).read_text())["rows"]}
