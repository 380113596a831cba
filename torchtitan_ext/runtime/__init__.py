"""How a process runs on this machine: the device and process group, every CPU accommodation for
torchtitan 0.2.2, host memory, and failed collectives named by where they happened.

Owns: :mod:`.device` (device choice, :func:`configure`, the CPU + gloo
accommodations), :mod:`.memory` (host-memory monitor, heap policy), :mod:`.cgroups` (the control group's memory limits and
out-of-memory count; no torch), :mod:`.cpu_time` (the machine's busy and idle CPU time; no torch),
:mod:`.collectives` (:class:`CollectiveFailed`), and the one launcher of every command the tests, benches and
checks start (:mod:`.jobs`), the preemption signals a job's supervisor and its ranks share
(:mod:`.preemption`), how a command-line entry point that imports torch starts and ends (:mod:`.entry`), and
the argument parser of every command-line tool (:mod:`.command_line`).

May import: :mod:`torchtitan_ext.config` (see the tiers in :mod:`torchtitan_ext`).
"""

import importlib

_EXPORTS = {
    "adapt_model_parts": "device",
    "configure": "device",
    "device_type": "device",
    "max_local_world_size": "device",
    "keep_freed_memory_in_heap": "memory",
    "release_freed_memory": "memory",
}
"""Name -> the module of this package that defines it. They load on first use: the supervisor imports
:mod:`.preemption`, and it must start without torch (which :mod:`.device` and :mod:`.memory` import)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
