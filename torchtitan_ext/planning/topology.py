"""Cluster topologies for the layout advisor: levels of workers, their links, their compute.

A topology is a TOML file (shipped ones in ``topologies/``; :func:`load_topology` reads one): per-worker
compute, overlap, memory and memory bandwidth, and ``[[levels]]``, innermost first, each with its group
size, bandwidths, latency and link ``fabric``. Ranks are numbered as torchtitan numbers them (the
innermost level's groups are consecutive ranks). Format: docs/planning.md, "Models, topologies, pipelines".
"""

import difflib
import functools
import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from torchtitan_ext.config import ConfigError
from torchtitan_ext.ep.published_rates import FABRICS

SHIPPED = Path(__file__).resolve().parents[2] / "topologies"


Collective = Literal["all_to_all", "all_gather", "reduce_scatter"]


@dataclass(frozen=True)
class Level:
    name: str
    workers: int | None
    """Workers in one group of this level, counting the inner levels' workers (a node of 8 GPUs:
    8; a rack of 64 GPUs: 64). None: the outermost level, whatever the job's size. >= 1."""
    bandwidth_GBps: float
    """Bandwidth per worker, per direction, to a worker whose innermost shared group is this
    level's, in GB/s (1e9 bytes/s). > 0."""
    latency_us: float
    """Time of one collective's start-up over this level (a zero-byte message), in
    microseconds. >= 0."""
    all_gather_bandwidth_GBps: float
    """Bandwidth of an all-gather (FSDP's parameter gather), counted as ``bandwidth_GBps``:
    bytes one worker receives per second, in GB/s. > 0. Defaults to ``bandwidth_GBps`` (gloo's
    all-gather on a CPU is slower than its all-to-all: ``--calibrate`` measures both)."""
    reduce_scatter_bandwidth_GBps: float
    """Bandwidth of a reduce-scatter (FSDP's gradient reduction): bytes one worker sends per
    second, in GB/s. > 0. Defaults to ``bandwidth_GBps``."""
    fabric: str | None = None
    """What kind of link this is, for the EP backends' published kernel rates: "nvlink" (one node's
    NVSwitch), "mnnvl" (GB200 NVL72's multi-node NVLink) or "rdma" (a NIC per GPU); see
    :data:`torchtitan_ext.ep.published_rates.FABRICS`. None: no published figure applies, and every
    backend's all-to-all is priced at ``bandwidth_GBps``."""

    def bandwidth(self, collective: Collective) -> float:
        """Bytes per second of ``collective``: "all_to_all", "all_gather" or "reduce_scatter"."""
        return {
            "all_to_all": self.bandwidth_GBps,
            "all_gather": self.all_gather_bandwidth_GBps,
            "reduce_scatter": self.reduce_scatter_bandwidth_GBps,
        }[collective] * 1e9


@dataclass(frozen=True)
class Topology:
    name: str
    compute_tflops: float
    """Achieved dense matrix-multiply throughput of one worker at the training dtype, in
    TFLOP/s. > 0. Sets the compute that FSDP's expert all-gather can hide behind."""
    overlap: bool
    """Whether communication runs beside compute. True on GPUs (separate streams: FSDP
    prefetches the next all-gather during compute); False on a CPU with gloo, where a
    collective blocks the process and every byte's time adds to the step."""
    levels: tuple[Level, ...]
    """Innermost first."""
    memory_GB: float | None = None
    """Device memory of one worker, GB (1e9 bytes). > 0. The advisor refuses a layout whose rank needs more
    (:attr:`~torchtitan_ext.planning.layout.Layout.memory_bytes`); None: not checked."""
    memory_bandwidth_GBps: float | None = None
    """Device memory bandwidth of one worker, GB/s (nominal). > 0. Prices each EP backend's passes over the token
    rows outside its kernels (:mod:`~torchtitan_ext.planning.local_traffic`); None: not priced."""
    ranks_per_group: int | None = None
    """Ranks a job places in each group of the innermost level when its world size is not a multiple of the
    group (NVL72 racks: 64 of 72 GPUs, 16 of 18 trays, as torchtitan's published 671B run and the shipped GB200
    configs use them). 1 .. that level's workers; ``plan --ranks-per-group`` overrides it. None: such a world
    size is refused."""
    mxfp8_compute_tflops: float | None = None
    """Achieved dense MXFP8 matrix-multiply throughput of one worker, in TFLOP/s, for the GEMMs a job's
    ``quantize.linear.mx`` and ``quantize.grouped_mm.mx`` converters run in MXFP8. > 0. None: the worker has no
    MXFP8 rate given, and those GEMMs are priced at ``compute_tflops``."""
    sms: int | None = None
    """Streaming multiprocessors of one worker. >= 1. Prices the SMs an EP backend's kernels take from the GEMMs
    that run beside them (under overlapped EP, :func:`~torchtitan_ext.planning.cost_model.overlapped_exposure`);
    None: not priced."""
    compute_source: str = ""
    """Where the compute rates come from when not the topology file's own figures (a fit's scale and the rows it
    was fitted on), for the advice's evidence line; empty: the file's."""

    def compute_seconds(self, flops: float, mxfp8_share: float = 0.0) -> float:
        """Seconds of ``flops``, ``mxfp8_share`` of them in MXFP8 GEMMs (at ``mxfp8_compute_tflops`` where given)."""
        mxfp8 = self.mxfp8_compute_tflops or self.compute_tflops
        return flops * ((1 - mxfp8_share) / self.compute_tflops + mxfp8_share / mxfp8) / 1e12

    def scaled(self, scale: float, source: str) -> "Topology":
        """This topology with each compute rate times ``scale`` (a fit's achieved share of them), ``source`` saying
        where the scale comes from."""
        mxfp8 = None if self.mxfp8_compute_tflops is None else self.mxfp8_compute_tflops * scale
        return replace(self, compute_tflops=self.compute_tflops * scale, mxfp8_compute_tflops=mxfp8,
                       compute_source=source)

    def group_sizes(self, world_size: int) -> list[int]:
        """Ranks in one group of each level for a job of ``world_size`` ranks; the last is the job.

        Raises ConfigError when a level's group does not divide the world size.
        """
        sizes = []
        for level in self.levels:
            size = level.workers if level.workers is not None else world_size
            if size > world_size:
                size = world_size
            if world_size % size:
                raise ConfigError(
                    f"topology '{self.name}': level '{level.name}' has workers = {size}, which does not divide "
                    f"the world size {world_size}: use a world size that is a multiple of {size}"
                    + ("" if sizes else ", or say how many ranks the job places in each with --ranks-per-group")
                )
            if sizes and size % sizes[-1]:
                raise ConfigError(
                    f"topology '{self.name}': level '{level.name}' has workers = {size}, not a multiple of the "
                    f"inner level's {sizes[-1]}: each level's group must hold whole groups of the level inside it"
                )
            sizes.append(size)
        if sizes[-1] != world_size:
            raise ConfigError(
                f"topology '{self.name}': its outermost level '{self.levels[-1].name}' holds "
                f"{sizes[-1]} workers but the job has {world_size}: omit workers on the outermost level, "
                "or add a level that connects its groups"
            )
        return sizes

    def placed_for(self, world_size: int, ranks: int | None = None) -> "Topology":
        """This topology as a job of ``world_size`` ranks sees it: ``ranks`` per innermost group when given,
        else :attr:`ranks_per_group` where the world size does not fill whole groups, else as it is."""
        inner = self.levels[0].workers
        if ranks is None and self.ranks_per_group is not None and inner is not None and world_size % inner:
            ranks = self.ranks_per_group
        return self if ranks is None else self.placing(ranks)

    def placing(self, ranks: int) -> "Topology":
        """This topology as a job sees it that places ``ranks`` ranks in each group of the innermost level (a
        256-GPU job on NVL72 racks of 72: 64 per rack), the outer levels' groups holding as many of those
        groups as before. ConfigError when that is more than the group holds."""
        inner = self.levels[0]
        if not 1 <= ranks <= inner.workers:
            raise ConfigError(
                f"--ranks-per-group {ranks}: topology '{self.name}''s level '{inner.name}' holds {inner.workers} "
                f"workers: use a count from 1 to {inner.workers}"
            )
        outer = [replace(level, workers=None if level.workers is None else level.workers // inner.workers * ranks)
                 for level in self.levels[1:]]
        return replace(self, name=f"{self.name}, {ranks} ranks per {inner.name}",
                       levels=(replace(inner, workers=ranks), *outer), ranks_per_group=None)

    def within_kernel_domain(self, ranks: int, backend: str) -> "Topology":
        """This topology as a backend whose kernels reach only ``ranks`` consecutive ranks over the innermost
        level's links sees it: the other ranks of an innermost group are reached over the next level's link
        (a level of its own, named for why). Unchanged when ``ranks`` covers the innermost group, or when
        there is no outer link to use."""
        inner = self.levels[0]
        if len(self.levels) == 1 or ranks >= inner.workers:
            return self
        outer = self.levels[1]
        return replace(self, levels=(
            replace(inner, name=f"{inner.name}, within {backend}'s {ranks}-rank kernel domain", workers=ranks),
            replace(outer, name=f"{outer.name}, used between {backend}'s {ranks}-rank kernel domains inside {inner.name}",
                    workers=inner.workers),
            *self.levels[1:],
        ))

    def rank_levels(self, world_size: int) -> tuple[int, ...]:
        """For each rank of a job of ``world_size`` ranks, the index of the innermost level whose group holds it
        and rank 0 (0 for rank 0 itself): the link rank 0 reaches it over. A group of ranks 0, s, 2s, ... spans
        the level of its last rank."""
        return _rank_levels(tuple(self.group_sizes(world_size)))


@functools.lru_cache(maxsize=64)
def _rank_levels(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """:meth:`Topology.rank_levels` for groups of ``sizes`` ranks (each a multiple of the one inside it): ranks
    below the innermost group's size are level 0, then each level's ranks up to its size. Computed once per
    placement: the advisor reads it for every layout it prices."""
    levels: list[int] = []
    for index, size in enumerate(sizes):
        levels += [index] * (size - len(levels))
    return tuple(levels)


TOP_KEYS = {"name", "compute_tflops", "mxfp8_compute_tflops", "overlap", "levels", "memory_GB", "memory_bandwidth_GBps", "ranks_per_group", "sms"}
LEVEL_KEYS = {"name", "workers", "bandwidth_GBps", "latency_us", "all_gather_bandwidth_GBps",
              "reduce_scatter_bandwidth_GBps", "fabric"}


def _check_keys(table: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}"
        raise ConfigError(f"{where}.{unknown[0]} is not a topology key: {hint}")


def _field(table: dict, key: str, kind, where: str, default=None):
    if key not in table:
        if default is not None:
            return default
        raise ConfigError(f"{where}.{key} is missing: add it (the format: torchtitan_ext/planning/topology.py)")
    value = table[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}.{key} = {value!r}: expected a {kind.__name__}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}.{key} = {value}: use a finite number")
    return value


def _bandwidth(table: dict, key: str, where: str, default: float | None = None) -> float:
    value = _field(table, key, float, where, default)
    if value <= 0:
        raise ConfigError(f"{where}.{key} = {value}: use a bandwidth > 0 (GB/s per worker)")
    return value


def _optional_positive(table: dict, key: str, where: str, fix: str) -> float | None:
    """``table[key]`` as a float > 0, or None where it is left out; else a ConfigError naming it and ``fix``."""
    if key not in table:
        return None
    value = _field(table, key, float, where)
    if value <= 0:
        raise ConfigError(f"{where}.{key} = {value}: {fix}")
    return value


def parse_topology(data: dict, source: str) -> Topology:
    """A Topology from a TOML document's table; every bad field is a ConfigError naming it."""
    _check_keys(data, TOP_KEYS, source)
    compute = _field(data, "compute_tflops", float, source)
    if compute <= 0:
        raise ConfigError(f"{source}.compute_tflops = {compute}: use a throughput > 0 (TFLOP/s per worker)")
    mxfp8 = _optional_positive(data, "mxfp8_compute_tflops", source,
                               "use a throughput > 0 (TFLOP/s per worker), or omit it (MXFP8 GEMMs at compute_tflops)")
    overlap = _field(data, "overlap", bool, source)
    memory = _optional_positive(data, "memory_GB", source, "use the device memory per worker in GB, > 0, or omit it")
    memory_bandwidth = _optional_positive(data, "memory_bandwidth_GBps", source,
                                          "use the device memory bandwidth per worker in GB/s, > 0, or omit it")
    tables = data.get("levels")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{source}.levels is missing or empty: add one [[levels]] table per level, innermost first")
    levels = []
    for index, table in enumerate(tables):
        where = f"{source}.levels[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} = {table!r}: each level is a [[levels]] table with name, workers, bandwidth_GBps, "
                              "latency_us")
        _check_keys(table, LEVEL_KEYS, where)
        name = _field(table, "name", str, where)
        workers = table.get("workers")
        if workers is None and index != len(tables) - 1:
            raise ConfigError(f"{where}.workers is missing: only the outermost level may omit it")
        if workers is not None:
            workers = _field(table, "workers", int, where)
            if workers < 1:
                raise ConfigError(f"{where}.workers = {workers}: use a count >= 1")
            if levels and levels[-1].workers > workers:
                raise ConfigError(f"{where}.workers = {workers}: an outer level holds fewer workers than the one "
                                  f"inside it ({levels[-1].workers}); list levels innermost first")
        bandwidth = _bandwidth(table, "bandwidth_GBps", where)
        latency = _field(table, "latency_us", float, where)
        if latency < 0:
            raise ConfigError(f"{where}.latency_us = {latency}: use a latency >= 0 (microseconds)")
        gather = _bandwidth(table, "all_gather_bandwidth_GBps", where, default=bandwidth)
        scatter = _bandwidth(table, "reduce_scatter_bandwidth_GBps", where, default=bandwidth)
        fabric = _field(table, "fabric", str, where) if "fabric" in table else None
        if fabric is not None and fabric not in FABRICS:
            kinds = "; ".join(f"'{kind}': {meaning}" for kind, meaning in FABRICS.items())
            raise ConfigError(f"{where}.fabric = {fabric!r}: use one of {kinds}; or omit it (nominal rates)")
        levels.append(Level(name, workers, bandwidth, latency, gather, scatter, fabric))
    ranks_per_group = data.get("ranks_per_group")
    if ranks_per_group is not None:
        ranks_per_group = _field(data, "ranks_per_group", int, source)
        inner = levels[0]
        if inner.workers is None:
            raise ConfigError(f"{source}.ranks_per_group = {ranks_per_group}: its only level '{inner.name}' has no "
                              "groups to place ranks in: omit it")
        if not 1 <= ranks_per_group <= inner.workers:
            raise ConfigError(f"{source}.ranks_per_group = {ranks_per_group}: its innermost level '{inner.name}' holds "
                              f"{inner.workers} workers: use a count from 1 to {inner.workers}, or omit it")
    name = _field(data, "name", str, source, default=source)
    sms = data.get("sms")
    if sms is not None:
        sms = _field(data, "sms", int, source)
        if sms < 1:
            raise ConfigError(f"{source}.sms = {sms}: use the worker's count of streaming multiprocessors (>= 1), or omit it")
    return Topology(name, compute, overlap, tuple(levels), memory, memory_bandwidth, ranks_per_group, mxfp8, sms)


def load_topology(spec: str) -> Topology:
    """A topology from a TOML path, or the name of a shipped one (``topologies/<name>.toml``)."""
    path = Path(spec)
    if not path.is_file():
        path = SHIPPED / f"{spec}.toml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.toml")))
        raise ConfigError(f"--topology {spec}: no such file, and not a shipped topology ({shipped})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--topology {path}: not a valid UTF-8 TOML file ({type(e).__name__}: {e})") from None
    return parse_topology(data, path.stem)
