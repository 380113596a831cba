"""The ``nccl`` backend's custom ops: one all-to-all of the rows in dispatch and in combine, with their backward.

Registered with torch (``torchtitan_ext::nccl_dispatch``, ``nccl_combine``) when the backend first builds a layer,
not when a config names it. Rows travel in the pairs' send order, destination-major; each rank permutes what it
receives (source-major) into its padded expert-major groups with one gather, and back before combine.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from torchtitan_ext.ep.base import scored_sum_backward, scored_sum_into
from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.in_flight import Landing
from torchtitan_ext.ep.layout import into_groups
from torchtitan_ext.ep.ops.opaque_schema import custom_op_returning_opaque


def _exchange(rows: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group_name: str,
              async_op: bool = False):
    """One all-to-all of ``rows`` split ``in_splits`` rows per peer into ``out_rows`` rows split ``out_splits``:
    (the rows, their work when ``async_op``: not landed before it is waited for)."""
    out = rows.new_empty((out_rows, rows.shape[1]))
    work = dist.all_to_all_single(out, rows, out_splits, in_splits, group=_resolve_process_group(group_name),
                                  async_op=async_op)
    return out, work


@torch.library.custom_op("torchtitan_ext::nccl_dispatch", mutates_args=())
def nccl_dispatch(
    rows: torch.Tensor,
    destinations: torch.Tensor,
    group_sources: torch.Tensor,
    pad_rows: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group_name: str,
) -> torch.Tensor:
    """Rows in send order (destination-major, ``send_splits[d]`` rows for rank d) -> this rank's padded
    expert-major groups: the received rows (``recv_splits[s]`` from rank s) at ``destinations``, zero at
    ``pad_rows``; ``group_sources`` is the received row of every group row (any row for a pad row)."""
    received, _ = _exchange(rows, sum(recv_splits), recv_splits, send_splits, group_name)
    return into_groups(received, group_sources, pad_rows)


@nccl_dispatch.register_fake
def _(rows, destinations, group_sources, pad_rows, send_splits, recv_splits, group_name):
    return rows.new_empty((group_sources.shape[0], rows.shape[1]))


@custom_op_returning_opaque("torchtitan_ext::nccl_combine")
def nccl_combine(
    groups: torch.Tensor,
    destinations: torch.Tensor,
    group_sources: torch.Tensor,
    pad_rows: torch.Tensor,
    token_of_row: torch.Tensor,
    row_scores: torch.Tensor | None,
    num_tokens: int,
    send_splits: list[int],
    recv_splits: list[int],
    group_name: str,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor, Landing]:
    """Expert groups back to their sources, each token's rows summed (times ``row_scores`` when given) in fp32
    and rounded once: (combined [N, H], returned rows in send order, their landing, which names the combine
    ``what`` in its errors).

    Both tensors land later (``in_flight``): the all-to-all runs while the caller goes on, and the first wait on
    ``combined`` (or on the landing) finishes it and sums the rows.
    """
    returned, work = _exchange(groups.index_select(0, destinations), sum(send_splits), send_splits, recv_splits,
                               group_name, async_op=True)
    combined = groups.new_empty((num_tokens, groups.shape[1]))

    def land():
        work.wait()
        scored_sum_into(combined, returned, token_of_row, row_scores)

    landing = Landing(combined, land, what)
    if recomputing():
        landing.wait()
    return combined, returned, landing


@nccl_combine.register_fake
def _(groups, destinations, group_sources, pad_rows, token_of_row, row_scores, num_tokens, send_splits, recv_splits,
      group_name, what):
    combined = groups.new_empty((num_tokens, groups.shape[1]))
    return combined, groups.new_empty((sum(send_splits), groups.shape[1])), Landing.traced(what)


def _dispatch_setup(ctx, inputs, output):
    _, destinations, _, _, send_splits, recv_splits, group_name = inputs
    ctx.save_for_backward(destinations)
    ctx.splits = send_splits, recv_splits
    ctx.group_name = group_name


def _dispatch_backward(ctx, grad):
    """The groups' gradient back to the rows' ranks, in their send order."""
    (destinations,) = ctx.saved_tensors
    send_splits, recv_splits = ctx.splits
    rows, _ = _exchange(grad.index_select(0, destinations), sum(send_splits), send_splits, recv_splits, ctx.group_name)
    return rows, None, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    _, destinations, group_sources, pad_rows, token_of_row, row_scores, _, send_splits, recv_splits, group_name, _ = (
        inputs
    )
    # the returned rows are needed only for the scores' gradient
    ctx.save_for_backward(destinations, group_sources, pad_rows, token_of_row, row_scores,
                          None if row_scores is None else output[1])
    ctx.layout = send_splits, recv_splits, group_name
    ctx.landing = output[2]
    # no gradient reaches the returned rows (the scores' gradient is computed from them here): autograd's zero
    # gradient in its place would be one more pass over every row this rank sent
    ctx.set_materialize_grads(False)


def _combine_backward(ctx, grad_combined, grad_returned, grad_landing):
    ctx.landing.wait()  # the returned rows may not have landed if nothing used the output
    destinations, group_sources, pad_rows, token_of_row, row_scores, returned = ctx.saved_tensors
    grad_rows, grad_scores = scored_sum_backward(grad_combined, returned, token_of_row, row_scores)
    send_splits, recv_splits, group_name = ctx.layout
    grad_groups = nccl_dispatch(grad_rows, destinations, group_sources, pad_rows, send_splits, recv_splits, group_name)
    return grad_groups, None, None, None, None, grad_scores, None, None, None, None, None


nccl_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
nccl_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
