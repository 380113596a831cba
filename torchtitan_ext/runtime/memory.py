"""Host memory of a CPU process: a stand-in for torchtitan's CUDA memory monitor, and glibc's heap policy."""

import ctypes
import ctypes.util
import os
import platform
import resource

import torch
import torchtitan.components.metrics as tt_metrics

from torchtitan_ext.runtime import cgroups

_GIB = 1024**3
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


class CPUMemoryMonitor:
    """Host-memory stand-in for torchtitan's CUDA ``DeviceMemoryMonitor``.

    Reports this process's resident set size: "active" is the current RSS and
    "reserved" the peak RSS (VmHWM) since the last reset, both against the
    memory the process may hold (:func:`memory_limit_bytes`).
    """

    def __init__(self):
        self.device_name = f"cpu ({platform.processor() or platform.machine()})"
        self.device_capacity = memory_limit_bytes()
        self.device_capacity_gib = self.device_capacity / _GIB

    def get_peak_stats(self) -> tt_metrics.DeviceMemStats:
        current, peak = _rss_bytes()
        return tt_metrics.DeviceMemStats(
            max_active_gib=current / _GIB,
            max_active_pct=100 * current / self.device_capacity,
            max_reserved_gib=peak / _GIB,
            max_reserved_pct=100 * peak / self.device_capacity,
            num_alloc_retries=0,
            num_ooms=0,
        )

    def reset_peak_stats(self) -> None:
        # Writing 5 to clear_refs resets VmHWM on Linux; elsewhere the peak is run-long.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def physical_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes() -> int:
    """The memory this process's jobs may hold: the machine's physical memory, or its control group's limit where
    that is lower."""
    limit = cgroups.memory_limit()
    return min(physical_memory_bytes(), limit) if limit is not None else physical_memory_bytes()


def swap_bytes() -> int:
    """The machine's swap space (0 where not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_memory_bytes() -> int:
    """The most that a CPU job's processes can hold together: :func:`memory_limit_bytes` and the swap they may use
    (the machine's, or less where their control group limits it)."""
    swap, swap_limit = swap_bytes(), cgroups.swap_limit()
    total = memory_limit_bytes() + (min(swap, swap_limit) if swap_limit is not None else swap)
    memory_and_swap = cgroups.memory_and_swap_limit()
    return min(total, memory_and_swap) if memory_and_swap is not None else total


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    try:
        with open("/proc/self/status") as f:
            kib = {
                key: int(value.split()[0])
                for key, _, value in (line.partition(":") for line in f)
                if key in ("VmRSS", "VmHWM")
            }
        return kib["VmRSS"] * 1024, max(kib["VmHWM"], kib["VmRSS"]) * 1024
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory_in_heap() -> None:
    """Keep freed blocks in glibc's heap instead of returning them to the kernel.

    New large tensors then reuse pages that are already mapped instead of
    page-faulting fresh ones on first touch (a 67 MB ``index_select``: 15 ms
    instead of 50 ms), at the cost of a resident set that never shrinks and
    grows with heap fragmentation. Training does not call this: with it,
    torchtitan's own DeepSeek-V3 debug TOML (8 x 2048 tokens per rank) ran out
    of 24 GiB with 2 processes, where each peaks at 11.7 GiB without it. The
    benchmarks call it, so that page faults do not drown what they compare.
    """
    libc = _libc()
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the kernel (CPU runs only; a no-op on CUDA).

    For a program that kept freed memory (:func:`keep_freed_memory_in_heap`)
    and changes working set, like a benchmark sweeping shapes.
    """
    if not torch.cuda.is_available():
        _libc().malloc_trim(0)
