"""Constructors for the real deep_ep buffers (CUDA clusters only).

``deep_ep.Buffer`` and ``deep_ep.ElasticBuffer`` are driven through
:mod:`torchtitan_ext.ep.kernels.deepep_apis`. :class:`LibraryHybridEPBuffer` adds to ``deep_ep.HybridEPBuffer``
the one thing the backend asks beyond the library's calls: how many pairs a
dispatch kept, from which the metrics count the dropped ones.

This module is imported only when ``implementation`` resolves to ``deep_ep``.
The test suite runs it against a double of the library that follows its
pinned sources (tests/ep/deep_ep_double); only a CUDA machine with the library
built (the tests marked ``deep_ep``, scripts/check_cluster.sh) runs the real kernels.
"""

import os
import time

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger


def deepep_buffer_bytes(group_size: int, hidden_bytes: int, num_sms: int | None) -> tuple[int, int]:
    """(NVLink bytes, RDMA bytes) of a DeepEP buffer: the library's own size hints."""
    from deep_ep import Buffer

    if num_sms is not None:
        Buffer.set_num_sms(num_sms)
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (Buffer.get_dispatch_config(group_size), Buffer.get_combine_config(group_size)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, group_size))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, group_size))
    return num_nvl_bytes, num_rdma_bytes


def deepep_buffer(group, hidden_bytes: int, num_sms: int | None):
    """A DeepEP v1 normal-mode buffer sized by the library's own hints, destroyed explicitly
    (:func:`torchtitan_ext.ep.base.destroy_kernel_buffers`)."""
    from deep_ep import Buffer

    return Buffer(group, *deepep_buffer_bytes(group.size(), hidden_bytes, num_sms), explicitly_destroy=True)


def elastic_buffer(group, shape):
    """A DeepEP V2 buffer for ``shape`` (``MoEShape``), sized by the library from those dimensions.

    ``deterministic`` follows torch's setting, so that a deterministic job gets
    the library's deterministic receive order.
    """
    from deep_ep import ElasticBuffer

    # the buffer borrows the EP group's NCCL communicator (backend._comm_ptr()), which torch creates at the
    # group's first collective: a group that has not communicated yet would hand over a null pointer
    dist.barrier(group=group)
    buffer = ElasticBuffer(
        group,
        num_max_tokens_per_rank=shape.max_tokens_per_rank,
        hidden=shape.hidden_dim,
        num_topk=shape.top_k,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        explicitly_destroy=True,
    )
    # the library sizes it from the live communicator, so the planner cannot: the log is where a user sees it
    logger.info(
        f"DeepEP ElasticBuffer: {buffer.num_bytes / 2**20:,.0f} MiB per rank, sized by the library for "
        f"{shape.max_tokens_per_rank} tokens per rank over {group.size()} ranks"
    )
    return buffer


class LibraryHybridEPBuffer:
    """``deep_ep.HybridEPBuffer`` behind the interface the HybridEP backend calls.

    The calls pass through unchanged; :meth:`kept_pairs_per_expert` reads the
    kept (token, expert) counts from the library's handle (the library itself
    reports only an overflow flag).
    """

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 num_sms_dispatch_api, num_sms_combine_api, environment: dict[str, str]):
        from deep_ep import HybridEPBuffer

        # the library reads these when the buffer is created
        os.environ.update(environment)
        self.group = group
        self.num_local_experts = num_local_experts
        self.compiled = False
        self.library = HybridEPBuffer(
            group=group,
            hidden_dim=hidden_dim,
            max_num_of_tokens_per_rank=max_num_of_tokens_per_rank,
            num_local_experts=num_local_experts,
            num_sms_dispatch_api=num_sms_dispatch_api,
            num_sms_combine_api=num_sms_combine_api,
            use_shared_buffer=True,
        )

    def dispatch_with_permute(self, *, hidden, routing_map=None, probs=None,
                              num_of_experts_per_rank=None, num_permuted_tokens=None,
                              pad_multiple=None, non_blocking=False, handle=None):
        """The library's call, unchanged: its handle is the library's 11-tuple. The first one compiles the
        kernels (nvcc, on every rank, into a per-process cache: the pinned branch cannot reuse another
        process's), and says how long that took."""
        began = time.perf_counter()
        result = self.library.dispatch_with_permute(
            hidden=hidden, routing_map=routing_map, probs=probs,
            num_of_experts_per_rank=num_of_experts_per_rank,
            num_permuted_tokens=num_permuted_tokens, pad_multiple=pad_multiple,
            non_blocking=non_blocking, handle=handle,
        )
        if not self.compiled:
            self.compiled = True
            logger.info(f"HybridEP's first dispatch, with its kernels compiled on this rank: {time.perf_counter() - began:.1f} s")
        return result

    def destroy(self) -> None:
        """HybridEPBuffer has no destroy: its destructor frees its memory locally (no barrier); dropping it here
        releases it before the process group it holds goes."""
        self.library = None

    def kept_pairs_per_expert(self, handle: tuple) -> torch.Tensor:
        """[L] (token, local expert) pairs the dispatch kept on this rank (int64, on the device).

        Element 7 of the handle, the raw tokens_per_expert the preprocessing
        scan writes: padding excluded, clipped where a non-blocking dispatch
        drops. The routed count is not in the handle: its local_expert_routing_map
        (element 4) is never written when the preprocessing runs with permute
        (enable_permute, always on in dispatch_with_permute; the library's note on
        metadata_preprocessing).
        """
        return handle[7].to(torch.int64)

    def combine_with_unpermute(self, *, hidden, probs=None, handle, pad_multiple=None):
        return self.library.combine_with_unpermute(
            hidden=hidden, probs=probs, handle=handle, pad_multiple=pad_multiple
        )
