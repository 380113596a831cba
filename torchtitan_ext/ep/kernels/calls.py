"""Calls into a kernel library, announced, so that a count of what a GPU step pays can tell the library's work from
ours (:mod:`torchtitan_ext.measuring.device_ledger`).

The adapters wrap each call into deep_ep, or into the reference kernels that stand for it on a CPU, in
:func:`kernel_call`, which states how many times the real library makes the host wait during that call (its pinned
sources say; ep-kernel-contract.md). What runs inside is the library's: the reference's own host work and
collectives are not what a GPU pays, the declared syncs are.
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()

LISTENERS: list[Callable[[str, int], None]] = []
"""Called with (call name, host syncs the library makes in it) after each outermost kernel call."""


def inside_kernel() -> bool:
    """Whether the code running now is a kernel library's work (in this thread)."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def library_work() -> Iterator[None]:
    """Run the library's own work that finishes a call made earlier (an asynchronous combine landing)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextmanager
def kernel_call(name: str, host_syncs: int = 0) -> Iterator[None]:
    """One call into the library, e.g. "hybridep.dispatch_with_permute"; ``host_syncs``: how many times the real
    library makes the host wait for the device in it."""
    outermost = not inside_kernel()
    with library_work():
        yield
    if outermost:
        for listener in list(LISTENERS):
            listener(name, host_syncs)
