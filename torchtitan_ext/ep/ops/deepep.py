"""The ``deepep`` backend's custom ops: DeepEP's dispatch and combine, with their backward.

Registered with torch (``torchtitan_ext::deepep_dispatch``, ``deepep_combine``, ...)
when the backend first builds a layer, not when a config names it.
"""

import torch

from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.handle import DispatchHandle, KernelBuffer
from torchtitan_ext.ep.in_flight import Landing
from torchtitan_ext.ep.ops.opaque_schema import custom_op_returning_opaque


@custom_op_returning_opaque("torchtitan_ext::deepep_dispatch")
def deepep_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buffer: KernelBuffer,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """(recv_x, recv local ids, recv weights, per-expert counts (host memory), handle).

    The counts are the library's host list (its CPU sync): they stay on the host,
    where the layout is computed from them.
    """
    kernels = buffer.value
    recv_x, recv_idx, recv_weights, counts, handle = kernels.dispatch(x, topk_idx, topk_weights, num_experts)
    return recv_x, recv_idx, recv_weights, torch.tensor(counts, dtype=torch.int64), DispatchHandle((kernels, handle))


@deepep_dispatch.register_fake
def _(x, topk_idx, topk_weights, buffer, num_experts):
    # the tokens received: known once the kernel has run; the counts per local expert in host memory
    received = torch.library.get_ctx().new_dynamic_size()
    local_experts = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((received, x.shape[1])), topk_idx.new_empty((received, topk_idx.shape[1])),
            topk_weights.new_empty((received, topk_idx.shape[1])),
            torch.empty((local_experts,), dtype=torch.int64, device="cpu"), DispatchHandle())


@custom_op_returning_opaque("torchtitan_ext::deepep_combine")
def deepep_combine(x: torch.Tensor, handle: DispatchHandle, num_tokens: int, what: str) -> tuple[torch.Tensor, Landing]:
    """Unweighted combine of one partial row per received token into this rank's ``num_tokens`` tokens:
    (combined, its landing, which names the combine ``what`` in its errors).

    Asynchronous: the output lands at the first wait on it or on the landing,
    which makes the current stream wait for DeepEP's communication stream (the
    reference: waits for its all-to-all and sums).
    """
    kernels, raw = handle.value
    combined, _, wait = kernels.combine(x, raw, asynchronous=True)
    landing = Landing(combined, wait, what)
    if recomputing():
        landing.wait()
    return combined, landing


@deepep_combine.register_fake
def _(x, handle, num_tokens, what):
    combined = x.new_empty((num_tokens, x.shape[1]))
    return combined, Landing.traced(what)


@torch.library.custom_op("torchtitan_ext::deepep_dispatch_backward", mutates_args=())
def deepep_dispatch_backward(
    grad_x: torch.Tensor, grad_weights: torch.Tensor | None, handle: DispatchHandle, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch's backward: combine of the received rows' (and weights') gradients.

    The weights' gradient comes back empty when none was given.
    """
    kernels, raw = handle.value
    combined, combined_weights, _ = kernels.combine(grad_x, raw, topk_weights=grad_weights)
    if combined_weights is None:
        combined_weights = grad_x.new_empty((0,), dtype=torch.float32)
    return combined, combined_weights


@deepep_dispatch_backward.register_fake
def _(grad_x, grad_weights, handle, num_tokens):
    weights_rows = 0 if grad_weights is None else num_tokens
    weights_cols = 0 if grad_weights is None else grad_weights.shape[1]
    return (grad_x.new_empty((num_tokens, grad_x.shape[1])),
            grad_x.new_empty((weights_rows, weights_cols), dtype=torch.float32))


@torch.library.custom_op("torchtitan_ext::deepep_cached_dispatch", mutates_args=())
def deepep_cached_dispatch(x: torch.Tensor, handle: DispatchHandle, num_received: int) -> torch.Tensor:
    """Combine's backward: dispatch along the handle's layout into ``num_received`` rows."""
    kernels, raw = handle.value
    return kernels.cached_dispatch(x, raw)


@deepep_cached_dispatch.register_fake
def _(x, handle, num_received):
    return x.new_empty((num_received, x.shape[1]))


def _dispatch_setup(ctx, inputs, output):
    ctx.handle = output[-1]
    ctx.dtype = inputs[0].dtype
    ctx.weights_dtype = inputs[2].dtype
    ctx.num_tokens = inputs[0].shape[0]


def _dispatch_backward(ctx, grad_x, grad_idx, grad_weights, grad_counts, grad_handle):
    grad_in, grad_topk = deepep_dispatch_backward(
        grad_x.contiguous(), None if grad_weights is None else grad_weights.float(), ctx.handle, ctx.num_tokens
    )
    grad_topk = grad_topk.to(ctx.weights_dtype) if grad_weights is not None else None
    return grad_in.to(ctx.dtype), None, grad_topk, None, None


def _combine_setup(ctx, inputs, output):
    ctx.handle = inputs[1]
    ctx.landing = output[1]
    ctx.num_received = inputs[0].shape[0]


def _combine_backward(ctx, grad, grad_landing):
    ctx.landing.wait()  # completes the forward's communication even if nothing used its output
    return deepep_cached_dispatch(grad.contiguous(), ctx.handle, ctx.num_received), None, None, None


deepep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
deepep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
