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

    def fetch(self, home: list[torch.Tensor], redundancy_mapping: list[int]) -> torch.Tensor:
        """[slots, F] this rank's replica weights (0 in unused slots) from every rank's ``home`` weights, each
        [L, ...]: a slot's row is its expert's weights flattened, one after the other (F elements in all)."""

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
    home: list[torch.Tensor],
    send_local: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    recv_slot: torch.Tensor,
    sent_experts: torch.Tensor,
    redundancy_mapping: list[int],
    slots: int,
    group_name: str,
) -> torch.Tensor:
    """[slots, F] replica weights from ``home``, this rank's experts' weights (w1, w2, w3: each [L, ...]), read
    where they lie: a slot's row is its expert's weights flattened one after the other (F elements in all).

    Sends experts ``send_local`` in that order, ``send_counts[d]`` to rank d; receives ``recv_counts[s]``
    from rank s, in order, into replica slots ``recv_slot``. Unused slots are 0. ``sent_experts``: the distinct
    experts of ``send_local``, ascending (backward sums their copies' gradients). The index lists: int64 on the
    weights' device, built once per plan (no copy from the host here).
    ``redundancy_mapping``: the layer's whole plan, rank after rank, each replica slot's home slot (-1: unused),
    which a registered transport moves all ranks' replicas by.
    """
    transport = _transports.get(group_name)
    if transport is not None:
        return transport.fetch(home, redundancy_mapping)
    # only the experts sent are copied, never the whole of the home weights
    sent = torch.cat([weight.reshape(weight.shape[0], -1).index_select(0, send_local) for weight in home], dim=1)
    received = sent.new_empty((sum(recv_counts), sent.shape[1]))
    dist.all_to_all_single(received, sent, recv_counts, send_counts, group=_resolve_process_group(group_name))
    out = sent.new_zeros((slots, sent.shape[1]))
    return out.index_copy_(0, recv_slot, received)


@replica_weights.register_fake
def _(home, send_local, send_counts, recv_counts, recv_slot, sent_experts, redundancy_mapping, slots, group_name):
    return home[0].new_empty((slots, sum(weight[0].numel() for weight in home)))


def _setup(ctx, inputs, output):
    home, *ctx.args = inputs
    ctx.home_shapes = [weight.shape for weight in home]


def _backward(ctx, grad):
    """Each replica's gradient to its home rank, summed into the home expert's in fp32 and rounded once (an
    expert with many copies would lose low bits at every bf16 addition); one gradient per home weight, zero but for
    the experts sent. The fp32 sums hold the experts sent alone (a rank's home experts outnumber those it sends), and
    fp32 gradients take them in place."""
    send_local, send_counts, recv_counts, recv_slot, sent_experts, redundancy_mapping, _, group_name = ctx.args
    home_rows = ctx.home_shapes[0][0]
    columns = [shape[1:].numel() for shape in ctx.home_shapes]
    transport = _transports.get(group_name)
    if transport is not None:
        summed = transport.return_gradients(grad, redundancy_mapping, home_rows).split(columns, dim=1)
        return [part.to(grad.dtype).reshape(shape) for part, shape in zip(summed, ctx.home_shapes)], *[None] * 8
    returned = grad.index_select(0, recv_slot).contiguous()
    arrived = grad.new_empty((sum(send_counts), grad.shape[1]))
    dist.all_to_all_single(arrived, returned, send_counts, recv_counts, group=_resolve_process_group(group_name))
    sum_row = None if grad.dtype == torch.float32 else torch.searchsorted(sent_experts, send_local)
    # index_add_ has a fixed order under torch.use_deterministic_algorithms (debug.deterministic)
    home_grads = []
    for part, shape in zip(arrived.split(columns, dim=1), ctx.home_shapes):
        home = grad.new_zeros((home_rows, part.shape[1]))
        if sum_row is None:
            home.index_add_(0, send_local, part)
        else:
            summed = part.new_zeros((sent_experts.shape[0], part.shape[1]), dtype=torch.float32)
            home.index_copy_(0, sent_experts, summed.index_add_(0, sum_row, part.float()).to(grad.dtype))
        home_grads.append(home.view(shape))
    return home_grads, *[None] * 8


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
