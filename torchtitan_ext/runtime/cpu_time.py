"""The machine's busy and idle CPU time since boot, every core, from /proc/stat (Linux): what the benchmarks of the
suite's time read before and after a command or a test. Imports no torch: the suite-CPU plugin loads it in pytest."""

import os
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_seconds() -> tuple[float, float]:
    """(busy, idle) CPU-s of every core since boot: the first line of /proc/stat, its clock ticks in seconds. Busy
    counts user, nice, system, interrupt and stolen time; idle counts waits for I/O too."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, PROC_STAT.read_text().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick
