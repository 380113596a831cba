"""The EP layers' device counters as an op: a count that skips activation checkpointing's recompute, from inside
compiled code too (the recompute is known only when the op runs)."""

import torch

from torchtitan_ext.ep.recompute import recomputing


@torch.library.custom_op("torchtitan_ext::count_once", mutates_args=("total",))
def count_once(total: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> None:
    """``total.index_add_(0, index, values)`` (``total += values`` without ``index``), except while activation
    checkpointing recomputes a forward (each pass counts once)."""
    if recomputing():
        return
    if index is None:
        total.add_(values.to(total.dtype))
    else:
        total.index_add_(0, index, values.to(total.dtype))


@count_once.register_fake
def _(total, index, values):
    return None
