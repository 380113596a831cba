"""Collective results returned before they land: combines, which land after the MoE's shared experts have
run, and the replica weights' fetch (:mod:`torchtitan_ext.ep.replication.transport`), which lands right before
the experts.

A backend whose combine can run asynchronously (all-to-alls started with
``async_op=True``; DeepEP's combine with ``async_finish=True``) returns the
combined tokens before their data has landed. This module gives such a tensor
the semantics of torch's own functional collectives: a c10d ``Work`` registered
for it, and an ``AsyncCollectiveTensor`` wrapper whose first use (any op but a
view) waits for that work. The MoE layer computes its shared experts before it
first uses the routed output, as torchtitan's MoE does, so they run while the
combine is in flight; any other caller waits at first use and sees ordinary
values. As with functional collectives, reading the storage without an op
(``torch.save``, ``data_ptr``, ``numpy``) before a wait sees unlanded data.

Backward never reads unlanded rows: a combine op's backward waits for its
landing first, and an op recomputed by activation checkpointing (inside
backward, where nothing would overlap and early stopping may skip the first
use) lands before it returns.
"""

from collections.abc import Callable

import torch
from torch._C._distributed_c10d import _register_work, Work
from torch._library.opaque_object import OpaqueBase, register_opaque_type
from torch.distributed._functional_collectives import _maybe_wrap_tensor

from torchtitan_ext.runtime.collectives import naming_collective


class Landing(OpaqueBase):
    """Finishes one in-flight collective's result, once: waits for its
    communication, then writes what the result needs (a combine's sums; a
    library's fetched replicas, copied into their slots).

    The combine custom op returns it with its outputs, so that the op's backward
    (and selective activation checkpointing's cache) hold the very landing of
    the outputs they use.
    """

    def __init__(self, tensor: torch.Tensor, land: Callable[[], None], what: str = "an MoE layer's combine"):
        """``land`` makes ``tensor`` valid; it runs at the first wait (on ``tensor`` or this landing). ``what``: what
        it completes, for error messages ("MoE layer 3 combine (NcclExpertParallel)")."""
        self._tensor: torch.Tensor | None = tensor
        self._land = land
        self.what = what
        _register_work(tensor, _LandingWork(self))

    @classmethod
    def traced(cls, what: str) -> "Landing":
        """The landing a combine op's fake implementation returns while it is traced: no tensor, nothing to land."""
        landing = cls.__new__(cls)
        landing._tensor = landing._land = None
        landing.what = what
        return landing

    def wait(self) -> None:
        """Land now if nothing has yet (also releases the tensor's entry in c10d's work registry)."""
        if self._tensor is not None:
            torch.ops._c10d_functional.wait_tensor(self._tensor)

    def _land_now(self) -> None:
        if self._tensor is None:
            return
        tensor, land = self._tensor, self._land
        self._tensor = self._land = None
        # landing completes the op's output rather than modifying it: selective
        # activation checkpointing, which cached that output, must not see a mutation
        with torch.autograd._unsafe_preserve_version_counter(tensor), naming_collective(self.what):
            land()


class _LandingWork(Work):
    """The c10d face of a :class:`Landing`, for ``wait_tensor``."""

    def __init__(self, landing: Landing):
        super().__init__()
        self._landing = landing

    def wait(self, timeout=None) -> bool:
        self._landing._land_now()
        return True


register_opaque_type(Landing, typ="reference")


def in_flight(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the output of a combine op, registered by its :class:`Landing`) as a tensor that waits at first use."""
    return _maybe_wrap_tensor(tensor)
