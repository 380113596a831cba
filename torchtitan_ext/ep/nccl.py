"""The ``nccl`` backend: all-to-all over torch.distributed (NCCL on GPU, gloo on CPU).

torchtitan's "standard" backend, restructured so that communication itself
produces the expert-major layout. Each rank sorts its (token, expert) pairs
by (local expert index, destination rank) and gathers their rows once; then
one all-to-all per local expert index e moves every rank's rows for its
expert e straight into that expert's group of the output, in source-rank
order, padded to the grouped-GEMM alignment (at least 8 rows; 16 for FP8 and
32 for MXFP8 grouped GEMMs). There is no receive-side permutation. Combine
sends each expert group back the same way into the pairs' send order, and one
``index_add`` sums every token's top-k rows (weighted by their scores for
DeepSeek-V3-style routing).

The per-expert counts travel in one small all-to-all and reach the host in one
sync per layer (all-to-all split sizes must be known on the host, as in
torchtitan). The row all-to-alls are custom ops (``torchtitan_ext::nccl_dispatch``,
``nccl_combine``), both on the selective activation-checkpointing save list.
Combine's all-to-alls are started asynchronously and its sum runs at the first
use of its output (``in_flight``), so the MoE's shared experts overlap them;
its backward (gather and weight the gradient, then ``nccl_dispatch`` it) and
dispatch's backward (the groups' gradient sent back) are synchronous.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import distribute_tensor, DTensor, Partial, Replicate, Shard

from torchtitan_ext.ep.base import (
    MoEShape,
    recomputing,
    RoutedExpertParallel,
    Routing,
    scale_rows,
    to_device,
    token_group_alignment,
)
from torchtitan_ext.ep.in_flight import in_flight, Landing
from torchtitan_ext.ep.layout import padded_offsets


def _exchange_groups(
    rows: torch.Tensor,
    out: torch.Tensor,
    rows_layout: list[list[int]],
    out_layout: list[list[int]],
    rows_starts: list[int],
    out_starts: list[int],
    group,
    async_op: bool = False,
) -> list:
    """One all-to-all per local expert e: rows[rows_starts[e]:] split by rows_layout[e]
    (rows per peer) into out[out_starts[e]:] split by out_layout[e]. Returns their
    works when ``async_op`` (the rows have not landed before they are waited for)."""
    works = []
    for e, (send, recv) in enumerate(zip(rows_layout, out_layout)):
        source = rows.narrow(0, rows_starts[e], sum(send))
        target = out.narrow(0, out_starts[e], sum(recv))
        works.append(dist.all_to_all_single(target, source, recv, send, group=group, async_op=async_op))
    return works


@torch.library.custom_op("torchtitan_ext::nccl_dispatch", mutates_args=())
def nccl_dispatch(
    rows: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    local_experts: int,
    pad_multiple: int,
    group_name: str,
) -> torch.Tensor:
    """Rows sorted by (local expert, destination) -> this rank's padded expert-major groups.

    ``send_counts[e * R + d]``: rows for destination d's expert e; ``recv_counts[e * R + s]``:
    rows from source s for this rank's expert e.
    """
    layout = _Layout(send_counts, recv_counts, local_experts, pad_multiple)
    out = rows.new_empty((layout.total_rows, rows.shape[1]))
    for start, length in layout.pad_rows:
        out.narrow(0, start, length).zero_()
    _exchange_groups(
        rows, out, layout.send, layout.recv, layout.send_starts, layout.group_starts,
        _resolve_process_group(group_name),
    )
    return out


def _return_rows(groups: torch.Tensor, layout: "_Layout", group, async_op: bool = False):
    """The reverse of ``nccl_dispatch``: expert groups back into the sources' send order; (rows, works)."""
    out = groups.new_empty((layout.total_sent, groups.shape[1]))
    works = _exchange_groups(
        groups, out, layout.recv, layout.send, layout.group_starts, layout.send_starts, group, async_op
    )
    return out, works


def _sum_rows(returned: torch.Tensor, token_of_row: torch.Tensor, row_scores, num_tokens: int) -> torch.Tensor:
    """Each token's returned rows (times their scores, when given) summed in fp32."""
    rows = returned.float()
    if row_scores is not None:
        rows = rows * row_scores.float().unsqueeze(-1)
    return rows.new_zeros((num_tokens, rows.shape[1])).index_add_(0, token_of_row, rows)


@torch.library.custom_op("torchtitan_ext::nccl_combine", mutates_args=())
def nccl_combine(
    groups: torch.Tensor,
    token_of_row: torch.Tensor,
    row_scores: torch.Tensor | None,
    num_tokens: int,
    send_counts: list[int],
    recv_counts: list[int],
    local_experts: int,
    pad_multiple: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, Landing]:
    """Expert groups back to their sources, each token's rows summed (times ``row_scores``
    when given) in fp32 and rounded once: (combined [N, H], returned rows in send
    order, their landing).

    Both tensors land later (``in_flight``): the all-to-alls run while the caller
    goes on, and the first wait on ``combined`` (or on the landing) finishes them
    and sums the rows.
    """
    layout = _Layout(send_counts, recv_counts, local_experts, pad_multiple)
    returned, works = _return_rows(groups, layout, _resolve_process_group(group_name), async_op=True)
    combined = groups.new_empty((num_tokens, groups.shape[1]))

    def land():
        for work in works:
            work.wait()
        combined.copy_(_sum_rows(returned, token_of_row, row_scores, num_tokens))

    landing = Landing(combined, land)
    if recomputing():
        landing.wait()
    return combined, returned, landing


def _dispatch_setup(ctx, inputs, output):
    ctx.layout_args = inputs[1:]


def _dispatch_backward(ctx, grad):
    layout = _Layout(*ctx.layout_args[:4])
    rows, _ = _return_rows(grad.contiguous(), layout, _resolve_process_group(ctx.layout_args[-1]))
    return rows, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    token_of_row, row_scores = inputs[1:3]
    # the returned rows are needed only for the scores' gradient
    ctx.save_for_backward(token_of_row, row_scores, None if row_scores is None else output[1])
    ctx.layout_args = inputs[4:]
    ctx.landing = output[2]
    ctx.scores_dtype = None if row_scores is None else row_scores.dtype
    ctx.rows_dtype = inputs[0].dtype


def _combine_backward(ctx, grad_combined, grad_returned, grad_landing):
    ctx.landing.wait()  # the returned rows may not have landed if nothing used the output
    token_of_row, row_scores, returned = ctx.saved_tensors
    grad_rows = grad_combined.float().index_select(0, token_of_row)
    grad_scores = None
    if row_scores is not None:
        grad_scores = (grad_rows * returned.float()).sum(-1).to(ctx.scores_dtype)
        grad_rows = grad_rows * row_scores.float().unsqueeze(-1)
    grad_groups = nccl_dispatch(grad_rows.to(ctx.rows_dtype), *ctx.layout_args)
    return grad_groups, None, grad_scores, None, None, None, None, None, None


nccl_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
nccl_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


class _Layout:
    """Split sizes and offsets of one dispatch (host integers)."""

    def __init__(self, send_counts, recv_counts, local_experts, pad_multiple):
        ep_degree = len(send_counts) // local_experts
        self.send = [send_counts[e * ep_degree : (e + 1) * ep_degree] for e in range(local_experts)]
        self.recv = [recv_counts[e * ep_degree : (e + 1) * ep_degree] for e in range(local_experts)]
        self.send_starts = _starts([sum(counts) for counts in self.send])
        self.total_sent = sum(send_counts)
        per_expert = torch.tensor([sum(counts) for counts in self.recv])
        padded, offsets = padded_offsets(per_expert, pad_multiple)
        self.group_starts = offsets.tolist()
        self.padded_counts = padded
        self.total_rows = int(padded.sum())
        self.pad_rows = [
            (start + count, pad - count)
            for start, count, pad in zip(self.group_starts, per_expert.tolist(), padded.tolist())
            if pad > count
        ]


def _starts(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for length in lengths:
        starts.append(total)
        total += length
    return starts


@dataclass(frozen=True)
class _NcclDispatchState:
    token_of_row: torch.Tensor
    """Source token of every sent row (rows sorted by local expert, then destination)."""
    row_scores: torch.Tensor | None
    """Scores of the sent rows, when they multiply the expert outputs."""
    layout_args: tuple
    num_tokens: int


class NcclExpertParallel(RoutedExpertParallel):
    """EP over all-to-all collectives (NCCL on GPU, gloo on CPU).

    Applied on a 1-D "ep" mesh it is plain EP; on an ["ep", "etp"] mesh it also
    shards each expert's hidden dimension over "etp" (expert tensor parallelism,
    the only backend that supports it).
    """

    shared_experts_overlap = "yes: the combine all-to-alls are asynchronous, summed at first use"
    sac_save_ops = (
        torch.ops._c10d_functional.all_to_all_single.default,
        torch.ops.torchtitan_ext.nccl_dispatch.default,
        torch.ops.torchtitan_ext.nccl_combine.default,
    )
    min_pad_multiple = 8
    supports_expert_tensor_parallel = True
    needs_expert_parallelism = False

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        return partial(cls, pad_multiple=token_group_alignment(job_config))

    def _partition_fn(self, name, mod, device_mesh):
        if device_mesh.ndim == 1:
            return super()._partition_fn(name, mod, device_mesh)
        # expert TP on an [ep, etp] mesh: experts over "ep", w1/w3 column-wise and w2 row-wise over "etp"
        for param_name, hidden_dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            param = getattr(mod, param_name)
            sharded = distribute_tensor(param, device_mesh, [Shard(0), Shard(hidden_dim)])
            mod.register_parameter(param_name, torch.nn.Parameter(sharded))

    def _token_dispatch(self, mod, inputs, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_dispatch(mod, inputs, device_mesh)
        # every expert-TP rank computes a partial result from the same tokens and scores,
        # so their gradients are partial sums over "etp"
        x, routing = inputs
        x, scores = (
            DTensor.from_local(t, device_mesh["etp"], (Replicate(),)).to_local(grad_placements=(Partial(),))
            for t in (x, routing.scores)
        )
        return super()._token_dispatch(mod, (x, Routing(scores, routing.expert_ids)), device_mesh["ep"])

    def _token_combine(self, mod, routed_output, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_combine(mod, routed_output, device_mesh)
        return super()._token_combine(mod, routed_output, device_mesh["ep"])

    def dispatch(self, x, scores, expert_ids, num_experts, group):
        ep_degree = group.size()
        local_experts = num_experts // ep_degree
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        # sort pairs by (local expert index, destination rank): one contiguous block per
        # (expert index, destination), so each expert index's all-to-all reads one slice
        key = (flat_ids % local_experts) * ep_degree + flat_ids // local_experts
        pair_order = torch.argsort(key, stable=True)
        with torch.no_grad():
            send_counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
            send_counts.scatter_add_(0, key, torch.ones_like(key))
            # destination d receives its [e] counts: send them grouped by destination
            recv_counts = all_to_all_single(
                send_counts.view(local_experts, ep_degree).t().contiguous().view(-1), None, None, group=group
            )
            # split sizes must be on the host: one device-to-host sync, as in torchtitan
            both = torch.stack([send_counts, recv_counts.view(ep_degree, local_experts).t().reshape(-1)]).cpu()
        send_counts, recv_counts = both.tolist()
        token_of_row = pair_order // top_k
        rows = x.index_select(0, token_of_row)
        row_scores = scores.reshape(-1).index_select(0, pair_order)
        if self.score_before_experts:
            rows = scale_rows(rows, row_scores)
        layout_args = (send_counts, recv_counts, local_experts, self.pad_multiple, group.group_name)
        routed = nccl_dispatch(rows, *layout_args)
        self._pending = _NcclDispatchState(
            token_of_row=token_of_row,
            row_scores=None if self.score_before_experts else row_scores,
            layout_args=layout_args,
            num_tokens=num_tokens,
        )
        padded = _Layout(send_counts, recv_counts, local_experts, self.pad_multiple).padded_counts
        return routed, to_device(padded, x.device)

    def combine(self, routed_output, group):
        state = self._take_pending()
        combined, _, landing = nccl_combine(
            routed_output, state.token_of_row, state.row_scores, state.num_tokens, *state.layout_args
        )
        landing.what = self.collective_name("combine")
        return in_flight(combined)
