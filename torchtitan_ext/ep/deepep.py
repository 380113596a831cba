"""The ``deepep`` backend: DeepEP v1 normal mode.

Dispatch sends each token once to every rank that owns one of its experts
(layout, then dispatch); the received rows are expanded per local pick and
stably sorted by local expert into padded expert-major groups; combine
scatter-adds each token's picks and sends one partial row per rank back,
where the library sums them unweighted in fp32. Combine runs asynchronously
(``async_finish``) and lands at the first use of its output (``in_flight``),
so the MoE's shared experts overlap it. Picks whose score is exactly
0 are not sent (torchtitan's masking). Autograd: dispatch backward is a
combine of the gradient (with the top-k weights' gradients), combine
backward a cached dispatch.

Kernels: the real ``deep_ep.Buffer`` or the reference (``[deepep] implementation``).
The buffer is shared by all MoE layers and created at the first dispatch.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import ConfigError, Range
from torchtitan_ext.ep.base import (
    check_kernels,
    MoEShape,
    recomputing,
    RoutedExpertParallel,
    scale_rows,
    SharedKernelBuffer,
    token_group_alignment,
)
from torchtitan_ext.ep.handle import DispatchHandle, KernelBuffer
from torchtitan_ext.ep.in_flight import in_flight, Landing
from torchtitan_ext.ep.kernels import implementation_description as _implementation_description
from torchtitan_ext.ep.kernels import resolve_implementation
from torchtitan_ext.ep.layout import block_destinations


@torch.library.custom_op("torchtitan_ext::deepep_dispatch", mutates_args=())
def deepep_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    buffer: KernelBuffer,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Layout + dispatch: (recv_x, recv local ids, recv weights, per-expert counts (host), handle)."""
    library = buffer.value
    per_rank, per_rdma_rank, per_expert, in_rank, _ = library.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_weights, counts, handle, _ = library.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    return recv_x, recv_idx, recv_weights, torch.tensor(counts, dtype=torch.int64), DispatchHandle((library, handle))


@torch.library.custom_op("torchtitan_ext::deepep_combine", mutates_args=())
def deepep_combine(x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, Landing]:
    """Unweighted combine of one partial row per received token: (combined, its landing).

    Asynchronous (``async_finish``): the output lands at the first wait on it or
    on the landing, which makes the current stream wait for DeepEP's
    communication stream (the reference: waits for its all-to-all and sums).
    """
    library, raw = handle.value
    combined, _, event = library.combine(x, raw, async_finish=True)
    landing = Landing(combined, event.current_stream_wait)
    if recomputing():
        landing.wait()
    return combined, landing


@torch.library.custom_op("torchtitan_ext::deepep_dispatch_backward", mutates_args=())
def deepep_dispatch_backward(
    grad_x: torch.Tensor, grad_weights: torch.Tensor | None, handle: DispatchHandle
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch's backward: combine of the received rows' (and weights') gradients.

    The weights' gradient comes back empty when none was given.
    """
    library, raw = handle.value
    combined, combined_weights, _ = library.combine(grad_x, raw, topk_weights=grad_weights)
    if combined_weights is None:
        combined_weights = grad_x.new_empty((0,), dtype=torch.float32)
    return combined, combined_weights


@torch.library.custom_op("torchtitan_ext::deepep_cached_dispatch", mutates_args=())
def deepep_cached_dispatch(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Combine's backward: dispatch along the handle's layout."""
    library, raw = handle.value
    return library.dispatch(x, handle=raw)[0]


def _dispatch_setup(ctx, inputs, output):
    ctx.handle = output[-1]
    ctx.dtype = inputs[0].dtype
    ctx.weights_dtype = inputs[2].dtype


def _dispatch_backward(ctx, grad_x, grad_idx, grad_weights, grad_counts, grad_handle):
    grad_in, grad_topk = deepep_dispatch_backward(
        grad_x.contiguous(), None if grad_weights is None else grad_weights.float(), ctx.handle
    )
    grad_topk = grad_topk.to(ctx.weights_dtype) if grad_weights is not None else None
    return grad_in.to(ctx.dtype), None, grad_topk, None, None


def _combine_setup(ctx, inputs, output):
    ctx.handle = inputs[1]
    ctx.landing = output[1]


def _combine_backward(ctx, grad, grad_landing):
    ctx.landing.wait()  # completes the forward's communication even if nothing used its output
    return deepep_cached_dispatch(grad.contiguous(), ctx.handle), None


deepep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
deepep_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def hidden_bytes(hidden_dim: int, element_size: int) -> int:
    """Bytes per token DeepEP sizes its buffer for: at least 2 per element, so bf16 and fp8 share one buffer."""
    return hidden_dim * max(element_size, 2)


def _create_buffer(implementation: str, shape: MoEShape, num_sms: int | None, group, example: torch.Tensor):
    implementation = resolve_implementation("deepep", implementation, example.device.type)
    if implementation == "deep_ep":
        from torchtitan_ext.ep.kernels.deep_ep import deepep_buffer

        return deepep_buffer(group, hidden_bytes(shape.hidden_dim, example.element_size()), num_sms)
    from torchtitan_ext.ep.kernels.reference import ReferenceBuffer

    return ReferenceBuffer(group)


@dataclass(frozen=True)
class _DeepEPDispatchState:
    handle: DispatchHandle
    pair_order: torch.Tensor
    """Valid received picks (row * K + k), expert-major."""
    destinations: torch.Tensor
    pair_scores: torch.Tensor | None
    num_received: int
    top_k: int


class DeepEPExpertParallel(RoutedExpertParallel):
    """EP over DeepEP v1 normal-mode kernels."""

    @dataclass
    class Config:
        """``[deepep]``: knobs of the deepep backend."""

        implementation: Literal["auto", "deep_ep", "reference"] = "auto"
        """
        Which kernels run the DeepEP calls.

        - "auto": the real deep_ep library on CUDA, the reference on CPU. On CUDA
          without deep_ep installed this is an error, never a silent fallback.
        - "deep_ep": the real library (CUDA only; built from source, see docs/backends.md).
        - "reference": torchtitan_ext's pure torch.distributed implementation of the
          same calls with the same results, on any device. Slow; for debugging and CI.
        """

        num_sms: int | None = None
        """
        Streaming multiprocessors the normal-mode kernels use (``Buffer.set_num_sms``).
        Even integer >= 2 (DeepEP runs one channel per 2 SMs); unset keeps the
        library's default of 20. More SMs speed up communication and leave fewer
        for the experts' GEMMs. Ignored by the reference implementation.
        """

    config_section = "deepep"
    config_ranges = {"deepep.num_sms": Range(2, meaning="SMs, an even count")}

    shared_experts_overlap = "yes: combine runs with async_finish on DeepEP's communication stream"
    sac_save_ops = (
        torch.ops.torchtitan_ext.deepep_dispatch.default,
        torch.ops.torchtitan_ext.deepep_combine.default,
    )

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        section = job_config.deepep
        buffer = SharedKernelBuffer(partial(_create_buffer, section.implementation, shape, section.num_sms))
        return partial(cls, buffer=buffer, pad_multiple=token_group_alignment(job_config))

    @classmethod
    def validate_config(cls, job_config, device_type: str | None, shape: MoEShape) -> None:
        section = job_config.deepep
        if section.num_sms is not None and section.num_sms % 2:
            raise ConfigError(
                f"deepep.num_sms = {section.num_sms}: use an even integer >= 2 (one channel per 2 SMs)"
            )
        check_kernels("deepep", section.implementation, device_type)

    @classmethod
    def planned_buffer(cls, job_config, shape: MoEShape) -> tuple[int | None, str]:
        from torchtitan_ext.ep.kernels.deep_ep import deepep_buffer_bytes

        element_size = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param].itemsize
        try:
            nvl, rdma = deepep_buffer_bytes(
                job_config.parallelism.expert_parallel_degree,
                hidden_bytes(shape.hidden_dim, element_size),
                job_config.deepep.num_sms,
            )
        except ImportError:
            return None, "DeepEP's size hints need deep_ep installed; the reference allocates none"
        return nvl + rdma, f"deep_ep size hints: {nvl:,} NVLink + {rdma:,} RDMA bytes"

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        section = job_config.deepep
        return {
            **super().describe(job_config, shape),
            "kernels": _implementation_description(section.implementation),
            "SMs": str(section.num_sms or "library default (20)"),
        }

    def __init__(self, *, buffer: SharedKernelBuffer, **base_kwargs):
        """``base_kwargs``: :class:`RoutedExpertParallel`'s (score_before_experts, ...)."""
        super().__init__(**base_kwargs)
        self.buffer = buffer

    def dispatch(self, x, scores, expert_ids, num_experts, group):
        # a pick with score 0 contributes nothing; DeepEP does not send it
        expert_ids = expert_ids.masked_fill(scores == 0, -1)
        recv_x, recv_idx, recv_weights, counts, handle = deepep_dispatch(
            x, expert_ids, scores.float(), self.buffer.get(group, x), num_experts
        )
        num_received, top_k = recv_idx.shape
        local_experts = counts.numel()
        flat_ids = recv_idx.reshape(-1)
        sort_key = torch.where(flat_ids >= 0, flat_ids, local_experts)
        pair_order = torch.argsort(sort_key, stable=True)[: int(counts.sum())]
        destinations, padded, total_rows = block_destinations(counts.view(1, -1), self.pad_multiple)
        destinations = destinations.to(x.device)
        rows = recv_x[pair_order // top_k]
        pair_scores = recv_weights.reshape(-1)[pair_order]
        if self.score_before_experts:
            rows = scale_rows(rows, pair_scores)
        routed = rows.new_zeros((total_rows, x.shape[1])).index_copy(0, destinations, rows)
        self._pending = _DeepEPDispatchState(
            handle=handle,
            pair_order=pair_order,
            destinations=destinations,
            pair_scores=None if self.score_before_experts else pair_scores,
            num_received=num_received,
            top_k=top_k,
        )
        return routed, padded.to(x.device)

    def combine(self, routed_output, group):
        state = self._take_pending()
        rows = routed_output.index_select(0, state.destinations).float()
        if state.pair_scores is not None:
            rows = rows * state.pair_scores.float().unsqueeze(-1)
        partial_rows = rows.new_zeros((state.num_received, rows.shape[1])).index_add(
            0, state.pair_order // state.top_k, rows
        )
        combined, _ = deepep_combine(partial_rows.to(routed_output.dtype), state.handle)
        return in_flight(combined)
