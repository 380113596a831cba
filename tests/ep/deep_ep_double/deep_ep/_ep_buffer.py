"""DeepEP V2.5 (deep_ep/buffers/ep.py, allocator.py; csrc EPBuffer): ``EPBuffer``, its ``EPHandle`` and the
``BufferAllocator`` that plans its load-balancing (LB) region, computing with the double's own arithmetic.

What an adapter can trip on, as the sources have it:

- dispatch and combine are V2's (``ElasticBuffer`` split by job), with V2.5's signatures:
  ``do_handle_copy`` must be False, and the handle keeps the caller's ``topk_idx``, which must not change
  while the handle is in use (its version counter is checked);
- ``lb_prefetch_weights`` / ``lb_reduce_grads`` are collective over the NVLink domain and asynchronous:
  their results land when the returned event is waited on (before, the destinations hold garbage, here
  0xFF bytes, NaN in floating point, and ``lb_reduce_grads`` has added nothing yet);
- the redundant tensors must lie in the buffer's LB region (a ``BufferAllocator`` plan, every allocation
  2 MiB-aligned); the mapping is a [NVLink ranks, slots] int32 table identical on every rank, whose entries
  are domain-local expert ids (owner * local experts + local id) or -1, never the rank's own experts;
  rows are multiples of 32 bytes (``get_num_tma_alignment``); gradients are fp32 only.
"""

import os
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from deep_ep import _buffers
from deep_ep._buffers import compact_combine, compact_dispatch, EventHandle, EventOverlap, theoretical_num_sms
from deep_ep._double import (
    check_torch_deterministic, communicated, library_call, record_creation, register_live, runtime_assert,
)

ALLOCATION_ALIGNMENT = 2 * 1024 * 1024
"""kNumAllocationAlignmentBytes (csrc/common/compiled.cuh)."""

DEVICE_SMS = 132
"""The SMs of the device the double stands for (an H100 SXM)."""

TMA_ALIGNMENT = 32
"""kNumTMAAlignmentBytes, the multiple an LB row's bytes must be (README, "Expert load balancing")."""


def get_num_allocation_alignment() -> int:
    return ALLOCATION_ALIGNMENT


def get_num_tma_alignment() -> int:
    return TMA_ALIGNMENT


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _domain(group) -> Tuple[int, int]:
    """(RDMA ranks, NVLink ranks): DEEP_EP_DOUBLE_RANKS_PER_NODE ranks reach each other over NVLink."""
    per_node = int(os.environ.get("DEEP_EP_DOUBLE_RANKS_PER_NODE", "8"))
    return -(-group.size() // per_node), min(group.size(), per_node)


def get_physical_domain_size(group_or_buffer) -> Tuple[int, int]:
    """deep_ep/comm/handle.py: a buffer's domain, or a group's through its NCCL communicator, borrowed (it
    exists after the group's first collective)."""
    if isinstance(group_or_buffer, EPBuffer):
        return group_or_buffer.num_rdma_ranks, group_or_buffer.num_nvlink_ranks
    runtime_assert(communicated(group_or_buffer), "the group's NCCL communicator (_comm_ptr) is 0: no collective "
                                                  "has run on it")
    return _domain(group_or_buffer)


class BufferAllocator:
    """deep_ep/buffers/allocator.py: plans aligned tensors as meta placeholders, swapped for views of the
    buffer's storage when the buffer is built."""

    def __init__(self):
        self.alignment = get_num_allocation_alignment()
        self.allocations: List[Tuple[torch.Tensor, int]] = []
        self.num_bytes = 0
        self.materialized = False

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        assert not self.materialized, "A materialized allocation plan cannot be changed"
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        offset = _align(self.num_bytes, self.alignment)
        self.allocations.append((tensor, offset))
        self.num_bytes = _align(offset + tensor.nbytes, self.alignment)
        return tensor

    def materialize(self, storage: torch.Tensor) -> None:
        """As the library's, on the double's device (the library asserts CUDA storage)."""
        assert not self.materialized, "An allocation plan can only be materialized once"
        assert storage.is_contiguous() and storage.dtype == torch.uint8
        assert storage.numel() == self.num_bytes
        for tensor, offset in self.allocations:
            value = storage.narrow(0, offset, tensor.nbytes).view(tensor.dtype).view(tensor.shape)
            torch.utils.swap_tensors(tensor, value)
        self.materialized = True


class EPHandle(_buffers.EPHandle):
    """deep_ep.EPHandle (ep.py): V2's fields; ``topk_idx`` is the caller's, checked unchanged on every read."""

    @property
    def topk_idx(self) -> torch.Tensor:
        assert self._topk_idx_version is None or self._topk_idx._version == self._topk_idx_version, \
            "`topk_idx` must not be modified while the EP handle is in use"
        return self._topk_idx

    @topk_idx.setter
    def topk_idx(self, topk_idx: torch.Tensor) -> None:
        assert topk_idx is not None
        self._topk_idx = topk_idx
        self._topk_idx_version = None if topk_idx.is_inference() else topk_idx._version


class EPBuffer:
    """deep_ep.EPBuffer (ep.py), compact dispatch with the CPU sync, and the LB primitives."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: Union[BufferAllocator, int] = 0, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: Optional[int] = None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        record_creation()
        if num_bytes is None:
            runtime_assert(num_max_tokens_per_rank > 0 and hidden > 0, "sizes for calculate_ep_buffer_size")
            num_bytes = ALLOCATION_ALIGNMENT
        plan = lb_allocation_plan_or_num_bytes if isinstance(lb_allocation_plan_or_num_bytes, BufferAllocator) else None
        num_lb_bytes = lb_allocation_plan_or_num_bytes if plan is None else plan.num_bytes
        if plan is not None:
            assert not plan.materialized
        assert isinstance(num_lb_bytes, int) and num_lb_bytes >= 0
        runtime_assert(num_bytes > 0 and num_bytes % ALLOCATION_ALIGNMENT == 0, "num_buffer_bytes % 2 MiB == 0")
        runtime_assert(num_lb_bytes % ALLOCATION_ALIGNMENT == 0, "num_lb_buffer_bytes % 2 MiB == 0")
        runtime_assert(communicated(group), "the EP group's NCCL communicator (_comm_ptr) is 0: no collective has "
                                            "run on the group yet")
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        self.num_rdma_ranks, self.num_nvlink_ranks = _domain(group)
        self.num_scaleout_ranks = self.num_rdma_ranks
        self.num_bytes, self.num_lb_bytes = num_bytes, num_lb_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.lb_storage = torch.empty(num_lb_bytes, dtype=torch.uint8)
        if plan is not None:
            plan.materialize(self.lb_storage)
        register_live(self)

    def destroy(self) -> None:
        """BufferBase.destroy: asserts the flag; the runtime's destroy is a barrier over the communicator."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        dist.barrier(group=self.group)
        self.destroyed = True

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 0,
                                sm_write_gbs: float = 0) -> int:
        assert num_scaleout_topk == 0
        return theoretical_num_sms(self, num_experts, num_topk, rdma_gbs, nvlink_gbs)

    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = False, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 defer_epilogue: bool = False):
        assert not do_handle_copy, "`do_handle_copy` must be False; handle copying is no longer supported"
        check_torch_deterministic()
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else _align(num_sms, 2)
        runtime_assert(not defer_epilogue or async_with_compute_stream, "defer_epilogue needs async_with_compute_stream")
        if handle is not None:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            topk_idx = handle.topk_idx
            assert (value_or(num_experts, handle.num_experts), value_or(expert_alignment, handle.expert_alignment),
                    value_or(num_max_tokens_per_rank, handle.num_max_tokens_per_rank)) == \
                   (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            result = compact_dispatch(self, EPHandle, x, None, None, None, None, None, None, None, num_sms,
                                      async_with_compute_stream, handle, False, do_expand, do_zero_padding)
        else:
            result = compact_dispatch(
                self, EPHandle, x, topk_idx, topk_weights, topk_idx, cumulative_local_expert_recv_stats, num_experts,
                num_max_tokens_per_rank, expert_alignment, num_sms, async_with_compute_stream, None, do_cpu_sync,
                do_expand, do_zero_padding,
            )
        if defer_epilogue:
            *outputs, event = result
            event.register_hook_after_wait(lambda: tuple(outputs))
            return event
        return result

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                defer_epilogue: bool = False):
        check_torch_deterministic()
        runtime_assert(not defer_epilogue or async_with_compute_stream, "defer_epilogue needs async_with_compute_stream")
        combined, weights, event = compact_combine(self, x, handle, topk_weights, async_with_compute_stream)
        if defer_epilogue:
            event.register_hook_after_wait(lambda: (combined, weights))
            return event
        return combined, weights, event

    def lb_get_theoretical_num_sms(self) -> int:
        """ep.py: NVLink's rate over an SM's read and write rates, even; NVLink's rate is what
        ``nvidia-smi nvlink`` reads (DEEP_EP_DOUBLE_DETECTED_GBPS), 0 where unreadable, and then so is this."""
        nvlink_gbs = float(os.environ.get("DEEP_EP_DOUBLE_DETECTED_GBPS", "400"))
        return _align(-(-int(nvlink_gbs) // 50), 2)

    @staticmethod
    def _check_sms(num_sms: int) -> None:
        runtime_assert(0 < num_sms <= DEVICE_SMS, "num_sms > 0 and num_sms <= jit->device.get_num_sms()")

    def _check_in_lb_region(self, tensor: torch.Tensor, what: str) -> None:
        begin = self.lb_storage.data_ptr()
        inside = begin <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= begin + self.lb_storage.nbytes
        assert self.lb_storage.numel() and inside, f"{what} must reside in this buffer's LB region"

    def _check_mapping(self, mapping: torch.Tensor, num_local_experts: int) -> torch.Tensor:
        """The checks of csrc (shape, int32, contiguous) and of the README (identical on every rank, ids in
        range, no rank's own experts); returns every rank's table as gathered."""
        runtime_assert(mapping.is_contiguous() and mapping.dim() == 2, "redundancy_mapping contiguous 2-D")
        runtime_assert(mapping.size(0) == self.num_nvlink_ranks, "redundancy_mapping.size(0) == num_nvl_ranks")
        runtime_assert(mapping.dtype == torch.int32, "redundancy_mapping.scalar_type() == torch::kInt")
        runtime_assert(self.num_nvlink_ranks == self.num_ranks, "the double runs the LB kernels on one NVLink domain")
        gathered = [torch.empty_like(mapping) for _ in range(self.num_ranks)]
        dist.all_gather(gathered, mapping, group=self.group)
        assert all(torch.equal(table, mapping) for table in gathered), "redundancy_mapping differs between ranks"
        assert bool(((mapping >= -1) & (mapping < self.num_nvlink_ranks * num_local_experts)).all()), mapping
        owners = torch.where(mapping >= 0, mapping // num_local_experts, -1)
        ranks = torch.arange(self.num_nvlink_ranks).unsqueeze(1)
        assert not bool((owners == ranks).any()), "a rank's own experts must not appear in its redundant slots"
        return mapping

    def lb_prefetch_weights(self, redundant_expert_weights: Union[Sequence[torch.Tensor], torch.Tensor],
                            expert_weights: Union[Sequence[torch.Tensor], torch.Tensor],
                            redundancy_mapping: torch.Tensor, num_sms: int = 0,
                            previous_event: Optional[EventHandle] = None) -> EventOverlap:
        self._check_sms(self.lb_get_theoretical_num_sms() if num_sms == 0 else _align(num_sms, 2))
        destinations = [redundant_expert_weights] if isinstance(redundant_expert_weights, torch.Tensor) \
            else list(redundant_expert_weights)
        sources = [expert_weights] if isinstance(expert_weights, torch.Tensor) else list(expert_weights)
        runtime_assert(len(destinations) == len(sources) and sources, "matching nonempty weight lists")
        num_redundant = redundancy_mapping.size(1)
        num_local = sources[0].size(0)
        runtime_assert(num_local > 0, "num_local_experts > 0")
        mapping = self._check_mapping(redundancy_mapping, num_local)
        landings = []
        with library_call():
            for destination, source in zip(destinations, sources):
                runtime_assert(destination.is_contiguous() and source.is_contiguous(), "contiguous weights")
                runtime_assert(destination.dim() >= 1 and source.dim() >= 1, "weights have a leading dimension")
                runtime_assert(destination.size(0) == num_redundant and source.size(0) == num_local, "leading dims")
                row_bytes = destination[0].nbytes if num_redundant else 0
                runtime_assert(row_bytes == source[0].nbytes, "bytes per expert match")
                runtime_assert(row_bytes % TMA_ALIGNMENT == 0, "num_bytes_per_expert % 32 == 0")
                self._check_in_lb_region(destination, "redundant_expert_weights")
                rows = source.reshape(num_local, -1).view(torch.uint8)
                every_rank = [torch.empty_like(rows) for _ in range(self.num_ranks)]
                dist.all_gather(every_rank, rows.contiguous(), group=self.group)
                arrived = destination.reshape(num_redundant, -1).view(torch.uint8).clone()
                for slot, expert in enumerate(mapping[self.rank_idx].tolist()):
                    if expert >= 0:
                        arrived[slot] = every_rank[expert // num_local][expert % num_local]
                destination.view(torch.uint8).fill_(0xFF)
                landings.append((destination, arrived))

        def land():
            for destination, arrived in landings:
                destination.reshape(num_redundant, -1).view(torch.uint8).copy_(arrived)

        return EventOverlap(EventHandle(land))

    def lb_reduce_grads(self, redundant_expert_grads: torch.Tensor, expert_grads: torch.Tensor,
                        redundancy_mapping: torch.Tensor, num_sms: int = 0,
                        previous_event: Optional[EventHandle] = None) -> EventOverlap:
        self._check_sms(self.lb_get_theoretical_num_sms() if num_sms == 0 else _align(num_sms, 2))
        runtime_assert(redundant_expert_grads.is_contiguous() and expert_grads.is_contiguous(), "contiguous grads")
        runtime_assert(redundant_expert_grads.dim() == 2 and expert_grads.dim() == 2, "2-D grads")
        num_local, hidden = expert_grads.shape
        mapping = self._check_mapping(redundancy_mapping, num_local)
        runtime_assert(redundant_expert_grads.size(0) == mapping.size(1), "redundant_expert_grads.size(0)")
        runtime_assert(redundant_expert_grads.size(1) == hidden, "redundant_expert_grads.size(1) == hidden")
        runtime_assert(redundant_expert_grads.dtype == torch.float32, "redundant_expert_grads kFloat")
        runtime_assert(expert_grads.dtype == torch.float32, "expert_grads kFloat")
        self._check_in_lb_region(redundant_expert_grads, "redundant_expert_grads")
        with library_call():
            every_rank = [torch.empty_like(redundant_expert_grads) for _ in range(self.num_ranks)]
            dist.all_gather(every_rank, redundant_expert_grads, group=self.group)
            added = torch.zeros_like(expert_grads)
            for rank, table in enumerate(mapping.tolist()):
                for slot, expert in enumerate(table):
                    if expert >= 0 and expert // num_local == self.rank_idx:
                        added[expert % num_local] += every_rank[rank][slot]
        return EventOverlap(EventHandle(lambda: expert_grads.add_(added)))


def value_or(value, default):
    return default if value is None else value
