"""Expert replication timed by each rank's CPU time, for more ranks than cores: the step one device per rank would take.

    python -m torchtitan_ext.bench replication_cpu_time [--nproc 4] [--steps 12] [--rounds 3] [--slots 2]
        [--alphas 0,1,2] [--drift-every 3] [--forced-balance] [--experts grouped_mm|loop] [--campaign FILE]
        [-- extra training args]

Trains, in ``--nproc`` processes of one thread each (EP = ``--nproc``), the experts-dominated debug model
(``debugmodel_wide_experts``, 1,024 tokens per rank, no activation checkpointing; extra arguments after ``--``
override it) under each routing skew ``alpha`` (``[routing_skew]``, redrawn every ``--drift-every`` steps), with
no replicas and with ``--slots`` replica slots per rank re-chosen every step, the arms alternating within each
round, each in fresh processes; with ``--forced-balance`` both arms also run under torchtitan's forced-balance
routing (``--debug.moe_force_load_balance``): without replicas it is the ideal, the step a perfect balance would
give for free, and each skew's replicated arm is given the share of that headroom it captured, (no replicas -
replicated) / (no replicas - forced balance), round by round; with replicas it is the balanced case, where the
replicas must step aside. When ranks outnumber cores an idle rank gives its core away, so wall
time says nothing of balance; each rank's CPU time (``time.process_time``) does. Per step and rank it is split
(:class:`CpuClock`) into, per MoE layer, the router and the replicas' split (the MoE's forward up to its
experts' hooks), the experts' forward and backward (the dispatch's end to the combine, without the gradients'
return), and the replica transfers (the op ``replica_weights``, forward, issued in the backend's dispatch hook
before the dispatch, its landing waited for in the experts' forward; ``replica_gradients``, backward); the
replicas' choice; and the rest of the step.
The verdict (:func:`verdict`) is the step one device per rank would take: each segment of an MoE layer ends at a
collective that joins the ranks, so it costs its slowest rank's time; the sum of those, plus the slowest rank's
remainder, plus replication's own work (each layer's slowest transfers, the slowest choice). The slowest rank's
wall time per step is reported beside it: with no more ranks than cores (``--nproc 2`` here) it is honest too.
The experts run torchtitan's grouped GEMMs in bf16, as on a GPU (``--experts loop``: the per-expert loop a CPU
trains with, :mod:`torchtitan_ext.ep.experts`). docs/balancing.md says what it found.
"""

import argparse
import math
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.bench.replication import FORCED_BALANCE, FORCED_BALANCE_ROUTING, headroom_captured
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.data import prepare_embedded_assets
from torchtitan_ext.ep import replication
from torchtitan_ext.ep.base import named_layer
from torchtitan_ext.ep.experts import ROUTED_EXPERTS
from torchtitan_ext.ep.replication import experts as replica_experts, split as replica_split
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers
from torchtitan_ext.training import prepare
from torchtitan_ext.training.trainer import Trainer

WARMUP = 3
"""Steps left out of the medians: the first choice of replicas comes before step 2."""
LOSS_TOLERANCE = 1e-4
"""Largest relative difference of a step's loss between the arms of one skew: the same routing and seed, so only
the order of floating-point sums differs (the gradient matrix bounds replication's by 1e-5 per step)."""
JOB = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel_wide_experts",
       "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"]
LAYER_SEGMENTS = ("router", "experts_forward", "experts_backward", "counts", "fetch", "return")
"""What :class:`CpuClock` times per MoE layer; the router's segment includes the split's exchange of counts and the
experts' segments the weights' transfers, which are also timed apart."""


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``on_backward`` first: where a segment's backward starts or ends."""

    @staticmethod
    def forward(ctx, on_backward, *tensors):
        ctx.on_backward = on_backward
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return None, *grads


class CpuClock:
    """This rank's CPU time per step: per MoE layer and segment (:data:`LAYER_SEGMENTS`), the replicas' choice and
    the whole step, and the step's wall time, in seconds: ``steps[step] = {"total", "choice", "wall", "layers":
    {layer: {segment: s}}}``."""

    def __init__(self):
        self.steps: dict[int, dict] = {}
        self.layer: int | None = None
        """The MoE layer whose forward runs now (the replica op is told no layer)."""
        self._started: dict[tuple[int, str], float] = {}

    def open_layer(self, segment: str) -> int:
        """The layer whose ``segment`` is being timed now (one at a time)."""
        (layer,) = [layer for layer, started in self._started if started == segment]
        return layer

    def start(self, layer: int, segment: str) -> None:
        self._started[layer, segment] = time.process_time()

    def stop(self, layer: int, segment: str) -> None:
        self.add(layer, segment, time.process_time() - self._started.pop((layer, segment)))

    def add(self, layer: int, segment: str, seconds: float) -> None:
        layers = self._current["layers"]
        layers.setdefault(layer, dict.fromkeys(LAYER_SEGMENTS, 0.0))[segment] += seconds

    @property
    def _current(self) -> dict:
        return self.steps[max(self.steps)]

    def attach(self, trainer) -> None:
        """Time ``trainer``'s steps, its replicas' choice and its MoE layers from now on."""
        from torchtitan_ext.balancing.migration import moe_modules

        train_step = trainer.train_step

        def timed_step(data_iterator):
            self.steps[trainer.step] = {"total": 0.0, "choice": 0.0, "wall": 0.0, "layers": {}}
            started, wall_started = time.process_time(), time.perf_counter()
            train_step(data_iterator)
            self._current["total"] = time.process_time() - started
            self._current["wall"] = time.perf_counter() - wall_started

        trainer.train_step = timed_step
        chooser = trainer.replica_chooser
        if chooser is not None:
            before_step = chooser.before_step

            def timed_choice(step):
                started = time.process_time()
                before_step(step)
                self._current["choice"] += time.process_time() - started

            chooser.before_step = timed_choice
        for layer, moe in moe_modules(trainer.model_parts).items():
            self._attach_layer(layer, moe)

    def _attach_layer(self, layer: int, moe) -> None:
        def entered(module, args):
            self.layer = layer
            self.start(layer, "router")

        def dispatching(module, args):
            self.stop(layer, "router")

        def dispatched(module, args):
            rows, *rest = args
            self.start(layer, "experts_forward")
            return _Mark.apply(partial(self.stop, layer, "experts_backward"), rows) + tuple(rest)

        def combining(module, args, output):
            self.stop(layer, "experts_forward")
            return _Mark.apply(partial(self.start, layer, "experts_backward"), output)[0]

        moe.register_forward_pre_hook(entered)
        # the EP backend's dispatch and combine are the experts' own hooks: these run on either side of them
        moe.experts.register_forward_pre_hook(dispatching, prepend=True)
        moe.experts.register_forward_pre_hook(dispatched)
        moe.experts.register_forward_hook(combining, prepend=True)


_clock: CpuClock | None = None
"""The clock of the run training in this process now: the replica op's timing reads it."""


class _TimedOp:
    """A replication op whose calls ``timed(op, *args)`` times into the MoE layer running it; ``default`` stays the
    op's own overload."""

    def __init__(self, op, timed):
        self.op, self.default, self.timed = op, op.default, timed

    def __call__(self, *args):
        if _clock is None:
            return self.op(*args)
        return self.timed(_clock, self.op, *args)


def _timed_fetch(clock: CpuClock, op, *args):
    """The replicas' fetch issued (forward), in the layer it fetches for (it lands in that layer's experts' forward):
    the layer whose forward runs, or the next one, whose fetch this one issues ahead. Its last argument names it."""
    started = time.process_time()
    fetched = op(*args)
    layer = named_layer(args[-1])
    clock.add(clock.layer if layer is None else layer, "fetch", time.process_time() - started)
    return fetched


def _timed_return(clock: CpuClock, op, *args):
    """The replicas' gradients' return (backward), in the layer whose experts' backward runs."""
    layer = clock.open_layer("experts_backward")
    started = time.process_time()
    summed = op(*args)
    clock.add(layer, "return", time.process_time() - started)
    return summed


def _timed_counts(clock: CpuClock, op, *args):
    """The split's exchange of pair counts (inside the router's segment, a collective)."""
    started = time.process_time()
    counts = op(*args)
    clock.add(clock.layer, "counts", time.process_time() - started)
    return counts


class _TimedReplicaOps:
    """``transport_ops()`` whose replica weights, their gradients' return and the count exchange are timed
    (:func:`_timed_fetch`, :func:`_timed_return`, :func:`_timed_counts`)."""

    def __init__(self, ops):
        self.replica_weights = _TimedOp(ops.replica_weights, _timed_fetch)
        self.replica_gradients = _TimedOp(ops.replica_gradients, _timed_return)
        self.replica_counts = _TimedOp(ops.replica_counts, _timed_counts)


def train_arms(rank: int, world_size: int, arms: list[tuple[str, list[str]]], grouped_mm: bool) -> dict[str, dict[int, dict]]:
    """Train each (name, args) job in turn on this rank: {name: :attr:`CpuClock.steps`}; with ``grouped_mm``, the
    experts computed by torchtitan's grouped GEMMs (bf16) as on a GPU of SM90 or later, else by the per-expert loop
    a CPU trains with (:mod:`torchtitan_ext.ep.experts`)."""
    global _clock
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(ROOT)
    prepare()
    timed_ops = _TimedReplicaOps(replication.transport_ops())
    replica_experts.transport_ops = replica_split.transport_ops = lambda: timed_ops
    timed = {}
    for name, args in arms:
        job_config = load_job_config(args, "cpu", world_size)
        prepare_embedded_assets(job_config)
        trainer = Trainer(job_config)
        for part in trainer.model_parts:
            for module in part.modules():
                if isinstance(module, tuple(ROUTED_EXPERTS)):
                    module.use_grouped_mm = grouped_mm
        _clock = CpuClock()
        _clock.attach(trainer)
        try:
            trainer.train()
        finally:
            trainer.close()
        timed[name] = _clock.steps
    return timed


def verdict(ranks: list[dict]) -> dict[str, float]:
    """One step's parts, in seconds, from every rank's record of it (:class:`CpuClock`).

    Each MoE layer joins its ranks at every collective: the dispatch closes the router's segment (and the split's
    exchange of counts, timed apart, sits inside it), the combine closes the experts' forward, the dispatch's
    backward their backward. So each segment costs its slowest rank's time. "layers": the sum over the layers and
    segments of the slowest rank's router and split without the count exchange, and experts' forward and backward
    without the weights' transfers; "balanced": the same, the mean rank's; "remainder": the slowest rank's step
    without its MoE layers' timed segments, their fetches and its choice; "replication": each layer's slowest count exchange,
    fetch and return, summed, plus the slowest choice; "step": layers + remainder + replication; "wall": the
    slowest rank's wall time, which says the same only where every rank has a core of its own. A segment timed
    twice (a layer recomputed in backward) would leave a negative remainder: refused."""
    def segments(record, layer):
        timed = record["layers"][layer]
        return timed["router"] - timed["counts"], timed["experts_forward"], timed["experts_backward"] - timed["return"]

    def transfers(record, layer):
        timed = record["layers"][layer]
        return timed["counts"], timed["fetch"], timed["return"]

    layers = sorted(ranks[0]["layers"])
    compute = [[value for layer in layers for value in segments(record, layer)] for record in ranks]
    moved = [[value for layer in layers for value in transfers(record, layer)] for record in ranks]
    # the fetch runs in the dispatch hook, between the router's segment and the experts' forward
    remainder = [record["total"] - record["choice"] - sum(
        timed["router"] + timed["fetch"] + timed["experts_forward"] + timed["experts_backward"]
        for timed in record["layers"].values()) for record in ranks]
    if min(remainder) < 0:
        raise ValueError(f"a rank's timed segments exceed its step ({min(remainder):.3f} s left): a segment was timed "
                         "twice")
    parts = {
        "layers": sum(max(column) for column in zip(*compute)),
        "balanced": sum(statistics.mean(column) for column in zip(*compute)),
        "remainder": max(remainder),
        "replication": sum(max(column) for column in zip(*moved)) + max(record["choice"] for record in ranks),
    }
    parts["step"] = parts["layers"] + parts["remainder"] + parts["replication"]
    parts["wall"] = max(record["wall"] for record in ranks)
    return parts


def median_parts(ranks: list[dict[int, dict]]) -> dict[str, float]:
    """Per part of :func:`verdict`, its median over the steps after the warm-up of one run."""
    steps = [step for step in sorted(ranks[0]) if step > WARMUP]
    per_step = [verdict([record[step] for record in ranks]) for step in steps]
    return {part: statistics.median(parts[part] for parts in per_step) for part in per_step[0]}


def mean_segments(runs: list[list[dict[int, dict]]]) -> dict[str, float]:
    """The mean over ``runs`` (each: every rank's :attr:`CpuClock.steps`), their ranks and their steps after the
    warm-up of each segment summed over the MoE layers, the router's without the count exchange and the experts'
    without the weights' transfers, and of the choice and the whole step, in seconds."""
    records = [record for ranks in runs for steps in ranks for step, record in steps.items() if step > WARMUP]

    def layers_sum(record, segment):
        return sum(timed[segment] for timed in record["layers"].values())

    return {
        "router": statistics.mean(layers_sum(record, "router") - layers_sum(record, "counts") for record in records),
        "counts": statistics.mean(layers_sum(record, "counts") for record in records),
        "experts_forward": statistics.mean(layers_sum(record, "experts_forward") for record in records),
        "experts_backward": statistics.mean(layers_sum(record, "experts_backward") - layers_sum(record, "return")
                                            for record in records),
        "fetch": statistics.mean(layers_sum(record, "fetch") for record in records),
        "return": statistics.mean(layers_sum(record, "return") for record in records),
        "choice": statistics.mean(record["choice"] for record in records),
        "total": statistics.mean(record["total"] for record in records),
    }


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    skews = _checked(parser, args)
    replicas = ["--expert_replication.slots_per_rank", str(args.slots), "--expert_replication.adapt_every", "1"]
    settings = {"no replicas": [], f"{args.slots} slot{'s' * (args.slots > 1)}, adapt every 1": replicas}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        with tqdm(total=args.rounds * len(skews) * len(settings), desc="bench_replication_cpu_time",
                  unit="run") as progress:
            for round_index in range(args.rounds):
                arms = [
                    (f"{round_index} {skew} {name}", [
                        *JOB, "--parallelism.expert_parallel_degree", str(args.nproc), "--training.steps",
                        str(args.steps), *routing, *setting, *args.extra,
                        "--job.dump_folder", f"{tmp}/{round_index}-{skew.replace(' ', '_')}-{len(setting)}",
                    ]) for skew, routing in skews.items() for name, setting in settings.items()
                ]
                for name, arm_args in arms:
                    # fresh processes per arm: a process that built several trainers keeps part of each
                    ranks = [timed[name] for timed in run_workers(
                        args.nproc, train_arms, [(name, arm_args)], args.experts == "grouped_mm", deadline_s=3600.0,
                        preload=["torchtitan_ext.training.trainer"])]
                    runs[name] = {"parts": median_parts(ranks), "metrics": read_metrics(arm_args[-1]), "ranks": ranks}
                    progress.update()
    lines, failed = _report(runs, args, list(skews), list(settings))
    print("\n".join(lines))
    if args.campaign is not None:
        command = bench_command("replication_cpu_time", argv)
        found = summary(runs, args.rounds, list(skews), list(settings))
        head = [{"table": "summary", "ep": args.nproc, "slots_per_rank": args.slots, "rounds": args.rounds,
                 "steps": args.steps, "warmup_steps": WARMUP, **found}] if found else []
        write_campaign(args.campaign, [command], head + [{"run": name, **run} for name, run in runs.items()])
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=4, help="ranks, one thread each, and the EP degree (default: 4)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default: 12)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all arms, alternating (default: 3)")
    parser.add_argument("--slots", type=int, default=2, help="replica slots per rank of the replicated arms "
                                                             "(default: 2)")
    parser.add_argument("--alphas", default="0,1,2", help="routing skews, comma separated (default: 0,1,2)")
    parser.add_argument("--drift-every", type=int, default=3,
                        help="steps between redraws of the skew's expert ranking (default: 3)")
    parser.add_argument("--forced-balance", action="store_true",
                        help="also run both arms under forced-balance routing: the ideal, and the balanced case")
    parser.add_argument("--experts", choices=("grouped_mm", "loop"), default="grouped_mm",
                        help="the experts' GEMMs: torchtitan's grouped GEMMs in bf16, as a GPU runs them (default), or "
                             "the per-expert loop a CPU trains with, in the job's precision")
    parser.add_argument("--campaign", type=Path, help="also write every rank's CPU times per run and step as a new "
                                                      "campaign file (benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("extra", nargs="*", help="more training arguments for every run (after --)")
    return parser


def _checked(parser: argparse.ArgumentParser, args) -> dict[str, list[str]]:
    """The routings of ``args`` (name -> overrides: each alpha's skew, then forced balance with ``--forced-balance``),
    every option and the job checked first (one line each, through ``parser``)."""
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: use more than {WARMUP} (the first {WARMUP} are warm-up)")
    if args.nproc < 2 or args.slots < 1 or args.rounds < 1 or args.drift_every < 1:
        parser.error(f"--nproc {args.nproc} --slots {args.slots} --rounds {args.rounds} --drift-every "
                     f"{args.drift_every}: use at least 2 ranks, 1 slot, 1 round and a drift of 1 step")
    try:
        alphas = [float(text) for text in args.alphas.split(",")]
    except ValueError:
        alphas = [-1.0]
    if any(not 0 <= alpha < float("inf") for alpha in alphas):
        parser.error(f"--alphas {args.alphas}: use finite alphas >= 0, comma separated")
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    prepare()
    try:
        job_config = load_job_config([*JOB, "--parallelism.expert_parallel_degree", str(args.nproc), *args.extra],
                                     "cpu", args.nproc)
    except ConfigError as e:
        parser.error(str(e))
    if job_config.activation_checkpoint.mode != "none" or job_config.parallelism.pipeline_parallel_degree != 1:
        # a recomputed layer would time its segments twice; ranks of other stages hold other layers
        parser.error(f"activation_checkpoint.mode {job_config.activation_checkpoint.mode!r}, "
                     f"parallelism.pipeline_parallel_degree {job_config.parallelism.pipeline_parallel_degree}: the "
                     "CPU times are split per MoE layer on every rank: use 'none' and 1")
    skews = {f"alpha {alpha:g}": ["--routing_skew.alpha", str(alpha), "--routing_skew.drift_every",
                                  str(args.drift_every)] for alpha in alphas}
    return {**skews, FORCED_BALANCE: FORCED_BALANCE_ROUTING} if args.forced_balance else skews


def _report(runs: dict, args, skews: list[str], settings: list[str]):
    def metric(rows, name):
        return [row[name] for row in rows if row["step"] > WARMUP and name in row]

    lines = [
        "| routing | setting | round | recv max/mean all layers, median | replicas set aside | step (s) | "
        "layers, slowest rank (s) | layers, mean rank (s) | remainder (s) | replication (s) | vs no replicas | "
        "wall, slowest rank (s) | wall vs no replicas |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios, failed = {}, False
    for skew in skews:
        for name in settings:
            for round_index in range(args.rounds):
                run = runs[f"{round_index} {skew} {name}"]
                parts, rows = run["parts"], run["metrics"]
                baseline = runs[f"{round_index} {skew} {settings[0]}"]["parts"]
                ratio, wall_ratio = parts["step"] / baseline["step"], parts["wall"] / baseline["wall"]
                ratios.setdefault((skew, name), []).append((ratio, wall_ratio))
                aside = metric(rows, "ep/replica_layers_set_aside")
                lines.append(
                    f"| {skew} | {name} | {round_index + 1} | "
                    f"{statistics.median(metric(rows, 'ep/recv_rows_max_over_mean_all_layers')):.2f} | "
                    f"{f'{statistics.mean(aside):.2f}' if aside else '-'} | {parts['step']:.3f} | "
                    f"{parts['layers']:.3f} | {parts['balanced']:.3f} | {parts['remainder']:.3f} | "
                    f"{parts['replication']:.3f} | {ratio:.3f} | {parts['wall']:.3f} | {wall_ratio:.3f} |"
                )
    lines += ["", "The mean rank's CPU time per step (ms; steps after the warm-up, every round), summed over the MoE layers:",
              "", "| routing | setting | router and split, no count exchange | experts forward, no fetch | experts "
              "backward, no return | count exchange | fetch | return | choice | whole step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for skew in skews:
        for name in settings:
            means = mean_segments([runs[f"{round_index} {skew} {name}"]["ranks"] for round_index in range(args.rounds)])
            lines.append(f"| {skew} | {name} | " + " | ".join(f"{1000 * means[part]:.1f}" for part in (
                "router", "experts_forward", "experts_backward", "counts", "fetch", "return", "choice", "total"))
                + " |")
    lines.append("")
    for skew in skews:
        losses = [{row["step"]: row["loss_metrics/global_avg_loss"] for row in runs[f"0 {skew} {name}"]["metrics"]}
                  for name in settings]
        if any(logged.keys() != losses[0].keys() for logged in losses) or not losses[0]:
            worst = float("nan")
        else:
            differences = [abs(other[step] - loss) / abs(loss) for other in losses[1:] for step, loss in losses[0].items()]
            worst = float("nan") if any(map(math.isnan, differences)) else max(differences)
        compared = worst <= LOSS_TOLERANCE
        failed |= not compared
        lines.append(f"{skew}: largest relative loss difference between the arms (round 1) {worst:.1e}"
                     + ("" if compared else f", not within {LOSS_TOLERANCE:g} (or steps missing): the arms did not "
                                            "train alike"))
        for name in settings[1:]:
            summaries = []
            for kind, got in zip(("CPU-time step", "wall"), map(sorted, zip(*ratios[skew, name]))):
                summaries.append(f"{kind} {statistics.median(got):.3f} ({got[0]:.3f}-{got[-1]:.3f})")
            lines.append(f"{skew}, {name} vs no replicas, medians of {args.rounds} rounds: " + "; ".join(summaries))
    return lines + _headroom_lines(runs, args.rounds, skews, settings), failed


def _captured(runs: dict, rounds: int, skew: str, settings: list[str]) -> list[float]:
    """The replicated arm's share of the headroom at ``skew`` per round, ascending
    (:func:`~torchtitan_ext.bench.replication.headroom_captured`), by the CPU-time step."""
    none, replicated = settings
    return sorted(headroom_captured(*([runs[f"{round_index} {routing} {name}"]["parts"]["step"]
                                       for round_index in range(rounds)]
                                      for routing, name in ((skew, none), (FORCED_BALANCE, none), (skew, replicated)))))


def _headroom_lines(runs: dict, rounds: int, skews: list[str], settings: list[str]) -> list[str]:
    """With forced balance: each skew's replicated arm's share of the headroom per round (:func:`_captured`)."""
    if FORCED_BALANCE not in skews:
        return []
    lines = [""]
    for skew in skews:
        if skew == FORCED_BALANCE:
            continue
        captured = _captured(runs, rounds, skew, settings)
        lines.append(f"{skew}, {settings[1]}: headroom captured (CPU-time step) "
                     + (f"{statistics.median(captured):.0%} ({captured[0]:.0%}-{captured[-1]:.0%}) over "
                        f"{len(captured)} round(s)" if captured else "none: forced balance was not faster in any round"))
    return lines


def summary(runs: dict, rounds: int, skews: list[str], settings: list[str]) -> dict[str, float]:
    """The campaign's summary row (medians over the rounds, by the CPU-time step), with forced balance: per skew
    ``alphaA``, the headroom captured (``headroom_captured_alphaA``, ``_low``, ``_high``) and the replicated and
    forced-balance steps over the unreplicated (``replicated_vs_none_alphaA``, ``ideal_vs_none_alphaA``); under forced
    balance, the replicated step over the unreplicated (``balanced_replicated_vs_none``, ``balanced_low``,
    ``balanced_high``) and the share of layer-steps after the warm-up whose replicas stepped aside
    (``balanced_set_aside_share``). Empty without forced balance."""
    if FORCED_BALANCE not in skews:
        return {}
    none, replicated = settings

    def ratios(routing: str, name: str, skew: str) -> list[float]:
        """Per round, ascending: the arm ``routing``, ``name`` over the same round's run without replicas at ``skew``."""
        return sorted(runs[f"{index} {routing} {name}"]["parts"]["step"] / runs[f"{index} {skew} {none}"]["parts"]["step"]
                      for index in range(rounds))

    fields = {}
    for skew in skews:
        if skew == FORCED_BALANCE:
            continue
        key = skew.replace(" ", "")
        captured = _captured(runs, rounds, skew, settings)
        if captured:
            fields.update({f"headroom_captured_{key}": statistics.median(captured),
                           f"headroom_captured_{key}_low": captured[0], f"headroom_captured_{key}_high": captured[-1]})
        fields[f"replicated_vs_none_{key}"] = statistics.median(ratios(skew, replicated, skew))
        fields[f"ideal_vs_none_{key}"] = statistics.median(ratios(FORCED_BALANCE, none, skew))
    balanced = ratios(FORCED_BALANCE, replicated, FORCED_BALANCE)
    aside = [row["ep/replica_layers_set_aside"] for index in range(rounds)
             for row in runs[f"{index} {FORCED_BALANCE} {replicated}"]["metrics"]
             if row["step"] > WARMUP and "ep/replica_layers_set_aside" in row]
    fields.update(balanced_replicated_vs_none=statistics.median(balanced), balanced_low=balanced[0],
                  balanced_high=balanced[-1], balanced_set_aside_share=statistics.mean(aside) if aside else 0.0)
    return fields