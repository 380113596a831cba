"""Expert replication's ops: home experts' weights to the ranks that hold copies, their gradients back home,
and the per-step exchange of pair counts the split is computed from.

Registered with torch (``torchtitan_ext::replica_weights``,
``replica_gradients``, ``replica_counts``) when a job with expert replication
builds its first layer. The two forward ones are on selective activation
checkpointing's save list, so recomputation repeats neither collective.

Replica weights move by one all-to-all per direction, unless the EP group's
kernel library moves them itself: a backend registers a
:class:`~torchtitan_ext.ep.replication.ReplicaTransport` for its group
(:func:`~torchtitan_ext.ep.replication.register_transport`) (DeepEP V2.5's load-balancing kernels,
:mod:`torchtitan_ext.ep.kernels.deep_ep`), and both directions go through it.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan_ext.ep.base import accumulation_dtype
from torchtitan_ext.ep.in_flight import Landing
from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.replication import transports


@torch.library.custom_op("torchtitan_ext::replica_weights", mutates_args=())
def replica_weights(
    home: list[torch.Tensor],
    send_local: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    redundancy_mapping: torch.Tensor,
    slots: int,
    group_name: str,
    what: str,
) -> torch.Tensor:
    """[slots, F] replica weights from ``home``, this rank's experts' parameters (each [L, ...]), read
    where they lie: a slot's row is its expert's weights flattened one after the other (F elements in all).

    Returned in flight, as a functional collective's output: the all-to-all is issued and the caller goes on
    (to the backend's dispatch); ``torch.ops._c10d_functional.wait_tensor`` on the result lands it, and until
    then its rows are not the weights (the experts wait right before their GEMMs,
    :func:`~torchtitan_ext.ep.replication.experts.with_replicas`). Its send rows live until the wait (on a GPU,
    NCCL keeps them until then). Recomputed by activation checkpointing, it lands before it
    returns (:mod:`torchtitan_ext.ep.in_flight`). ``what``: what a failure names ("MoE layer 3 replica fetch
    (NcclExpertParallel)").

    Sends experts ``send_local`` in that order, ``send_counts[d]`` to rank d; receives ``recv_counts[s]``
    from rank s, in order, straight into the replica slots, which a plan lists in that order
    (:class:`~torchtitan_ext.ep.replication.plan.ReplicaPlan`); unused slots, after them, are 0. The index list:
    int64 on the weights' device, built once per plan (no copy from the host here).
    ``redundancy_mapping``: the layer's whole plan, [EP, S] int32 on the weights' device, each replica slot's home
    slot (-1: unused), which a registered transport moves all ranks' replicas by (built once per plan too; its
    fetch lands the same way).
    Not differentiable: the gradients' way home is :func:`replica_gradients`, called by the backward of the
    function that hands the experts their weights (``ep.replication.experts.with_replicas``), which adds them to the
    home experts' own.
    """
    transport = transports.get(group_name)
    if transport is not None:
        out, land = transport.fetch(home, redundancy_mapping)
    else:
        out, land = _fetch_by_all_to_all(home, send_local, send_counts, recv_counts, slots, group_name)
    landing = Landing(out, land, what)
    if recomputing():
        landing.wait()
    return out


def _fetch_by_all_to_all(home, send_local, send_counts, recv_counts, slots, group_name):
    """(the slots' weights, what lands them) through one asynchronous all-to-all of the experts sent, received in
    the slots themselves."""
    # the experts sent, each projection gathered into its columns of the send rows: one copy of them, never of the
    # whole of the home weights
    widths = [weight[0].numel() for weight in home]
    sent = home[0].new_empty((send_local.shape[0], sum(widths)))
    for weight, columns in zip(home, sent.split(widths, dim=1)):
        torch.index_select(weight.reshape(weight.shape[0], -1), 0, send_local, out=columns)
    out = sent.new_empty((slots, sent.shape[1]))
    received = sum(recv_counts)
    out[received:].zero_()
    work = dist.all_to_all_single(out[:received], sent, recv_counts, send_counts,
                                  group=_resolve_process_group(group_name), async_op=True)
    return out, work.wait


@replica_weights.register_fake
def _(home, send_local, send_counts, recv_counts, redundancy_mapping, slots, group_name, what):
    return home[0].new_empty((slots, sum(weight[0].numel() for weight in home)))


@torch.library.custom_op("torchtitan_ext::replica_gradients", mutates_args=())
def replica_gradients(
    grad: torch.Tensor,
    send_local: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    sent_experts: torch.Tensor,
    redundancy_mapping: torch.Tensor,
    home_rows: int,
    group_name: str,
) -> torch.Tensor:
    """[len(sent_experts), F]: for each of this rank's experts with copies elsewhere (``sent_experts``, ascending),
    the sum of its copies' gradients, from every rank's replica slots' gradients (this rank's: ``grad``
    [slots, F]): the reverse of :func:`replica_weights`, with its arguments. Summed in fp32 (fp64 gradients in
    fp64; a registered transport's library sums in fp32): an expert with many copies would lose low bits at every
    bf16 addition, and ``index_add_`` has a fixed order under ``torch.use_deterministic_algorithms``
    (``debug.deterministic``). Narrower gradients are widened ``slots`` rows at a time: a rank whose experts
    every other rank copies receives up to (EP - 1) x min(S, L) of them, and a wide copy of them all would
    triple what they hold. ``home_rows``: this rank's experts (L)."""
    transport = transports.get(group_name)
    if transport is not None:
        return transport.return_gradients(grad, redundancy_mapping, home_rows).index_select(0, sent_experts)
    arrived = grad.new_empty((sum(send_counts), grad.shape[1]))
    # the slots' gradients go back from where they lie, the copies first (a plan's order)
    dist.all_to_all_single(arrived, grad[:sum(recv_counts)], send_counts, recv_counts,
                           group=_resolve_process_group(group_name))
    summed = arrived.new_zeros((sent_experts.shape[0], grad.shape[1]), dtype=accumulation_dtype(grad.dtype))
    rows = torch.searchsorted(sent_experts, send_local)
    step = max(arrived.shape[0] if arrived.dtype == summed.dtype else grad.shape[0], 1)
    for start in range(0, arrived.shape[0], step):
        summed.index_add_(0, rows[start:start + step], arrived[start:start + step].to(summed.dtype))
    return summed


@replica_gradients.register_fake
def _(grad, send_local, send_counts, recv_counts, sent_experts, redundancy_mapping, home_rows, group_name):
    dtype = torch.float32 if transports.get(group_name) is not None else accumulation_dtype(grad.dtype)
    return grad.new_empty((sent_experts.shape[0], grad.shape[1]), dtype=dtype)


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
