"""The machine's busy and idle CPU time since boot, every core, from /proc/stat (Linux): what the benchmarks of the
suite's time read before and after a command or a test. Imports no torch: the suite-CPU plugin loads it in pytest."""

import os
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def check_cpu_time_readable() -> None:
    """Refuse, before anything is measured, a machine without /proc/stat (not Linux)."""
    # imported here: torchtitan_ext.config imports torchtitan, which the plugin that reads the CPU time must not
    from torchtitan_ext.config import ConfigError

    if not PROC_STAT.exists():
        raise ConfigError(f"{PROC_STAT} is missing: the machine's CPU time is read from it; run on Linux")


def cpu_seconds() -> tuple[float, float]:
    """(busy, idle) CPU-s of every core since boot: the first line of /proc/stat, its clock ticks in seconds. Busy
    counts user, nice, system, interrupt and stolen time; idle counts waits for I/O too."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, PROC_STAT.read_text().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick
