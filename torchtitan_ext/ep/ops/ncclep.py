"""The ``ncclep`` backend's custom ops: NCCL EP's dispatch and combine (high-throughput, expert-major), with their
backward as the library's own backward passes (``PassDir.BWD``).

Registered with torch (``torchtitan_ext::ncclep_dispatch``, ``ncclep_combine``, ...) when the backend first builds
a layer, not when a config names it.
"""

import torch

from torchtitan_ext.ep.handle import DispatchHandle, KernelBuffer
from torchtitan_ext.ep.ops.opaque_schema import custom_op_returning_opaque


@custom_op_returning_opaque("torchtitan_ext::ncclep_dispatch")
def ncclep_dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, kernels: KernelBuffer, num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """(rows [M, H], each row's routing weight [M] fp32, padded rows per local expert [L] int64, handle), on x's
    device.

    ``num_rows`` >= 0: the static budget M (the group's ``max_recv_tokens_per_rank``), slots past it dropped;
    < 0: eager mode, M read from the library's padded total (a host sync). The library zeroes padding rows; its
    weights it zeroes on one path only (``ht_ep.cuh``: the local permute writes 0, the dispatch kernel's PAD warp
    writes none), so the weights start at zero. The library reads pointers and shapes, not strides: every tensor
    it is handed is contiguous.
    """
    library = kernels.value
    x, topk_idx = x.contiguous(), topk_idx.contiguous()
    pooled = library.route(topk_idx)
    # eager mode: the library's documented way to size the outputs is to read its total on the host
    rows = num_rows if num_rows >= 0 else int(pooled.total.item())
    out = x.new_empty((rows, x.shape[1]))
    out_weights = torch.zeros(rows, dtype=torch.float32, device=x.device)
    library.dispatch(pooled, x, out, topk_weights.float().contiguous(), out_weights)
    handle = DispatchHandle((library, pooled, x.shape[0], topk_idx.shape[1]))
    library.release_when_freed(handle, pooled)
    return out, out_weights, pooled.counters.clone(), handle


@ncclep_dispatch.register_fake
def _(x, topk_idx, topk_weights, kernels, num_rows):
    rows = num_rows if num_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((rows, x.shape[1])), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((kernels.value.local_experts,), dtype=torch.int64), DispatchHandle())


@torch.library.custom_op("torchtitan_ext::ncclep_combine", mutates_args=())
def ncclep_combine(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """The rows of each token summed back on its source rank: [tokens, H]."""
    library, pooled, num_tokens, _ = handle.value
    out = rows.new_empty((num_tokens, rows.shape[1]))
    library.combine(pooled, rows.contiguous(), out)
    return out


@ncclep_combine.register_fake
def _(rows, handle):
    return rows.new_empty((handle.value[2], rows.shape[1]))


@torch.library.custom_op("torchtitan_ext::ncclep_combine_backward", mutates_args=())
def ncclep_combine_backward(grad: torch.Tensor, handle: DispatchHandle, num_rows: int) -> torch.Tensor:
    """Combine's backward: the tokens' gradient dispatched along the handle's layout (``PassDir.BWD``) into
    ``num_rows`` rows."""
    library, pooled, _, _ = handle.value
    out = grad.new_empty((num_rows, grad.shape[1]))
    library.dispatch(pooled, grad.contiguous(), out, backward=True)
    return out


@ncclep_combine_backward.register_fake
def _(grad, handle, num_rows):
    return grad.new_empty((num_rows, grad.shape[1]))


@torch.library.custom_op("torchtitan_ext::ncclep_dispatch_backward", mutates_args=())
def ncclep_dispatch_backward(
    grad_rows: torch.Tensor, grad_weights: torch.Tensor, handle: DispatchHandle,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch's backward (``PassDir.BWD`` combine): (the tokens' gradient [tokens, H], each pick's weight gradient
    [tokens, top_k] fp32)."""
    library, pooled, num_tokens, top_k = handle.value
    grad_x = grad_rows.new_empty((num_tokens, grad_rows.shape[1]))
    grad_topk = torch.empty((num_tokens, top_k), dtype=torch.float32, device=grad_rows.device)
    library.combine(pooled, grad_rows.contiguous(), grad_x, grad_weights.float().contiguous(), grad_topk, backward=True)
    return grad_x, grad_topk


@ncclep_dispatch_backward.register_fake
def _(grad_rows, grad_weights, handle):
    _, _, num_tokens, top_k = handle.value
    return (grad_rows.new_empty((num_tokens, grad_rows.shape[1])),
            grad_rows.new_empty((num_tokens, top_k), dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    ctx.handle = output[-1]
    ctx.dtype = inputs[0].dtype
    ctx.weights_dtype = inputs[2].dtype
    ctx.num_rows = output[0].shape[0]


def _dispatch_backward(ctx, grad_rows, grad_weights, *unused_grads):
    if grad_weights is None:  # the library's backward combine takes the weights' gradient, zero here
        grad_weights = torch.zeros(ctx.num_rows, dtype=torch.float32, device=grad_rows.device)
    grad_x, grad_topk = ncclep_dispatch_backward(grad_rows, grad_weights, ctx.handle)
    return grad_x.to(ctx.dtype), None, grad_topk.to(ctx.weights_dtype), None, None


def _combine_setup(ctx, inputs, output):
    ctx.handle = inputs[1]
    ctx.num_rows = inputs[0].shape[0]


def _combine_backward(ctx, grad):
    return ncclep_combine_backward(grad, ctx.handle, ctx.num_rows), None


ncclep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
ncclep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
