"""Expert replication on a real training run: rank load per step and step time, with and without replicas.

    python -m torchtitan_ext.bench replication [--steps 20] [--rounds 1] [--settings 1x1,2x1,1x5,2x5]
        [--alphas A[,A...] [--drift-every 3]] [--forced-balance] [--campaign FILE] [-- extra run_train args]

Runs a job (``./run_train.sh``, NGPU=2, EP=2; the default job unless the extra arguments say otherwise) once per
setting, the settings alternating within each round so that machine noise spreads evenly: no replication, then
``--expert_replication.slots_per_rank`` 1 and 2 with ``adapt_every`` 1 and 5 (``--settings``: which of them, as
SLOTSxADAPT_EVERY). With ``--alphas``, every setting runs at each routing skew ``--routing_skew.alpha A
--routing_skew.drift_every D`` (the same seed: a pair of settings at one alpha routes alike until the replicas'
rounding parts them), and each is compared with the run without replicas at its alpha. With ``--forced-balance`` every setting also runs
under torchtitan's forced-balance routing (``--debug.moe_force_load_balance``): without replicas it is the ideal a
perfect balance would give for free, and each setting at an alpha is given the share of that headroom it captured,
(no replicas - replicated) / (no replicas - forced balance), per round; with replicas it is the balanced case, where
they must step aside. Each round runs the arms in the other order from the last.
Prints, per setting, from each run's metrics.jsonl: ``recv max/mean`` (the worst MoE layer's
busiest rank's rows over the mean) at every step, its median and worst after
step 1, the median after the warm-up of the "all layers" ratio (each MoE
layer's busiest rank's rows summed over the layers, over the mean rank's:
what the step's expert compute pays), the share of replicated layers that ran without replicas (set aside:
their choice saved less than ``min_gain``) and the host time of a choice, and the slowest rank's median step
time after a warm-up of 3 steps, as a ratio to the run without replicas of the same round and alpha, and how
far the losses of the first round's runs are from the run without replicas at their alpha.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import run_job

RUN_TIMEOUT_S = 3600
"""Seconds one training run of an arm may take before it is stopped."""
MEASURED = {
    "recv": "ep/recv_rows_max_over_mean_worst",
    "all_layers": "ep/recv_rows_max_over_mean_all_layers",
    "time": "time_metrics/end_to_end_slowest_rank(s)",
    "loss": "loss_metrics/global_avg_loss",
    "set_aside": "ep/replica_layers_set_aside",
    "choice": "ep/replica_choice_s",
    "changes": "ep/replica_plan_changes",
}
"""What each run reports: {name: its metric in metrics.jsonl}."""
SETTINGS = {
    "no replicas": [],
    "1 slot, adapt every 1": ["--expert_replication.slots_per_rank", "1", "--expert_replication.adapt_every", "1"],
    "2 slots, adapt every 1": ["--expert_replication.slots_per_rank", "2", "--expert_replication.adapt_every", "1"],
    "1 slot, adapt every 5": ["--expert_replication.slots_per_rank", "1", "--expert_replication.adapt_every", "5"],
    "2 slots, adapt every 5": ["--expert_replication.slots_per_rank", "2", "--expert_replication.adapt_every", "5"],
}
WARMUP = 3


def measured(dump_folder: Path | str) -> dict[str, dict[int, float]]:
    """{name of :data:`MEASURED`: {step: value}} of the run in ``dump_folder``."""
    rows = read_metrics(dump_folder)
    return {name: {row["step"]: row[metric] for row in rows if metric in row} for name, metric in MEASURED.items()}


def run(args: list[str], steps: int) -> dict[str, dict[int, float]]:
    """:func:`measured` of one ./run_train.sh run."""
    with tempfile.TemporaryDirectory() as dump_folder:
        result = run_job(["./run_train.sh", "--training.steps", str(steps), *args, "--job.dump_folder", dump_folder],
                         cwd=ROOT, env={**os.environ, "NGPU": "2"}, timeout_s=RUN_TIMEOUT_S, check=False)
        if result.returncode != 0:
            sys.exit(f"error: run_train.sh {' '.join(args)} exited {result.returncode}:\n{result.output[-6000:]}")
        return measured(dump_folder)


def slowest_median(times: dict[int, float]) -> float:
    """The median over the steps after the warm-up of {step: the slowest rank's step time}."""
    return statistics.median(seconds for step, seconds in times.items() if step > WARMUP)


def _after_warmup(values: dict[int, float]) -> list[float]:
    return [value for step, value in values.items() if step > WARMUP]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    if args.steps <= WARMUP + 1:
        parser.error(f"--steps {args.steps}: use more than {WARMUP + 1} (the first {WARMUP} are warm-up)")
    settings, skews = _settings(parser, args), _skews(parser, args)
    arms = {(skew, name): [*skew_args, *setting] for skew, skew_args in skews.items() for name, setting in settings.items()}
    rows = {arm: [] for arm in arms}
    with tqdm(total=args.rounds * len(arms), desc="bench_replication", unit="run") as progress:
        for round_number in range(args.rounds):
            order = list(arms.items()) if round_number % 2 == 0 else list(reversed(arms.items()))
            for (skew, name), arm_args in order:
                metrics = run([*arm_args, *args.extra], args.steps)
                rows[skew, name].append({**metrics, "median_time": slowest_median(metrics["time"])})
                progress.update()
            for (skew, name), measured_rounds in rows.items():  # against no replicas at the skew, this round
                measured_rounds[-1]["time_ratio"] = (measured_rounds[-1]["median_time"]
                                                     / rows[skew, "no replicas"][-1]["median_time"])
    lines = (_table(rows, args.steps) + [""] + _loss_lines(rows, settings, skews) + _round_lines(rows, args.rounds)
             + _headroom_lines(rows))
    print("\n".join(lines))
    if args.campaign is not None:
        command = bench_command("replication", argv)
        write_campaign(args.campaign, [command], _campaign_rows(rows))
    return 0


def _campaign_rows(rows: dict[tuple, list[dict]]) -> list[dict]:
    """One row per setting with replicas (its step time against no replicas over the rounds: median and range),
    one per run (its median step time and ratio), then one per run and step (what it measured)."""
    summaries, found = [], headroom(rows)
    for (skew, setting), arm_runs in rows.items():
        if setting != "no replicas":
            ratios = sorted(measurements["time_ratio"] for measurements in arm_runs)
            summaries.append({"table": "summary", "skew": skew, "setting": setting, "rounds": len(ratios),
                              "vs_no_replicas_median": statistics.median(ratios), "low": ratios[0], "high": ratios[-1],
                              **_headroom_fields(found.get((skew, setting), {}))})
    runs, steps = [], []
    for (skew, setting), arm_runs in rows.items():
        for round_number, measurements in enumerate(arm_runs, start=1):
            arm = {"skew": skew, "setting": setting, "round": round_number}
            runs.append({"table": "run", **arm, "median_step_s": measurements["median_time"],
                         "vs_no_replicas": measurements["time_ratio"],
                         "plan_changes_per_100_steps": _changes_per_100_steps(measurements["changes"])})
            steps += [{"table": "step", **arm, "step": step, **{name: measurements[name].get(step) for name in MEASURED}}
                      for step in sorted(measurements["time"])]
    return summaries + runs + steps


def _headroom_fields(figures: dict) -> dict[str, float]:
    """A summary row's fields from :func:`headroom`'s figures of its setting (none without forced balance)."""
    captured = sorted(figures.get("captured", []))
    fields = {}
    if captured:
        fields.update(headroom_captured_median=statistics.median(captured), headroom_captured_low=captured[0],
                      headroom_captured_high=captured[-1])
    if "set_aside" in figures:
        fields["set_aside_share"] = figures["set_aside"]
    return fields


def _parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default: 20)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all settings, alternating (default: 1)")
    parser.add_argument("--settings", default="1x1,2x1,1x5,2x5",
                        help="replica settings besides none, as SLOTSxADAPT_EVERY (default: 1x1,2x1,1x5,2x5)")
    parser.add_argument("--alphas", default=None,
                        help="routing skews to run every setting at, comma separated (default: the job's routing)")
    parser.add_argument("--drift-every", type=int, default=3,
                        help="with --alphas: steps between redraws of the skew's expert ranking (default: 3)")
    parser.add_argument("--forced-balance", action="store_true",
                        help="also run every setting under forced-balance routing: the ideal, and the balanced case")
    parser.add_argument("--campaign", type=Path, help="also write every run's measurements as a new campaign file "
                                                      "(benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("extra", nargs="*", help="more run_train.sh arguments for every run (after --)")
    return parser


def _settings(parser: argparse.ArgumentParser, args) -> dict[str, list[str]]:
    """Setting name -> its overrides: no replicas, then each of --settings."""
    settings = {"no replicas": SETTINGS["no replicas"]}
    for code in args.settings.split(","):
        slots, _, adapt_every = code.partition("x")
        name = f"{slots} slot{'s' if slots != '1' else ''}, adapt every {adapt_every}"
        if name not in SETTINGS:
            parser.error(f"--settings {code}: use SLOTSxADAPT_EVERY codes among 1x1, 2x1, 1x5, 2x5")
        settings[name] = SETTINGS[name]
    return settings


def _skews(parser: argparse.ArgumentParser, args) -> dict[str, list[str]]:
    """Skew name -> its overrides: the job's own routing ("") unless --alphas; then forced balance with
    --forced-balance."""
    forced = {FORCED_BALANCE: FORCED_BALANCE_ROUTING} if args.forced_balance else {}
    if args.alphas is None:
        return {"": [], **forced}
    try:
        alphas = [float(text) for text in args.alphas.split(",")]
    except ValueError:
        alphas = [-1.0]
    if any(not 0 <= alpha < float("inf") for alpha in alphas) or args.drift_every < 1:
        parser.error(f"--alphas {args.alphas} --drift-every {args.drift_every}: use finite alphas >= 0, "
                     "comma separated, and a drift of at least 1 step")
    return {**{f"alpha {alpha:g}": ["--routing_skew.alpha", str(alpha), "--routing_skew.drift_every",
                                     str(args.drift_every)] for alpha in alphas}, **forced}


FORCED_BALANCE = "forced balance"
"""The skew of torchtitan's forced-balance routing: every expert gets the same pairs."""
FORCED_BALANCE_ROUTING = ["--debug.moe_force_load_balance"]
"""Its training overrides."""


def headroom_captured(without: list[float], ideal: list[float], replicated: list[float]) -> list[float]:
    """Per round, the replicated arm's share of the headroom, (no replicas - replicated) / (no replicas - forced
    balance), from the three arms' step times of each round; a round where forced balance was not faster has none to
    capture (noise, or a balanced skew) and is left out."""
    return [(none - step) / (none - best) for none, best, step in zip(without, ideal, replicated) if none > best]


def headroom(rows: dict) -> dict[tuple[str, str], dict[str, list[float] | float]]:
    """With forced balance, per replicated setting: at each other skew, ``captured``, its share of the headroom per
    round (:func:`headroom_captured`; empty where forced balance was never faster); under forced balance, ``ratios``,
    its step time against no replicas per round, and ``set_aside``, the share of its layer-steps after the warm-up
    whose replicas stepped aside. Empty without forced balance."""
    if (FORCED_BALANCE, "no replicas") not in rows:
        return {}
    ideal = [measured["median_time"] for measured in rows[FORCED_BALANCE, "no replicas"]]
    found = {}
    for (skew, name), measured_rounds in rows.items():
        if name == "no replicas":
            continue
        if skew == FORCED_BALANCE:
            aside = [value for measured in measured_rounds for value in _after_warmup(measured["set_aside"])]
            found[skew, name] = {"ratios": [measured["time_ratio"] for measured in measured_rounds],
                                 "set_aside": statistics.mean(aside) if aside else 0.0}
        else:
            without = [measured["median_time"] for measured in rows[skew, "no replicas"]]
            found[skew, name] = {"captured": headroom_captured(
                without, ideal, [measured["median_time"] for measured in measured_rounds])}
    return found


def _headroom_lines(rows: dict) -> list[str]:
    """:func:`headroom`, printed: each setting's share of the headroom at each other skew, and under forced balance
    its step time against no replicas and the share of its layer-steps whose replicas stepped aside."""
    found = headroom(rows)
    if not found:
        return []
    lines = [""]
    for (skew, name), figures in found.items():
        if skew == FORCED_BALANCE:
            lines.append(f"{FORCED_BALANCE}, {name}: step time vs no replicas {_median_range(figures['ratios'])}; "
                         f"replicas set aside on {figures['set_aside']:.0%} of layer-steps after step {WARMUP}")
            continue
        share = (f"headroom captured {_median_range(figures['captured'], '.0%')}" if figures["captured"] else
                 "no headroom: forced balance was not faster in any round")
        lines.append(f"{', '.join(filter(None, (skew, name)))}: {share} (no replicas {_median_of(rows, skew):.3f} s, "
                     f"forced balance {_median_of(rows, FORCED_BALANCE):.3f} s)")
    return lines


def _median_of(rows: dict, skew: str) -> float:
    """The median over rounds of the run without replicas at ``skew``."""
    return statistics.median(measured["median_time"] for measured in rows[skew, "no replicas"])


def _median_range(values: list[float], form: str = ".3f") -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered):{form}} ({ordered[0]:{form}} to {ordered[-1]:{form}}, {len(ordered)} rounds)"


def _table(rows: dict, steps: int) -> list[str]:
    lines = [
        f"| setting | recv max/mean per step (steps 1-{steps}) | median, worst after step 1 | "
        f"all layers, median after step {WARMUP} | replicas set aside, share of layer-steps after step {WARMUP} | "
        "choice, median ms | plan changes per 100 steps, all layers | slowest rank's median step time (s) | vs no replicas |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (skew, name), measured_rounds in rows.items():
        for metrics in measured_rounds:
            recv = metrics["recv"]
            later = [ratio for step, ratio in recv.items() if step > 1]
            aside, choice = _after_warmup(metrics["set_aside"]), _after_warmup(metrics["choice"])
            lines.append(
                f"| {', '.join(filter(None, (skew, name)))} | {' '.join(f'{recv[s]:.2f}' for s in sorted(recv))} | "
                f"{statistics.median(later):.2f}, {max(later):.2f} | "
                f"{statistics.median(_after_warmup(metrics['all_layers'])):.2f} | "
                f"{f'{statistics.mean(aside):.2f}' if aside else '-'} | "
                f"{f'{1000 * statistics.median(choice):.1f}' if choice else '-'} | "
                f"{_or_dash(_changes_per_100_steps(metrics['changes']), '.1f')} | "
                f"{metrics['median_time']:.3f} | "
                f"{metrics['time_ratio']:.3f} |"
            )
    return lines


def _changes_per_100_steps(changes: dict[int, float]) -> float | None:
    """The layers' plan changes per 100 steps after the first choice (whose own plans are not changes), to the run's
    end (None without replicas, or with one choice only)."""
    first, last = min(changes, default=0), max(changes, default=0)
    if last == first:
        return None
    return 100 * (changes[last] - changes[first]) / (last - first)


def _or_dash(value: float | None, form: str) -> str:
    return "-" if value is None else f"{value:{form}}"


def _loss_lines(rows: dict, settings: dict, skews: dict) -> list[str]:
    """Per skew, the first round's largest relative loss difference to the run without replicas."""
    lines = []
    for skew in skews:
        losses = {name: rows[skew, name][0]["loss"] for name in settings}
        reference = losses["no replicas"]
        differences = {step: max(abs(got[step] - loss) / loss for got in losses.values())
                       for step, loss in reference.items()}
        first_differing = next((step for step in sorted(differences) if differences[step]), None)
        lines.append(
            f"{f'At {skew}: l' if skew else 'L'}argest relative loss difference to the run without replicas: steps "
            f"1-10 {max(differences[step] for step in sorted(differences)[:10]):.1e}, any step "
            f"{max(differences.values()):.1e}; first step whose logged loss differs: {first_differing or 'none'}"
        )
    return lines


def _round_lines(rows: dict, rounds: int) -> list[str]:
    """With several rounds, each setting's step time against no replicas: the median and range over rounds."""
    if rounds < 2:
        return []
    lines = [""]
    for (skew, name), measured_rounds in rows.items():
        if name != "no replicas":
            ratios = sorted(metrics["time_ratio"] for metrics in measured_rounds)
            lines.append(f"{', '.join(filter(None, (skew, name)))}: step time vs no replicas, median of "
                         f"{len(ratios)} rounds {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    return lines
