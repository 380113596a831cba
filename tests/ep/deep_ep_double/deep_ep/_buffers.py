"""``Buffer`` (v1 API, deep_ep/buffers/legacy.py) and ``ElasticBuffer`` (V2, deep_ep/buffers/elastic.py)
of DeepEP main at dd758caf (V2.5's ``EPBuffer``, which keeps V2's dispatch and combine, is in
:mod:`deep_ep._ep_buffer`), computing with the double's own arithmetic (:mod:`deep_ep._kernels`);
``Buffer``'s constructor is the one of the build DEEP_EP_DOUBLE_BUILD names.

Both are created with ``explicitly_destroy`` by a careful caller: the library's ``destroy()`` is a
barrier and NCCL/NVSHMEM finalization over the group's communicator, and without the flag the C++
destructor runs it whenever the object goes. The double keeps every live buffer and fails a
``torch.distributed.destroy_process_group`` that would leave one of them behind (see :mod:`deep_ep._double`).
"""

import os
from typing import Optional

import torch
import torch.distributed as dist

from deep_ep import _kernels
from deep_ep._double import (
    BUILD, check_torch_deterministic, communicated, library_call, record_creation, register_live, runtime_assert,
)

topk_idx_t = torch.int64
"""deep_ep.topk_idx_t (EP_NUM_TOPK_IDX_BITS = 64 by default)."""

_RDMA_NODES = {"main": (2, 3, 4, 6, 8, 12, 16, 18, 20), "hybrid-ep": (2, 4, 8, 16, 18, 20)}.get(BUILD, ())
"""Nodes of 8 ranks the v1 internode kernels are instantiated for: main's csrc/kernels/legacy/launch.cuh:66-89,
the hybrid-ep branch's csrc/kernels/launch.cuh:85-94 (SWITCH_RDMA_RANKS); V2.5 has no v1."""

_DISPATCH_RANKS = {
    "main": (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160),
    "hybrid-ep": (2, 4, 8, 16, 24, 32, 64, 128, 144, 160),
}.get(BUILD, ())
"""get_dispatch_config / get_combine_config table keys: main's legacy.py:233-290; the hybrid-ep
branch's deep_ep/buffer.py:240-282 has no 48 or 96."""


class EventHandle:
    """Records an event on the current stream (csrc/utils/event.hpp); on CPU there is nothing to record."""

    def __init__(self, land=None):
        self._land = land

    def current_stream_wait(self) -> None:
        if self._land is not None:
            self._land()


class EventOverlap:
    """deep_ep/utils/event.py:8-96 (the hybrid-ep branch: deep_ep/utils.py:12-64)."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    if BUILD == "main":
        def current_stream_wait(self, release_handle: bool = False) -> None:
            assert self.event is not None
            self.event.current_stream_wait()
            if release_handle:
                self.event = None
    elif BUILD == "v2.5":
        hook_after_wait = None

        def current_stream_wait(self, release_handle: bool = False):
            """V2.5's deep_ep/utils/event.py: returns the registered hook's result (deferred epilogues)."""
            assert self.event is not None
            self.event.current_stream_wait()
            result = None
            if self.hook_after_wait is not None:
                result, self.hook_after_wait = self.hook_after_wait(), None
            if release_handle:
                self.event = None
            return result

        def wait(self):
            return self.current_stream_wait()

        def register_hook_after_wait(self, hook_after_wait) -> None:
            assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
            self.hook_after_wait = hook_after_wait
    else:
        def current_stream_wait(self) -> None:
            """The hybrid-ep branch's deep_ep/utils.py:36 (no release_handle)."""
            assert self.event is not None
            self.event.current_stream_wait()


class Config:
    """deep_ep.Config (csrc/legacy/config.hpp:31-99)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        runtime_assert(num_sms >= 0, "num_sms >= 0")
        runtime_assert(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "nvl send < recv")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        runtime_assert(num_ranks < 8 or num_ranks % 8 == 0, "num_ranks < 8 or num_ranks % 8 == 0")
        runtime_assert(num_ranks <= 8 or self.num_sms % 2 == 0, "num_sms % 2 == 0")
        channels = self.num_sms // 2
        nvl_ranks, rdma_ranks = min(num_ranks, 8), max(num_ranks // 8, 1)
        source_meta_bytes = 8
        size = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        size += channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens * (
            hidden_bytes + source_meta_bytes + 128 * 8 + 128 * 4 + 128 * 4
        )
        return (size + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= 8:
            return 0
        runtime_assert(num_ranks % 8 == 0 and self.num_sms % 2 == 0, "num_ranks % 8 == 0, num_sms even")
        return (self.num_sms // 2 * (num_ranks // 8) * 256 * (hidden_bytes + 1024) + 127) // 128 * 128


class _LegacyHandle(tuple):
    """The intranode handle: a 6-tuple (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)."""

    layout = None


def per_expert_count(num_tokens_per_expert: torch.Tensor) -> int:
    """The expert count, as the library reads it from ``num_tokens_per_expert``'s size."""
    return num_tokens_per_expert.numel()


def _combined(combined: torch.Tensor, weights, asynchronous: bool):
    """(combined, weights, event). Asynchronous: the output holds NaN until the event is waited on, so an
    adapter that reads it before then sees it (the library: whatever was in memory)."""
    if not asynchronous:
        return combined, weights, EventOverlap(None)
    landed = torch.full_like(combined, float("nan"))
    return landed, weights, EventOverlap(EventHandle(lambda: landed.copy_(combined)))


def _check_topk(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> None:
    """csrc/legacy/buffer.hpp:485-486, csrc/elastic/buffer.hpp:776-785."""
    runtime_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx 2-D contiguous")
    runtime_assert(topk_idx.dtype == topk_idx_t, f"topk_idx dtype {topk_idx.dtype} != topk_idx_t")
    if topk_weights is not None:
        _check_weights(topk_weights)
        runtime_assert(topk_weights.shape == topk_idx.shape, "topk_weights and topk_idx shapes")


def _check_weights(topk_weights: torch.Tensor) -> None:
    """csrc/legacy/buffer.hpp:772-774 (combine), :486 (dispatch); csrc/elastic/buffer.hpp:785, 1233-1234."""
    runtime_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-D contiguous")
    runtime_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32")


def _check_tokens(x: torch.Tensor) -> None:
    """csrc/legacy/buffer.hpp:457 (dispatch), :732 (combine); csrc/elastic/buffer.hpp:754, 1202."""
    runtime_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")


class Buffer:
    """deep_ep.Buffer, the v1 API (legacy.py:33-455), normal (intranode) mode."""

    num_sms: int = 20

    if BUILD == "main":
        def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                     low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                     allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                     explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None) -> None:
            """legacy.py:33-43."""
            self._connect(group, comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy)
    else:
        def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                     low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                     allow_nvlink_for_normal_mode: bool = True, allow_nvlink_for_low_latency_mode: bool = True,
                     allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                     comm=None) -> None:
            """The hybrid-ep branch's deep_ep/buffer.py:33-41 (no enable_shrink; allow_nvlink_for_normal_mode
            and use_fabric instead)."""
            self._connect(group, comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy)

    def _connect(self, group, comm, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 explicitly_destroy: bool) -> None:
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        record_creation()
        runtime_assert(num_nvl_bytes % 128 == 0 and num_rdma_bytes % 128 == 0, "buffer bytes % 128 == 0")
        num_ranks = group.size()
        runtime_assert(num_ranks < 8 or num_ranks % 8 == 0, "num_ranks < 8 or num_ranks % 8 == 0")
        # the library exchanges device ids and IPC handles with every rank
        handles = [None] * num_ranks
        dist.all_gather_object(handles, (group.rank(), "ipc handle"), group=group)
        self.group, self.rank, self.group_size = group, group.rank(), num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        register_live(self)

    def destroy(self) -> None:
        """legacy.py:138-147: asserts the flag; the runtime's destroy is a barrier and NVSHMEM finalization."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        dist.barrier(group=self.group)
        self.destroyed = True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _DISPATCH_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _DISPATCH_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        _check_topk(topk_idx, None)
        runtime_assert(num_experts > 0, "num_experts > 0")
        with library_call():
            local = num_experts // self.group_size
            valid = topk_idx >= 0
            owner = torch.where(valid, topk_idx // local, -1)
            in_rank = torch.stack([(owner == rank).any(dim=1) for rank in range(self.group_size)], dim=1)
            per_rank = in_rank.sum(dim=0).to(torch.int32)
            per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        # num_tokens_per_rdma_rank: None within one node (the intranode kernels)
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle() if async_finish else None)

    def dispatch(self, x, handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        check_torch_deterministic()
        _check_tokens(x)
        runtime_assert((x.shape[1] * x.element_size()) % 16 == 0, "hidden bytes % 16 == 0")
        event = EventOverlap(EventHandle() if async_finish else None)
        if self.group_size > 8:
            runtime_assert(self.group_size // 8 in _RDMA_NODES, 'false and "Unsupported RDMA ranks"')
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            with library_call():
                recv_x = _kernels.deepep_cached_dispatch(x, handle.layout, self.group)
            return recv_x, None, None, None, None, event
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        runtime_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        _check_topk(topk_idx, topk_weights)
        # the exact receive count comes from a CPU busy-wait on mapped host memory
        with library_call(host_syncs=1):
            recv_x, recv_idx, recv_weights, counts, layout = _kernels.deepep_dispatch(
                x, topk_idx, topk_weights, per_expert_count(num_tokens_per_expert), self.group
            )
        counts = [_kernels.round_up(count, expert_alignment) for count in counts]
        num_recv, channels = recv_x.shape[0], Buffer.num_sms // 2
        handle = _LegacyHandle((
            torch.zeros(self.group_size, self.group_size, dtype=torch.int32),
            torch.zeros(self.group_size, channels, dtype=torch.int32),
            torch.zeros(self.group_size, channels, dtype=torch.int32),
            torch.zeros(num_recv, dtype=torch.int32),
            is_token_in_rank,
            torch.zeros(x.shape[0], self.group_size, dtype=torch.int32),
        ))
        handle.layout = layout
        return recv_x, recv_idx, recv_weights, counts, handle, event

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        check_torch_deterministic()
        return _bf16_combine(self.group, x, handle, topk_weights, async_finish, 'false and "Unsupported type"',
                             _kernels.deepep_combine_weights_summed)


class EPHandle:
    """deep_ep.EPHandle (elastic.py:25-98): a plain object."""

    def __init__(self, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx,
                 num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
                 psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
                 num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
                 token_metadata_at_forward, channel_linked_list) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.layout = None


class ElasticBuffer:
    """deep_ep.ElasticBuffer, DeepEP V2 (elastic.py:228-1107), compact dispatch."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False) -> None:
        record_creation()
        if num_bytes is None:
            runtime_assert(num_max_tokens_per_rank > 0 and hidden > 0, "sizes for calculate_elastic_buffer_size")
            num_bytes = 2 ** 21
        runtime_assert(num_bytes > 0 and num_bytes % 2 ** 21 == 0, "Must be aligned to 2 MB")
        # comm.py:61-64: the group's NCCL communicator, borrowed (backend._comm_ptr()); torch creates it lazily,
        # at the group's first collective, and hands over 0 before
        runtime_assert(communicated(group), "the EP group's NCCL communicator (_comm_ptr) is 0: no collective has "
                                            "run on the group yet")
        self.group, self.rank_idx, self.num_ranks = group, group.rank(), group.size()
        # ranks that reach each other over NVLink; DEEP_EP_DOUBLE_RANKS_PER_NODE makes a CPU group "multi-node"
        per_node = int(os.environ.get("DEEP_EP_DOUBLE_RANKS_PER_NODE", "8"))
        self.num_scaleout_ranks = max(1, -(-self.num_ranks // per_node))
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        register_live(self)

    def destroy(self) -> None:
        """elastic.py:369-378: the runtime's destroy is a barrier, then NCCL window deregistration and
        device-communicator destruction on the borrowed communicator."""
        assert self.explicitly_destroy
        dist.barrier(group=self.group)
        self.destroyed = True

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """elastic.py:728-834, an instance method (:func:`theoretical_num_sms`)."""
        return theoretical_num_sms(self, num_experts, num_topk, rdma_gbs, nvlink_gbs)

    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        check_torch_deterministic()
        num_topk = topk_idx.shape[1] if topk_idx is not None else (handle.topk_idx.shape[1] if handle else 0)
        if num_sms == 0:
            # elastic.py:927: computed before num_experts is taken from a handle
            num_sms = self.get_theoretical_num_sms(num_experts, num_topk)
        if handle is None and do_handle_copy:
            topk_idx_kept = topk_idx.clone() if topk_idx is not None else None
        else:
            topk_idx_kept = topk_idx
        return compact_dispatch(
            self, EPHandle, x, topk_idx, topk_weights, topk_idx_kept, cumulative_local_expert_recv_stats, num_experts,
            num_max_tokens_per_rank, expert_alignment, num_sms, async_with_compute_stream, handle, do_cpu_sync,
            do_expand, do_zero_padding,
        )

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias=None, num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        check_torch_deterministic()  # elastic.py:1083
        return compact_combine(self, x, handle, topk_weights, async_with_compute_stream)


def theoretical_num_sms(buffer, num_experts: int, num_topk: int, rdma_gbs: float, nvlink_gbs: float) -> int:
    """V2's SM estimate (elastic.py:728-834; V2.5's ep.py keeps it). The bandwidths come from ibstat and
    ``nvidia-smi nvlink`` (utils/envs.py:192-268), 0 when unreadable: DEEP_EP_DOUBLE_DETECTED_GBPS stands for
    what they read (default 400), and on more than one scale-out rank a 0 divides by zero (elastic.py:809)."""
    num_groups = 4
    assert num_experts % num_groups == 0
    detected = float(os.environ.get("DEEP_EP_DOUBLE_DETECTED_GBPS", "400"))
    if rdma_gbs == 0 and buffer.num_scaleout_ranks > 1:
        rdma_gbs = detected
    if nvlink_gbs == 0:
        nvlink_gbs = detected
    # the traffic model's shape (elastic.py:790-809), not its numbers: the double uses no SMs
    traffic = float(num_topk)
    rdma_bound = buffer.num_scaleout_ranks > 1 and (traffic / rdma_gbs) > (traffic / nvlink_gbs)
    return max(4, 2 * ((num_topk + 1) // 2)) + (2 if rdma_bound else 0)


def compact_dispatch(buffer, handle_class, x, topk_idx, topk_weights, topk_idx_kept, cumulative_local_expert_recv_stats,
                     num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, asynchronous, handle,
                     do_cpu_sync, do_expand, do_zero_padding):
    """V2's (and V2.5's) dispatch once the SM count is set: (recv_x, recv_topk_idx, recv_topk_weights,
    handle, event); a cached dispatch returns None for the indices and weights. ``topk_idx_kept``: what the
    new handle keeps (V2 copies it by default, V2.5 keeps the caller's)."""
    event = EventOverlap(EventHandle() if asynchronous else None)
    runtime_assert(not do_zero_padding or do_expand, "not do_zero_padding or do_expand")
    _check_tokens(x)
    runtime_assert((x.shape[1] * x.element_size()) % 16 == 0, "hidden bytes % 16 == 0")
    if handle is not None:
        assert topk_idx is None
        assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
        with library_call():
            recv_x = _kernels.deepep_cached_dispatch(x, handle.layout, buffer.group)
        return recv_x, None, None, handle, event
    max_tokens = num_max_tokens_per_rank or buffer.num_max_tokens_per_rank
    runtime_assert(x.shape[0] <= max_tokens, "num_tokens <= num_max_tokens_per_rank")
    _check_topk(topk_idx, topk_weights)
    runtime_assert(num_experts % buffer.num_ranks == 0, "num_experts % num_ranks == 0")
    do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
    runtime_assert(do_cpu_sync and not do_expand, "the double implements compact dispatch with the CPU sync")
    with library_call(host_syncs=1):
        recv_x, recv_idx, recv_weights, counts, layout = _kernels.deepep_dispatch(
            x, topk_idx, topk_weights, num_experts, buffer.group
        )
    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats += torch.tensor(counts, dtype=cumulative_local_expert_recv_stats.dtype)
    counts = [_kernels.round_up(count, expert_alignment or 1) for count in counts]
    num_topk = topk_idx.shape[1]
    handle = handle_class(
        do_expand, num_experts, expert_alignment or 1, max_tokens, num_sms, topk_idx_kept, recv_x.shape[0],
        sum(counts), counts, torch.tensor([recv_x.shape[0]], dtype=torch.int32),
        torch.tensor(counts, dtype=torch.int32).cumsum(0), torch.tensor(counts, dtype=torch.int32),
        torch.zeros(recv_x.shape[0], num_topk + 2, dtype=torch.int32), None, None, None,
    )
    handle.layout = layout
    return recv_x, recv_idx, recv_weights, handle, event


def compact_combine(buffer, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor], asynchronous: bool):
    """V2's (and V2.5's) combine: (combined, combined weights, event)."""
    runtime_assert(x.dim() != 2 or x.shape[0] == handle.recv_src_metadata.shape[0], "src_metadata.size(0) == x.size(0)")
    return _bf16_combine(buffer.group, x, handle, topk_weights, asynchronous, "x.scalar_type() == torch::kBFloat16",
                         _kernels.deepep_combine_weights_from_owner)


def _bf16_combine(group, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor], asynchronous: bool,
                  dtype_assert: str, combine_weights) -> tuple:
    """The combine kernels' checks (2-D contiguous bf16 rows, fp32 weights) and arithmetic; ``combine_weights``:
    how the API returns the top-k weights (v1 sums them, V2 takes the owner's)."""
    _check_tokens(x)
    runtime_assert(x.dtype == torch.bfloat16, dtype_assert)
    if topk_weights is not None:
        _check_weights(topk_weights)
    with library_call():
        combined = _kernels.deepep_combine(x, handle.layout, group)
        weights = None
        if topk_weights is not None:
            weights = combine_weights(topk_weights, handle.layout, group)
    return _combined(combined, weights, asynchronous)
