"""The ``nccl`` backend's custom ops: the row all-to-alls of dispatch and combine, with their backward.

Registered with torch (``torchtitan_ext::nccl_dispatch``, ``nccl_combine``) when
the backend first builds a layer, not when a config names it.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan_ext.ep.base import recomputing
from torchtitan_ext.ep.in_flight import Landing
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
    layout = Layout(send_counts, recv_counts, local_experts, pad_multiple)
    out = rows.new_empty((layout.total_rows, rows.shape[1]))
    for start, length in layout.pad_rows:
        out.narrow(0, start, length).zero_()
    _exchange_groups(
        rows, out, layout.send, layout.recv, layout.send_starts, layout.group_starts,
        _resolve_process_group(group_name),
    )
    return out


def _return_rows(groups: torch.Tensor, layout: "Layout", group, async_op: bool = False):
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
    layout = Layout(send_counts, recv_counts, local_experts, pad_multiple)
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
    layout = Layout(*ctx.layout_args[:4])
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


class Layout:
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
