"""How a process runs on this machine: the device and process group, every CPU accommodation for
torchtitan 0.2.2, host memory, and failed collectives named by where they happened.

Owns: :mod:`.device` (device choice, :func:`configure`, the CPU + gloo
accommodations), :mod:`.memory` (host-memory monitor, heap policy),
:mod:`.collectives` (:class:`CollectiveFailed`), and the one launcher of every command the tests, benches and
checks start (:mod:`.jobs`).

May import: :mod:`torchtitan_ext.config` (see the tiers in :mod:`torchtitan_ext`).
"""

from torchtitan_ext.runtime.device import adapt_model_parts, configure, device_type, max_local_world_size
from torchtitan_ext.runtime.memory import keep_freed_memory_in_heap, release_freed_memory

__all__ = [
    "adapt_model_parts",
    "configure",
    "device_type",
    "keep_freed_memory_in_heap",
    "max_local_world_size",
    "release_freed_memory",
]
