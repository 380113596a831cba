"""Reading the text log of nccl-tests' ``alltoall_perf`` (NVIDIA/nccl-tests, v2.16.7 or later).

A log holds one run per ``# Collective test starting: PROGRAM`` line up to its
``# Collective test concluded`` line: the ranks (``#  Rank  r Group  g Pid  p
on  HOST device  d ...``, in MPI rank order) and, after the column header, one
row per message size (``size  count  type  redop  root  time  algbw  busbw
#wrong``, out-of-place first, then the in-place half and any per-iteration or
timestamp columns; ``size`` is the bytes each rank sends, split evenly among
all ranks, itself included; ``time`` is in microseconds). Other lines (NCCL's
own INFO output, launcher banners) are skipped, and a launcher's rank prefix
(``srun -l``: ``0: ``) is dropped. This module reads those facts and nothing
else: what they say about a link is :mod:`.measured_rates`' business. Every
malformed part is a ConfigError naming its line.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ext.config import ConfigError

LAUNCHER_PREFIX = re.compile(r"^\d+:\s?(?=#|\s)")
START = re.compile(r"^# Collective test starting: (\S+)\s*$")
CONCLUDED = re.compile(r"^# Collective test concluded: ")
RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+")
HEADER = re.compile(r"^#\s+size\s+count\s+type\s+redop\s+root\s+(\S+)\s+algbw\s+busbw\s+#wrong")
ROW_START = re.compile(r"^\s*\d+\s")
ROW = re.compile(r"^\s*(\d+)\s+\d+\s+[A-Za-z]\w*\s+[A-Za-z]\w*\s+-?\d+\s+(\S+)\s+\S+\s+\S+\s+(\S+)(\s+\S+){4,}\s*$")
PROGRAM = "alltoall_perf"
"""Its binary's name: a build's NAME_SUFFIX (``alltoall_perf_mpi``) may follow."""


@dataclass(frozen=True)
class AllToAllRun:
    """One ``alltoall_perf`` run of a log: where its ranks ran, its largest message, and every message size."""

    hosts: tuple[str, ...]
    """The host of each rank, in rank order."""
    size_bytes: int
    """The largest message measured: bytes each rank sends (to all ranks, itself included)."""
    time_us: float
    """Its out-of-place time, microseconds (nccl-tests' average over its iterations)."""
    line: int
    """The row's line number in the log (1-based), for messages."""
    rows: tuple[tuple[int, float, int], ...] = ()
    """(bytes each rank sends, out-of-place microseconds, line) of every message size of more than 0 bytes, in the
    log's order: the sweep a per-call floor and a bandwidth are fitted to."""

    @property
    def ranks(self) -> int:
        return len(self.hosts)


def _row(line: str, where: str) -> tuple[int, float]:
    """(size, out-of-place time) of a result row."""
    row = ROW.match(line)
    if row is None:
        raise ConfigError(f"{where}: not an nccl-tests result row (size count type redop root time algbw busbw #wrong "
                          "and the in-place half)")
    size, time_text, wrong = row.group(1), row.group(2), row.group(3)
    try:
        time_us = float(time_text)
    except ValueError:
        raise ConfigError(f"{where}: time = {time_text!r} is not a number") from None
    if wrong not in ("0", "N/A"):
        raise ConfigError(f"{where}: #wrong = {wrong}: the all-to-all delivered wrong data; fix the cluster "
                          "before timing it")
    if not (math.isfinite(time_us) and time_us > 0):
        raise ConfigError(f"{where}: time = {time_text} us: a measured time is > 0")
    return int(size), time_us


class _Run:
    """A run being read: its start line, ranks, groups and largest row so far."""

    def __init__(self, line: int):
        self.line = line
        self.hosts: dict[int, str] = {}
        self.groups: set[int] = set()
        self.in_table = False
        self.best: tuple[int, float, int] | None = None
        self.rows: list[tuple[int, float, int]] = []

    def finished(self, path: Path) -> AllToAllRun:
        where = f"--calibrate-from {path}: the {PROGRAM} run at line {self.line}"
        if sorted(self.hosts) != list(range(len(self.hosts))) or not self.hosts:
            raise ConfigError(f"{where} lists ranks {sorted(self.hosts)}: expected every rank from 0 (a log cut short?)")
        if len(self.groups) > 1:
            raise ConfigError(f"{where} splits its ranks into groups {sorted(self.groups)}: run one all-to-all over all "
                              "of them (NCCL_TESTS_SPLIT and NCCL_TESTS_SPLIT_MASK unset)")
        if self.best is None:
            raise ConfigError(f"{where} has no result row")
        size, time_us, line = self.best
        if size == 0:
            raise ConfigError(f"--calibrate-from {path}: line {line}: its largest message is 0 bytes (each peer's "
                              "share rounds down to 16 bytes): run alltoall_perf with -e of at least a few MB")
        return AllToAllRun(tuple(self.hosts[rank] for rank in range(len(self.hosts))), size, time_us, line,
                           tuple(row for row in self.rows if row[0] > 0))


def all_to_all_runs(path: Path, text: str) -> list[AllToAllRun]:
    """Each ``alltoall_perf`` run in ``text`` (the log at ``path``). ConfigError, naming the line, for a run of
    another collective, CPU times, ranks split in several communicators, a row with wrong data, a run that did
    not conclude, or a log without a run."""
    runs: list[AllToAllRun] = []
    run: _Run | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = LAUNCHER_PREFIX.sub("", raw, count=1)
        where = f"--calibrate-from {path}: line {number}"
        if (start := START.match(line)) is not None:
            if run is not None:
                raise ConfigError(f"--calibrate-from {path}: the {PROGRAM} run at line {run.line} did not conclude "
                                  "(no '# Collective test concluded' line before the next run): it failed")
            if not start.group(1).startswith(PROGRAM):
                raise ConfigError(f"{where}: a {start.group(1)} run: the advisor calibrates the all-to-all, run "
                                  f"nccl-tests' {PROGRAM}")
            run = _Run(number)
        elif run is None:
            continue
        elif CONCLUDED.match(line):
            runs.append(run.finished(path))
            run = None
        elif (rank := RANK.match(line)) is not None:
            run.hosts[int(rank.group(1))] = rank.group(3)
            run.groups.add(int(rank.group(2)))
        elif (header := HEADER.match(line)) is not None:
            if header.group(1) != "time":
                raise ConfigError(f"{where}: the run reports {header.group(1)} (-C 1): time the GPUs, without -C")
            run.in_table = True
        elif run.in_table and ROW_START.match(line):
            size, time_us = _row(line, where)
            run.rows.append((size, time_us, number))
            if run.best is None or size > run.best[0]:
                run.best = (size, time_us, number)
    if run is not None:
        raise ConfigError(f"--calibrate-from {path}: the {PROGRAM} run at line {run.line} did not conclude (no "
                          "'# Collective test concluded' line): it failed, or the log is cut short")
    if not runs:
        raise ConfigError(f"--calibrate-from {path}: no '# Collective test starting: {PROGRAM}' line: write the log "
                          f"with nccl-tests' {PROGRAM} (v2.16.7 or later prints that line)")
    return runs
