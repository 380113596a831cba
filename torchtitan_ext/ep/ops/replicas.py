"""Expert replication's ops: home experts' weights to the ranks that hold copies (gradients back home),
and the per-step exchange of pair counts the split is computed from.

Registered with torch (``torchtitan_ext::replica_weights``, ``replica_counts``)
when a job with expert replication builds its first layer. Both are on
selective activation checkpointing's save list, so recomputation repeats
neither collective.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan_ext.ep.base import to_device


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """Host indices on ``device`` without making the host wait (pinned, non-blocking)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


@torch.library.custom_op("torchtitan_ext::replica_weights", mutates_args=())
def replica_weights(
    home: torch.Tensor,
    send_local: list[int],
    send_counts: list[int],
    recv_counts: list[int],
    recv_slot: list[int],
    slots: int,
    group_name: str,
) -> torch.Tensor:
    """[slots, F] replica weights from ``home`` [L, F] (one flattened expert per row).

    Sends ``home[send_local]`` in that order, ``send_counts[d]`` rows to rank d; receives
    ``recv_counts[s]`` rows from rank s, in order, into replica slots ``recv_slot``. Unused slots are 0.
    """
    sent = home.index_select(0, _indices(send_local, home.device))
    received = home.new_empty((sum(recv_counts), home.shape[1]))
    dist.all_to_all_single(received, sent, recv_counts, send_counts, group=_resolve_process_group(group_name))
    out = home.new_zeros((slots, home.shape[1]))
    return out.index_copy_(0, _indices(recv_slot, home.device), received)


@replica_weights.register_fake
def _(home, send_local, send_counts, recv_counts, recv_slot, slots, group_name):
    return home.new_empty((slots, home.shape[1]))


def _setup(ctx, inputs, output):
    home, *ctx.args = inputs
    ctx.home_rows = home.shape[0]


def _backward(ctx, grad):
    """Each replica's gradient to its home rank, summed into the home expert's."""
    send_local, send_counts, recv_counts, recv_slot, _, group_name = ctx.args
    device = grad.device
    returned = grad.index_select(0, _indices(recv_slot, device)).contiguous()
    arrived = grad.new_empty((sum(send_counts), grad.shape[1]))
    dist.all_to_all_single(arrived, returned, send_counts, recv_counts, group=_resolve_process_group(group_name))
    home_grad = grad.new_zeros((ctx.home_rows, grad.shape[1]))
    home_grad.index_add_(0, _indices(send_local, device), arrived)
    return home_grad, None, None, None, None, None, None


replica_weights.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("torchtitan_ext::replica_counts", mutates_args=())
def replica_counts(local: torch.Tensor, group_name: str) -> torch.Tensor:
    """[ranks, E]: every rank's pairs per home slot (``local`` [E] is this rank's), gathered over the group."""
    group = _resolve_process_group(group_name)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered)


@replica_counts.register_fake
def _(local, group_name):
    return local.new_empty((dist.get_world_size(_resolve_process_group(group_name)), local.shape[0]))
