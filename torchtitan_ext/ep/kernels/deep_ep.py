"""Constructors for the real deep_ep buffers (CUDA clusters only).

``deep_ep.Buffer``, ``deep_ep.ElasticBuffer`` and ``deep_ep.EPBuffer`` are driven through
:mod:`torchtitan_ext.ep.kernels.deepep_apis`; an ``EPBuffer`` (DeepEP V2.5) of a job
with expert replication also moves the replicas' weights and gradients
(:class:`LoadBalancingKernels`). :class:`LibraryHybridEPBuffer` adds to ``deep_ep.HybridEPBuffer``
the one thing the backend asks beyond the library's calls: how many pairs a
dispatch kept, from which the metrics count the dropped ones.

This module is imported only when ``implementation`` resolves to ``deep_ep``.
The test suite runs it against a double of the library that follows its
pinned sources (tests/ep/deep_ep_double); only a CUDA machine with the library
built (the tests marked ``deep_ep``, python -m torchtitan_ext.bench cluster_check) runs the real kernels.
"""

import os
import time

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from torchtitan_ext.ep.kernels import calls
from torchtitan_ext.ep.kernels.calls import kernel_call
from torchtitan_ext.ep.kernels.deepep_apis import FALLBACK_SMS


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


class LoadBalancingKernels:
    """Replica weights and gradients through DeepEP V2.5's ``lb_prefetch_weights`` / ``lb_reduce_grads``.

    Both are collective over the buffer's NVLink domain, which must be the
    whole EP group, so that the library's domain-local expert ids are the
    plan's home slots. ``weights`` [S, F] (the experts' compute dtype) and
    ``gradients`` [S, F] (fp32, the only dtype ``lb_reduce_grads`` takes) are
    the buffer's load-balancing region, shared by every MoE layer: a fetch
    copies the replicas out when it lands, before the next fetch (of any layer) is issued. Gradients are
    summed in fp32 at home and returned in fp32. Both kernels
    open and close with a barrier over the domain (prefetch_weights.cuh,
    reduce_grads.cuh), so once a call's event is waited on, no peer still
    reads or writes this rank's region.
    """

    def __init__(self, buffer, weights: torch.Tensor, gradients: torch.Tensor, num_sms: int):
        self.buffer = buffer
        self.weights = weights
        self.gradients = gradients
        self.num_sms = num_sms
        self.landing = False
        """Whether a fetch has not landed yet: the region holds its replicas until it does."""

    def fetch(self, home: list[torch.Tensor], redundancy_mapping: torch.Tensor):
        rows = [weight.reshape(weight.shape[0], -1).contiguous() for weight in home]
        elements = sum(row.shape[1] for row in rows)
        if any(row.dtype != self.weights.dtype for row in rows) or elements != self.weights.shape[1]:
            raise RuntimeError(
                f"DeepEP's load-balancing region holds [{self.weights.shape[1]}] {self.weights.dtype} experts, "
                f"these are [{elements}] {rows[0].dtype}: the experts' compute dtype must be the tokens' "
                "(training.mixed_precision_param)"
            )
        # the kernels take the weights as lists: each home weight is read where it lies, into its own
        # contiguous block of the region (each parameter's expert row a multiple of 32 bytes)
        slots, region, blocks, start = self.weights.shape[0], self.weights.view(-1), [], 0
        for row in rows:
            blocks.append(region[start:start + slots * row.shape[1]].view(slots, row.shape[1]))
            start += slots * row.shape[1]
        if self.landing:
            raise RuntimeError("a replica fetch through DeepEP's load-balancing region before the last one landed: "
                               "the region holds one layer's replicas at a time")
        with kernel_call("deepep.lb_prefetch_weights"):
            event = self.buffer.lb_prefetch_weights(blocks, rows, redundancy_mapping, self.num_sms)
        self.landing = True
        rank = dist.get_rank(self.buffer.group)
        unused = (redundancy_mapping[rank] < 0).unsqueeze(1)
        fetched = self.weights.new_empty((slots, elements))

        def land(read=rows) -> None:
            # ``read`` (contiguous copies of the home weights among them) lives until the compute stream has
            # waited for the kernels that read it: only then may its memory be reused
            with calls.library_work():  # through the module: the ledger's CUDA sync check replaces it
                event.current_stream_wait()
            # copied out of the region, which the next fetch reuses
            torch.cat(blocks, dim=1, out=fetched).masked_fill_(unused, 0)
            self.landing = False

        return fetched, land

    def return_gradients(self, grad: torch.Tensor, redundancy_mapping: torch.Tensor, home_rows: int) -> torch.Tensor:
        self.gradients.copy_(grad)
        summed = torch.zeros((home_rows, grad.shape[1]), dtype=torch.float32, device=grad.device)
        with kernel_call("deepep.lb_reduce_grads"):
            self.buffer.lb_reduce_grads(self.gradients, summed, redundancy_mapping, self.num_sms).current_stream_wait()
        return summed


LB_ROW_ALIGNMENT = 32
"""Bytes one expert's row in DeepEP V2.5's load-balancing kernels is a multiple of (``get_num_tma_alignment()``)."""


def _why_not_load_balancing_kernels(group, parameter_elements: tuple[int, ...], weight_dtype: torch.dtype) -> str | None:
    """Why the EP group's replicas cannot go through DeepEP's load-balancing kernels, or None when they can.

    The library runs them per NVLink domain, with domain-local expert ids; a
    replica plan here may copy an expert across domains, so they serve an EP
    group that is one domain. Their gradient sums are fp32 additions in
    arrival order, not reproducible with three copies or more.
    """
    import deep_ep

    _, nvlink_ranks = deep_ep.get_physical_domain_size(group)
    if nvlink_ranks != group.size():
        return f"they reach one NVLink domain, here {nvlink_ranks} of the EP group's {group.size()} ranks"
    element_size = torch.empty((), dtype=weight_dtype).element_size()
    unaligned = [elements * element_size for elements in parameter_elements if elements * element_size % LB_ROW_ALIGNMENT]
    if unaligned:
        return (f"they move each expert parameter's row in a multiple of {LB_ROW_ALIGNMENT} bytes, and one of the "
                f"routed experts' is {unaligned[0]}")
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are on, and their gradient sums are in arrival order"
    return None


def _load_balancing_sms(buffer, configured: int | None) -> int:
    """``[deepep] num_sms``, else the library's estimate, which reads NVLink's rate from ``nvidia-smi``: where
    it reads 0 the estimate is 0, which the kernels refuse, so 20 SMs (as for dispatch), said once."""
    if configured:
        return configured
    estimate = buffer.lb_get_theoretical_num_sms()
    if estimate > 0:
        return estimate
    logger.warning(
        f"DeepEP could not estimate its load-balancing kernels' SM count ({FALLBACK_SMS} used): it read 0 GB/s "
        "for NVLink from nvidia-smi; set deepep.num_sms to choose"
    )
    return FALLBACK_SMS


def ep_buffer(group, shape, replica_slots: int, parameter_elements: tuple[int, ...], weight_dtype: torch.dtype,
              num_sms: int | None = None):
    """A DeepEP V2.5 ``EPBuffer`` for ``shape``, sized by the library; with ``replica_slots``, its
    load-balancing region for that many replicas of an expert whose row in each parameter holds
    ``parameter_elements``, where the kernels can carry them (:func:`_why_not_load_balancing_kernels`). Returns
    (buffer, :class:`LoadBalancingKernels`, or None: replicas move by all-to-all, as the log says)."""
    import deep_ep

    # the buffer borrows the EP group's NCCL communicator, created at the group's first collective
    dist.barrier(group=group)
    plan = weights = gradients = None
    if replica_slots:
        reason = _why_not_load_balancing_kernels(group, parameter_elements, weight_dtype)
        if reason is None:
            plan = deep_ep.BufferAllocator()
            weights = plan.allocate((replica_slots, sum(parameter_elements)), weight_dtype)
            gradients = plan.allocate((replica_slots, sum(parameter_elements)), torch.float32)
        else:
            logger.info(f"Expert replicas move by all-to-all, not DeepEP's load-balancing kernels: {reason}")
    buffer = deep_ep.EPBuffer(
        group,
        num_max_tokens_per_rank=shape.max_tokens_per_rank,
        hidden=shape.hidden_dim,
        num_topk=shape.top_k,
        lb_allocation_plan_or_num_bytes=plan if plan is not None else 0,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        explicitly_destroy=True,
    )
    logger.info(
        f"DeepEP EPBuffer: {buffer.num_bytes / 2**20:,.0f} MiB per rank, sized by the library for "
        f"{shape.max_tokens_per_rank} tokens per rank over {group.size()} ranks"
        + (f", and {buffer.num_lb_bytes / 2**20:,.1f} MiB for {replica_slots} replicas moved by its "
           "load-balancing kernels" if plan is not None else "")
    )
    if plan is None:
        return buffer, None
    return buffer, LoadBalancingKernels(buffer, weights, gradients, _load_balancing_sms(buffer, num_sms))


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
