"""Each backend's all-to-all rate as measured on the user's cluster, in place of its published figure.

``plan --calibrate-from FILE`` (repeatable; :func:`calibration_rates`) reads ``python -m torchtitan_ext.bench ep
--json`` output (rows of :class:`~torchtitan_ext.records.ep_bench.EPBenchRow`: each backend's dispatch +
combine, on one machine: the innermost link), an nccl-tests ``alltoall_perf`` log (:mod:`.nccl_tests_log`: NCCL's
all-to-all alone, on the link its ranks span), or DeepEP's or HybridEP's own test log (:mod:`.kernel_test_log`:
their kernels' figures, as the published ones the advisor prices by default). Each
measurement becomes the fraction of its link's nominal rate the backend reached (the cost model's time at
the nominal rate over the measured time), per link and per the settings that set the backend's rate; an
nccl-tests size sweep also gives the link's fixed cost per call (:func:`fit_sweep`), which replaces its latency.
See docs/planning.md, "Calibrate it on your own cluster".
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchtitan_ext.config import ConfigError, MoEShape, parse
from torchtitan_ext.ep import PLANNING_PROFILES
from torchtitan_ext.ep.published_rates import PublishedRate
from torchtitan_ext.planning.cost_model import layer_costs, MoEWorkload
from torchtitan_ext.planning.kernel_test_log import KernelTestLog, read_kernel_test_log
from torchtitan_ext.planning.nccl_tests_log import all_to_all_runs
from torchtitan_ext.planning.topology import Topology
from torchtitan_ext.records.ep_bench import BENCH_COMMAND, DTYPE_BYTES, EPBenchRow


@dataclass(frozen=True)
class MeasuredRate:
    """One backend's measured share of one link's nominal rate, at the settings it was timed with."""

    backend: str
    settings: tuple
    """The backend's :meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.rate_settings` in the timed job."""
    level: int
    """Index of the topology level whose link the measured EP group's all-to-all crossed."""
    fraction: float
    """The cost model's time for the measured all-to-alls at the nominal rate over the measured time, in (0, 1]."""
    source: str
    """The row it comes from, for the advice."""
    includes_local_work: bool
    """Whether the measured time holds the backend's local work around its all-to-alls (bench_ep's rows: the
    permutes; an nccl-tests log: no), which ``--measure-compute`` would add a second time."""
    fitted: bool = False
    """Fitted on published comparisons (``plan --fit``), not measured on the cluster."""
    floor_s: float | None = None
    """The fixed cost of one all-to-all call on this link, fitted to an nccl-tests size sweep with the fraction
    (:func:`fit_sweep`), in place of the level's ``latency_us``; None where no sweep measured it."""


def calibration_rates(
    paths: list[Path], topology: Topology, placed: Topology | None = None, shape: MoEShape | None = None,
) -> dict[tuple[str, tuple, int], MeasuredRate]:
    """{(backend, its rate settings, level): the measured rate} from bench_ep JSON files, nccl-tests alltoall_perf
    logs and DeepEP's or HybridEP's test logs (told apart by their content). bench_ep's rows are placed on
    ``topology`` as they ran (whole machines); an nccl-tests run, which spans as many nodes as the job's all-to-all,
    on ``placed``: the topology as the job places its ranks (``plan --ranks-per-group``; default ``topology``).
    ``shape``: the job's, which a test log that prints its own must match. ConfigError, naming the file, for a file
    of no such kind and for two files that measure one rate."""
    rates: dict[tuple[str, tuple, int], MeasuredRate] = {}
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--calibrate-from {path}: not a readable text file ({type(e).__name__}: {e})") from None
        if text.lstrip().startswith("{"):
            found = measured_rates(path, topology, text)
        elif "# Collective test starting: " in text or "# nThread " in text:
            found = nccl_tests_rates(path, topology if placed is None else placed, text)
        elif (log := read_kernel_test_log(path, text)) is not None:
            found = kernel_test_rates(path, topology, log, shape)
        else:
            raise ConfigError(f"--calibrate-from {path}: neither {BENCH_COMMAND} output, an nccl-tests "
                              "alltoall_perf log, nor DeepEP's or HybridEP's test log")
        for key, rate in found.items():
            if key in rates:
                raise ConfigError(f"--calibrate-from {path}: measures {' '.join((key[0], *key[1]))} on "
                                  f"'{topology.levels[key[2]].name}' as {rates[key].source} does: keep one of them")
            rates[key] = rate
    return rates


MIN_SWEEP = 3
"""Message sizes an alltoall_perf run needs for a per-call floor and a bandwidth to be fitted (two unknowns, and
one more size to show a residual); with fewer, its largest message alone gives the fraction, floor included."""


def _nominal_seconds(topology: Topology, ranks: int, size_bytes: int) -> float:
    """The cost model's time for nccl-tests' uniform all-to-all on ``ranks`` ranks at the topology's nominal rates:
    each rank sends ``size_bytes`` split evenly over every rank, itself included."""
    work = MoEWorkload(
        tokens=size_bytes, hidden=1, top_k=1, experts=ranks, expert_parameters=0, activation_bytes=1,
        gather_bytes=1, reduce_bytes=1, pre_expert_flops=0.0, regather_in_backward=False,
    )
    return layer_costs(work, topology, ranks, ranks, 1, False).a2a


def fit_sweep(rows: tuple[tuple[float, float, int], ...]) -> tuple[float, float, list[float]]:
    """(the per-call floor in seconds, the seconds per unit, each row's relative residual) of
    ``time = floor + size x seconds_per_unit`` fitted to ``rows`` (size, microseconds, line or row) by least squares on
    the relative error, so that small messages weigh as much as large ones. The size is a message's bytes (an
    nccl-tests sweep) or its all-to-all's seconds at the nominal rate (bench_ep's shapes: the slope is then one over
    the fraction of the nominal rate reached). A negative floor is taken as 0 (the
    bandwidth refitted through the origin)."""
    sizes = np.array([row[0] for row in rows], dtype=np.float64)
    times = np.array([row[1] for row in rows], dtype=np.float64) * 1e-6
    weights = 1 / times
    (floor, per_byte), *_ = np.linalg.lstsq(np.stack([weights, sizes * weights], axis=1), np.ones_like(times),
                                            rcond=None)
    if floor < 0:
        floor, per_byte = 0.0, float(np.sum(sizes / times) / np.sum((sizes / times) ** 2))
    residuals = ((floor + per_byte * sizes) / times - 1).tolist()
    return float(floor), float(per_byte), residuals


def nccl_tests_rates(path: Path, topology: Topology, text: str) -> dict[tuple[str, tuple, int], MeasuredRate]:
    """{(backend, its rate settings, level): the rate} of each alltoall_perf run in the log ``text``, for every
    backend whose tokens move by the collective all-to-all it times: from a sweep of :data:`MIN_SWEEP` sizes or more,
    the fitted per-call floor and bandwidth (:func:`fit_sweep`); else from its largest message, its floor included
    in the fraction. ConfigError for a
    run the topology cannot place as it ran (ranks of different hosts in one group of a one-node NVLink level), a
    time faster than the nominal rate, or two runs on one link."""
    measured_backends = {
        name: profile.rate_settings(parse(["--parallelism.expert_parallel_comm_backend", name]))
        for name, profile in PLANNING_PROFILES.items() if profile.moves_tokens_with_collective_all_to_all
    }
    rates: dict[tuple[str, tuple, int], MeasuredRate] = {}
    for run in all_to_all_runs(path, text):
        where = f"--calibrate-from {path}: line {run.line}"
        if run.ranks < 2:
            raise ConfigError(f"{where}: an all-to-all on 1 rank moves nothing between ranks: run it on 2 or more")
        try:
            sizes = topology.group_sizes(run.ranks)
        except ConfigError as e:
            raise ConfigError(f"{where}: {run.ranks} ranks: {e}") from None
        for index, level in enumerate(topology.levels):
            for start in range(0, run.ranks, sizes[index]) if level.fabric == "nvlink" else ():
                hosts = set(run.hosts[start:start + sizes[index]])
                if len(hosts) > 1:
                    raise ConfigError(
                        f"{where}: ranks {start}-{start + sizes[index] - 1} ran on hosts {', '.join(sorted(hosts))}, "
                        f"but fill one group of '{level.name}', one node's NVLink: run it with {sizes[index]} "
                        "ranks per node, placed in blocks (mpirun --map-by slot, srun -m block)"
                    )
        level = topology.rank_levels(sizes[-1])[run.ranks - 1]
        link = topology.levels[level].name
        nominal = _nominal_seconds(topology, run.ranks, run.size_bytes)
        sweep = fit_sweep(run.rows) if len({row[0] for row in run.rows}) >= MIN_SWEEP else None
        if sweep is None:
            floor_s = None
            how = f"{run.size_bytes} B, {run.time_us:g} us measured, {nominal * 1e6:.3g} us at the nominal rate"
            fraction = nominal / (run.time_us * 1e-6)
        else:
            # the fitted seconds per byte against the nominal rate's; the floor replaces the level's latency
            floor_s, seconds_per_byte, residuals = sweep
            if seconds_per_byte <= 0:
                raise ConfigError(f"{where}: its times do not grow with the message size (the fitted seconds per byte "
                                  "is not > 0): sweep up to larger messages (alltoall_perf -e of a few hundred MB)")
            nominal_per_byte = (_nominal_seconds(topology, run.ranks, 2 * run.size_bytes) - nominal) / run.size_bytes
            fraction = nominal_per_byte / seconds_per_byte
            how = (f"{len(run.rows)} sizes {min(row[0] for row in run.rows)}-{run.size_bytes} B fitted to a {floor_s * 1e6:.3g} us floor "
                   f"per call and {1 / seconds_per_byte / 1e9:.4g} GB/s, residuals {min(residuals):+.0%} to "
                   f"{max(residuals):+.0%}, {nominal_per_byte * run.size_bytes * 1e6:.3g} us for {run.size_bytes} B "
                   "at the nominal rate")
        if fraction > 1:
            measured = (f"time = {run.time_us:g} us" if sweep is None
                        else f"its sweep's fitted rate ({fraction:.2f} of nominal)")
            raise ConfigError(
                f"{where}: {measured}: faster than the {nominal * 1e6:.3g} us a {run.size_bytes}-byte "
                f"all-to-all takes at the nominal rate of '{link}': it ran on another link, or that level's "
                "bandwidth_GBps is below the link's"
            )
        source = (f"{path.name} line {run.line}: alltoall_perf on {run.ranks} ranks ({len(set(run.hosts))} host(s)), "
                  f"{how}")
        for name, settings in measured_backends.items():
            key = (name, settings, level)
            if key in rates:
                raise ConfigError(f"{where}: a second alltoall_perf run on '{link}' "
                                  f"({rates[key].source}): keep one of them")
            rates[key] = MeasuredRate(name, settings, level, fraction, source, includes_local_work=False,
                                      floor_s=floor_s)
    return rates


def measured_rates(path: Path, topology: Topology, text: str) -> dict[tuple[str, tuple, int], MeasuredRate]:
    """{(backend, its rate settings, level): the measured rate} from a bench_ep JSON file's ``text``, for the rows
    timed between ranks (EP > 1) of a backend the advisor prices. Where :data:`MIN_SWEEP` shapes or more measure one
    backend at one setting on one link, each all-to-all's measured time is fitted to a fixed cost per call plus its
    nominal time over a fraction (:func:`fit_sweep`); with fewer, the row with the most tokens gives the fraction,
    its fixed costs included. ``topology`` as the
    bench ran on it: its processes fill the innermost groups in order. ConfigError, naming the field, for a
    file that is not bench_ep's, for rows that calibrate nothing and for a time faster than the nominal rate."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--calibrate-from {path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    rows = document.get("rows") if isinstance(document, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"--calibrate-from {path}: no 'rows' list: write it with {BENCH_COMMAND}")
    chosen: dict[tuple[str, tuple, int], tuple[int, int, MeasuredRate]] = {}
    sweeps: dict[tuple[str, tuple, int], list[tuple[float, float, int]]] = {}
    for index, row in enumerate(rows):
        where = f"--calibrate-from {path}: rows[{index}]"
        row = EPBenchRow.read(row, where)
        profile = PLANNING_PROFILES.get(row.comm_backend)
        if profile is None or row.ep < 2:
            continue  # torchtitan's own ExpertParallel, or local work without traffic
        processes, ep = row.processes, row.ep
        try:
            job_config = parse(["--parallelism.expert_parallel_comm_backend", row.comm_backend,
                                *map(str, row.job_args)])
        except ConfigError as e:
            raise ConfigError(f"{where}.job_args: {e}") from None
        reach = profile.kernel_nvlink_ranks(job_config)
        if reach is not None and ep > reach:
            raise ConfigError(f"{where}.ep = {ep}: {row.comm_backend}'s kernels reach {reach} ranks over NVLink, "
                              f"and a group of {ep} spans their split: time it at EP <= {reach}")
        try:
            level = topology.rank_levels(processes)[ep - 1]
        except ConfigError as e:
            raise ConfigError(f"{where}.processes = {processes} on topology '{topology.name}': {e}") from None
        element = DTYPE_BYTES[row.dtype]
        work = MoEWorkload(
            tokens=row.tokens, hidden=row.hidden, top_k=row.top_k, experts=row.experts, expert_parameters=0,
            activation_bytes=element, gather_bytes=element, reduce_bytes=element, pre_expert_flops=0.0,
            regather_in_backward=False,
        )
        costs = layer_costs(work, topology, processes, ep, 1, profile.sends_each_token_once_per_rank)
        calls = 2 if row.forward_only else 4
        nominal = costs.a2a * calls
        measured = row.median_ms / 1e3
        if nominal > measured:
            raise ConfigError(
                f"{where}.median_ms = {row.median_ms}: faster than the {nominal * 1e3:.3g} ms its all-to-alls take at "
                f"the nominal rate of '{topology.levels[level].name}': it was timed on another link, or that level's "
                "bandwidth_GBps is below the link's"
            )
        settings = profile.rate_settings(job_config)
        rate = MeasuredRate(
            row.comm_backend, settings, level, nominal / measured,
            f"{path.name} rows[{index}]: T={row.tokens} H={row.hidden} EP={ep}"
            f"{' ' + ' '.join(map(str, row.job_args[2:])) if len(row.job_args) > 2 else ''}, "
            f"{row.median_ms:.3g} ms measured, {nominal * 1e3:.3g} ms at the nominal rate",
            includes_local_work=True,
        )
        key = (row.comm_backend, settings, level)
        if key in chosen and chosen[key][0] == row.tokens:
            raise ConfigError(
                f"{where}: times {row.comm_backend} {' '.join(map(str, settings))} at T={row.tokens} on the link "
                f"rows[{chosen[key][1]}] times it: keep one of them (settings that do not change the backend's rate "
                "calibrate one rate)"
            )
        if key not in chosen or row.tokens > chosen[key][0]:
            chosen[key] = (row.tokens, index, rate)
        # per call: the nominal rate's time without the link's latency, and the measured time
        sweeps.setdefault(key, []).append(
            (costs.a2a - topology.levels[level].latency_us * 1e-6, measured / calls * 1e6, index))
    if not chosen:
        raise ConfigError(f"--calibrate-from {path}: no row times an EP backend between ranks (ep > 1): run "
                          f"{BENCH_COMMAND} with --nproc and --ep-degree >= 2")
    rates = {key: rate for key, (_, _, rate) in chosen.items()}
    for key, sweep in sweeps.items():
        if len({nominal for nominal, _, _ in sweep}) >= MIN_SWEEP:
            floor_s, per_nominal, residuals = fit_sweep(tuple(sweep))
            rows_used = ",".join(str(index) for _, _, index in sweep)
            if per_nominal <= 0:
                raise ConfigError(f"--calibrate-from {path}: rows[{rows_used}] of {key[0]}: their times do not grow "
                                  "with the tokens (the fitted slope is not > 0): time larger shapes")
            rates[key] = replace(
                rates[key], fraction=1 / per_nominal, floor_s=floor_s,
                source=(f"{path.name} rows[{rows_used}]: {len(sweep)} shapes fitted to a {floor_s * 1e6:.3g} us floor "
                        f"per all-to-all and {1 / per_nominal:.2f} of the nominal rate, residuals {min(residuals):+.0%} "
                        f"to {max(residuals):+.0%}"))
            if per_nominal < 1:
                raise ConfigError(f"--calibrate-from {path}: rows[{rows_used}] of {key[0]}: faster than the nominal "
                                  f"rate of '{topology.levels[key[2]].name}' once a fixed cost per call is fitted: "
                                  "they were timed on another link, or that level's bandwidth_GBps is below the link's")
    return rates


def kernel_test_rates(
    path: Path, topology: Topology, log: KernelTestLog, shape: MoEShape | None = None,
) -> dict[tuple[str, tuple, int], MeasuredRate]:
    """{(backend, its rate settings, level): the rate} of a DeepEP or HybridEP test log, read as the library's
    published figures are (:class:`~torchtitan_ext.ep.published_rates.PublishedRate`: dispatch's and combine's
    shares of the nominal rate of the bytes that leave a rank, their harmonic mean): a log with RDMA figures
    calibrates the topology's RDMA level (its NVLink figures count the tokens forwarded from it), one without the
    innermost NVLink level. For every rate setting the library's test times
    (:attr:`~torchtitan_ext.ep.planning_profile.PlanningProfile.test_log_settings`). ConfigError for a shape that
    is not the job's, a link the topology lacks, an unknown node or rank count, or a figure above the nominal rate."""
    where = f"--calibrate-from {path}"
    if shape is not None and log.shape is not None:
        tokens, hidden, top_k = log.shape  # top_k None: a script that prints none, held to no top-k
        if (tokens, hidden, top_k or shape.top_k) != (shape.max_tokens_per_rank, shape.hidden_dim, shape.top_k):
            raise ConfigError(f"{where}: the test ran {tokens} tokens per rank at hidden {hidden}"
                              f"{f', top-k {top_k}' if top_k else ''}; the job's are {shape.max_tokens_per_rank}, "
                              f"{shape.hidden_dim} and top-k {shape.top_k}: rerun it with --num-tokens "
                              f"{shape.max_tokens_per_rank} --hidden {shape.hidden_dim} --num-topk {shape.top_k}")
    fabric = "RDMA" if "RDMA" in log.figures else "NVL"
    kinds = ("rdma",) if fabric == "RDMA" else ("nvlink", "mnnvl")
    level = next((index for index, spec in enumerate(topology.levels) if spec.fabric in kinds), None)
    if level is None or (fabric == "NVL" and level != 0):
        raise ConfigError(f"{where}: {fabric} figures, and topology '{topology.name}' has no "
                          f"{'RDMA' if fabric == 'RDMA' else 'innermost NVLink'} level (fabric = "
                          f"{' or '.join(repr(kind) for kind in kinds)}): use the topology the test ran on")
    units = log.nodes if fabric == "RDMA" else log.ranks_per_node
    if units is None or units < 2:
        name = "nodes" if fabric == "RDMA" else "ranks_per_node"
        raise ConfigError(f"{where}: {'its RDMA figures count the own node' if fabric == 'RDMA' else 'its NVL figures count the own rank'}"
                          f"'s bytes, and the log does not say over how many {'nodes' if fabric == 'RDMA' else 'ranks'} "
                          f"(at least 2): add a line '# {name}: N' with the run's count")
    link = topology.levels[level]
    dispatch, combine = log.figures[fabric]
    figures = PublishedRate(kinds[0], dispatch, combine, link.bandwidth_GBps, units, log.sms, str(path))
    fraction = 2 / (1 / figures.dispatch_fraction + 1 / figures.combine_fraction)
    lines = log.lines[fabric]
    if max(figures.dispatch_fraction, figures.combine_fraction) > 1:
        raise ConfigError(f"{where}: lines {lines[0]} and {lines[1]}: {dispatch:g} and {combine:g} GB/s over {units} "
                          f"{'nodes' if fabric == 'RDMA' else 'ranks'} are above the nominal {link.bandwidth_GBps:g} GB/s of "
                          f"'{link.name}': it ran on another link, or that level's bandwidth_GBps is below the link's")
    shape_checked = "at the job's shape" if shape is not None and log.shape is not None else "its shape not printed: not checked against the job's"
    source = (f"{path.name} lines {lines[0]}, {lines[1]}: {log.backend}'s test, dispatch {dispatch:g} and combine "
              f"{combine:g} GB/s ({fabric}, {units} {'nodes' if fabric == 'RDMA' else 'ranks'}"
              f"{f', {log.sms} SMs' if log.sms else ''}; {shape_checked}), {fraction:.3f} of the nominal rate")
    return {(log.backend, settings, level): MeasuredRate(log.backend, settings, level, fraction, source,
                                                         includes_local_work=False)
            for settings in PLANNING_PROFILES[log.backend].test_log_settings}
