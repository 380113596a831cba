"""The ``hybridep`` backend's custom ops: HybridEP's dispatch (permute fused) and combine, with their backward.

Registered with torch (``torchtitan_ext::hybridep_dispatch``, ``hybridep_combine``, ...)
when the backend first builds a layer, not when a config names it.
"""

import torch

from torchtitan_ext.ep.base import to_device
from torchtitan_ext.ep.handle import DispatchHandle, KernelBuffer
from torchtitan_ext.ep.kernels.calls import kernel_call
from torchtitan_ext.ep.ops.opaque_schema import custom_op_returning_opaque


def _library_pad(pad_multiple: int) -> int | None:
    """The library zeroes pad rows only when a pad multiple is passed; 1 means none."""
    return pad_multiple if pad_multiple > 1 else None


def _padded_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``num_rows``."""
    if tensor.shape[0] == num_rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((num_rows - tensor.shape[0], *tensor.shape[1:]))])


@custom_op_returning_opaque("torchtitan_ext::hybridep_dispatch")
def hybridep_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buffer: KernelBuffer,
    num_experts: int,
    local_experts: int,
    num_permuted_tokens: int,
    pad_multiple: int,
    num_padded_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """(rows [M, H], probs [M], padded rows per local expert (on x's device), kept pairs per local
    expert (on x's device), handle).

    ``num_permuted_tokens`` < 0 selects blocking mode. Every rank passes
    ``num_padded_tokens`` rows (the library all-gathers a dense routing map and
    needs the same count everywhere): this rank's tokens, then rows routed to
    no expert, which the library neither sends nor counts.
    """
    kernels = buffer.value
    num_tokens = x.shape[0]
    routing_map = torch.zeros((num_padded_tokens, num_experts), dtype=torch.bool, device=x.device)
    routing_map[:num_tokens].scatter_(1, topk_idx, True)
    probs = torch.zeros((num_padded_tokens, num_experts), dtype=torch.float32, device=x.device)
    probs[:num_tokens].scatter_(1, topk_idx, topk_weights.float())
    non_blocking = num_permuted_tokens >= 0
    hidden = _padded_rows(x, num_padded_tokens)
    # blocking: the library synchronizes its stream to size the output exactly
    with kernel_call("hybridep.dispatch_with_permute", host_syncs=0 if non_blocking else 1):
        rows, row_probs, _, tokens_per_expert, raw = kernels.dispatch_with_permute(
            hidden=hidden,
            routing_map=routing_map,
            probs=probs,
            num_of_experts_per_rank=local_experts,
            num_permuted_tokens=num_permuted_tokens if non_blocking else None,
            pad_multiple=_library_pad(pad_multiple),
            non_blocking=non_blocking,
        )
    return (
        rows,
        row_probs,
        # pinned host memory in blocking mode, on the device in non-blocking mode
        tokens_per_expert if non_blocking else to_device(tokens_per_expert, x.device),
        kernels.kept_pairs_per_expert(raw),
        DispatchHandle((kernels, raw, pad_multiple, num_tokens, num_padded_tokens)),
    )


@hybridep_dispatch.register_fake
def _(x, topk_idx, topk_weights, buffer, num_experts, local_experts, num_permuted_tokens, pad_multiple,
      num_padded_tokens):
    # blocking mode sizes its output from the routing: a size known once the kernel has run
    rows = num_permuted_tokens if num_permuted_tokens >= 0 else torch.library.get_ctx().new_dynamic_size()
    counts = x.new_empty((local_experts,), dtype=torch.int64)
    return (x.new_empty((rows, x.shape[1])), x.new_empty((rows,), dtype=torch.float32), counts, counts.clone(),
            DispatchHandle())


@torch.library.custom_op("torchtitan_ext::hybridep_combine", mutates_args=())
def hybridep_combine(x: torch.Tensor, handle: DispatchHandle, num_tokens: int) -> torch.Tensor:
    """Unweighted combine of the expert-major rows back to this rank's [``num_tokens``, H] tokens."""
    kernels, raw, pad_multiple, _, _ = handle.value
    with kernel_call("hybridep.combine_with_unpermute"):
        combined, _ = kernels.combine_with_unpermute(hidden=x, handle=raw, pad_multiple=_library_pad(pad_multiple))
    return combined[:num_tokens].clone() if combined.shape[0] > num_tokens else combined


@hybridep_combine.register_fake
def _(x, handle, num_tokens):
    return x.new_empty((num_tokens, x.shape[1]))


@torch.library.custom_op("torchtitan_ext::hybridep_dispatch_backward", mutates_args=())
def hybridep_dispatch_backward(
    grad_rows: torch.Tensor, grad_probs: torch.Tensor | None, handle: DispatchHandle, num_tokens: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch's backward: combine of the rows' gradient, with dense [N, E] probs gradients
    (empty when no probs gradient was given)."""
    kernels, raw, pad_multiple, _, _ = handle.value
    with kernel_call("hybridep.combine_with_unpermute"):
        grad_x, grad_probs_dense = kernels.combine_with_unpermute(
            hidden=grad_rows, probs=grad_probs, handle=raw, pad_multiple=_library_pad(pad_multiple)
        )
    if grad_probs_dense is None:
        grad_probs_dense = grad_rows.new_empty((0,), dtype=torch.float32)
    return grad_x[:num_tokens].clone(), grad_probs_dense[:num_tokens].clone()


@hybridep_dispatch_backward.register_fake
def _(grad_rows, grad_probs, handle, num_tokens, num_experts):
    probs_rows = 0 if grad_probs is None else num_tokens
    return (grad_rows.new_empty((num_tokens, grad_rows.shape[1])),
            grad_rows.new_empty((probs_rows, num_experts), dtype=torch.float32))


@torch.library.custom_op("torchtitan_ext::hybridep_cached_dispatch", mutates_args=())
def hybridep_cached_dispatch(x: torch.Tensor, handle: DispatchHandle, num_rows: int) -> torch.Tensor:
    """Combine's backward: dispatch along the handle's layout into ``num_rows`` rows.

    Only the tokens are kept: on this cached path the library returns no
    tokens-per-expert (None) and no new handle.
    """
    kernels, raw, pad_multiple, _, num_padded_tokens = handle.value
    hidden = _padded_rows(x, num_padded_tokens)
    with kernel_call("hybridep.dispatch_with_permute (cached)"):
        rows, _, _, _, _ = kernels.dispatch_with_permute(
            hidden=hidden,
            handle=raw,
            num_permuted_tokens=num_rows,
            pad_multiple=_library_pad(pad_multiple),
        )
    return rows


@hybridep_cached_dispatch.register_fake
def _(x, handle, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights, _, num_experts = inputs[:5]
    ctx.handle = output[-1]
    ctx.dtype = x.dtype
    ctx.weights_dtype = topk_weights.dtype
    ctx.shape = x.shape[0], num_experts
    ctx.save_for_backward(topk_idx)


def _dispatch_backward(ctx, grad_rows, grad_probs, *unused_grads):
    (topk_idx,) = ctx.saved_tensors
    grad_x, grad_probs_dense = hybridep_dispatch_backward(
        grad_rows.contiguous(), None if grad_probs is None else grad_probs.float(), ctx.handle, *ctx.shape
    )
    grad_weights = None
    if grad_probs is not None:
        grad_weights = grad_probs_dense.gather(1, topk_idx).to(ctx.weights_dtype)
    return grad_x.to(ctx.dtype), None, grad_weights, None, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    ctx.handle = inputs[1]
    ctx.num_rows = inputs[0].shape[0]


def _combine_backward(ctx, grad):
    return hybridep_cached_dispatch(grad.contiguous(), ctx.handle, ctx.num_rows), None, None


hybridep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
hybridep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
