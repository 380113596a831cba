"""Expert replication's ops: home experts' weights to the ranks that hold copies (gradients back home),
and the per-step exchange of pair counts the split is computed from.

Registered with torch (``torchtitan_ext::replica_weights``, ``replica_counts``)
when a job with expert replication builds its first layer. Both are on
selective activation checkpointing's save list, so recomputation repeats
neither collective.

Replica weights move by one all-to-all per direction, unless the EP group's
kernel library moves them itself: a backend registers a
:class:`ReplicaTransport` for its group (DeepEP V2.5's load-balancing kernels,
:mod:`torchtitan_ext.ep.kernels.deep_ep`), and both directions go through it.
"""

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group



class ReplicaTransport(Protocol):
    """Moves one MoE layer's replica weights from home, and their gradients back, for one EP group."""

    def fetch(self, home: torch.Tensor, redundancy_mapping: list[int]) -> torch.Tensor:
        """[slots, F] this rank's replica weights (0 in unused slots) from every rank's ``home`` [L, F]."""

    def return_gradients(self, grad: torch.Tensor, redundancy_mapping: list[int], home_rows: int) -> torch.Tensor:
        """[home_rows, F]: the sum, per home expert of this rank, of its replicas' gradients ``grad`` [slots, F]."""


_transports: dict[str, ReplicaTransport] = {}
"""Group name -> the transport its backend registered (absent: all-to-all)."""


def register_transport(group_name: str, transport: ReplicaTransport | None) -> None:
    """Replica weights of ``group_name`` move through ``transport`` from now on (None: by all-to-all again)."""
    if transport is None:
        _transports.pop(group_name, None)
    else:
        _transports[group_name] = transport


@torch.library.custom_op("torchtitan_ext::replica_weights", mutates_args=())
def replica_weights(
    home: torch.Tensor,
    send_local: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    recv_slot: torch.Tensor,
    redundancy_mapping: list[int],
    slots: int,
    group_name: str,
) -> torch.Tensor:
    """[slots, F] replica weights from ``home`` [L, F] (one flattened expert per row).

    Sends ``home[send_local]`` in that order, ``send_counts[d]`` rows to rank d; receives
    ``recv_counts[s]`` rows from rank s, in order, into replica slots ``recv_slot``. Unused slots are 0.
    ``send_local`` and ``recv_slot``: int64 on ``home``'s device, built once per plan (no copy from the host
    here). ``redundancy_mapping``: the layer's whole plan, rank after rank, each replica slot's home slot
    (-1: unused), which a registered transport moves all ranks' replicas by.
    """
    transport = _transports.get(group_name)
    if transport is not None:
        return transport.fetch(home, redundancy_mapping)
    sent = home.index_select(0, send_local)
    received = home.new_empty((sum(recv_counts), home.shape[1]))
    dist.all_to_all_single(received, sent, recv_counts, send_counts, group=_resolve_process_group(group_name))
    out = home.new_zeros((slots, home.shape[1]))
    return out.index_copy_(0, recv_slot, received)


@replica_weights.register_fake
def _(home, send_local, send_counts, recv_counts, recv_slot, redundancy_mapping, slots, group_name):
    return home.new_empty((slots, home.shape[1]))


def _setup(ctx, inputs, output):
    home, *ctx.args = inputs
    ctx.home_rows = home.shape[0]


def _backward(ctx, grad):
    """Each replica's gradient to its home rank, summed into the home expert's in fp32 and rounded once (an
    expert with many copies would lose low bits at every bf16 addition)."""
    send_local, send_counts, recv_counts, recv_slot, redundancy_mapping, _, group_name = ctx.args
    transport = _transports.get(group_name)
    if transport is not None:
        return transport.return_gradients(grad, redundancy_mapping, ctx.home_rows), *[None] * 7
    returned = grad.index_select(0, recv_slot).contiguous()
    arrived = grad.new_empty((sum(send_counts), grad.shape[1]))
    dist.all_to_all_single(arrived, returned, send_counts, recv_counts, group=_resolve_process_group(group_name))
    # index_add_ has a fixed order under torch.use_deterministic_algorithms (debug.deterministic)
    home_grad = grad.new_zeros((ctx.home_rows, grad.shape[1]), dtype=torch.float32)
    home_grad.index_add_(0, send_local, arrived.float())
    return home_grad.to(grad.dtype), *[None] * 7


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
