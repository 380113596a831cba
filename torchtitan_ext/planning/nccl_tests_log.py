"""Reading the text log of nccl-tests' ``alltoall_perf`` (NVIDIA/nccl-tests, v2.16.7 or later).

A log holds one run per ``# Collective test starting: PROGRAM`` line: the
ranks (``#  Rank  r Group  g Pid  p on  HOST device  d ...``) and one row per
message size (``size  count  type  redop  root  time  algbw  busbw  #wrong``,
out-of-place first; ``size`` is the bytes each rank sends, split evenly
among all ranks, itself included; ``time`` is in microseconds). This module
reads those facts and nothing else: what they say about a link is
:mod:`.measured_rates`' business. Every malformed part is a ConfigError
naming the line.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

from torchtitan_ext.config import ConfigError

START = re.compile(r"^# Collective test starting: (\S+)\s*$")
RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+")
OUT_OF_BOUNDS = re.compile(r"^# Out of bounds values\s*:\s*(\d+)")
ALL_TO_ALL_PROGRAMS = ("alltoall_perf", "alltoall_perf_mpi")


@dataclass(frozen=True)
class AllToAllRun:
    """One ``alltoall_perf`` run of a log: where its ranks ran and its largest message."""

    hosts: tuple[str, ...]
    """The host of each rank, in rank order."""
    size_bytes: int
    """The largest message measured: bytes each rank sends (to all ranks, itself included)."""
    time_us: float
    """Its out-of-place time, microseconds (nccl-tests' average over its iterations)."""
    line: int
    """The row's line number in the log (1-based), for messages."""

    @property
    def ranks(self) -> int:
        return len(self.hosts)


def _row(fields: list[str], where: str) -> tuple[int, float]:
    """(size, out-of-place time) of a result row."""
    if (len(fields) < 13 or not (fields[0].isdigit() and fields[1].isdigit()) or fields[2][0].isdigit()
            or fields[3][0].isdigit() or not fields[4].lstrip("-").isdigit()):
        raise ConfigError(f"{where}: not an nccl-tests result row (size count type redop root time algbw busbw #wrong)")
    try:
        time_us = float(fields[5])
    except ValueError:
        raise ConfigError(f"{where}: time = {fields[5]!r} is not a number") from None
    if fields[8] not in ("0", "N/A"):
        raise ConfigError(f"{where}: #wrong = {fields[8]}: the all-to-all delivered wrong data; fix the cluster "
                          "before timing it")
    if not (math.isfinite(time_us) and time_us > 0):
        raise ConfigError(f"{where}: time = {fields[5]} us: a measured time is > 0")
    return int(fields[0]), time_us


def all_to_all_runs(path: Path, text: str) -> list[AllToAllRun]:
    """Each ``alltoall_perf`` run in ``text`` (the log at ``path``). ConfigError, naming the line, for a run of
    another collective, ranks split in several communicators, a row with wrong data, out-of-bounds values,
    or a log without a run."""
    runs: list[AllToAllRun] = []
    program = None
    hosts: dict[int, str] = {}
    groups: set[int] = set()
    best: tuple[int, float, int] | None = None

    def finish() -> None:
        if program is None:
            return
        where = f"--calibrate-from {path}: the {program} run"
        if best is None:
            raise ConfigError(f"{where} has no result row: the log ends before its first size")
        if sorted(hosts) != list(range(len(hosts))) or not hosts:
            raise ConfigError(f"{where} lists ranks {sorted(hosts)}: expected every rank from 0 (a log cut short?)")
        if len(groups) > 1:
            raise ConfigError(f"{where} splits its ranks into groups {sorted(groups)}: run one all-to-all over all "
                              "of them (NCCL_TESTS_SPLIT unset)")
        runs.append(AllToAllRun(tuple(hosts[rank] for rank in range(len(hosts))), best[0], best[1], best[2]))

    for number, line in enumerate(text.splitlines(), start=1):
        where = f"--calibrate-from {path}: line {number}"
        if (start := START.match(line)) is not None:
            finish()
            program, hosts, groups, best = start.group(1), {}, set(), None
            if program not in ALL_TO_ALL_PROGRAMS:
                raise ConfigError(f"{where}: a {program} run: the advisor calibrates the all-to-all, run "
                                  "nccl-tests' alltoall_perf")
        elif program is None or not line.strip():
            continue
        elif (rank := RANK.match(line)) is not None:
            hosts[int(rank.group(1))] = rank.group(3)
            groups.add(int(rank.group(2)))
        elif (bounds := OUT_OF_BOUNDS.match(line)) is not None and int(bounds.group(1)):
            raise ConfigError(f"{where}: {bounds.group(1)} out-of-bounds values: the all-to-all delivered wrong "
                              "data; fix the cluster before timing it")
        elif not line.startswith("#"):
            row = _row(line.split(), where)
            if best is None or row[0] > best[0]:
                best = (*row, number)
    finish()
    if not runs:
        raise ConfigError(f"--calibrate-from {path}: no '# Collective test starting: alltoall_perf' line: write the "
                          "log with nccl-tests' alltoall_perf (v2.16.7 or later prints that line)")
    return runs
