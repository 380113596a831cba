"""The upstream deep_ep API the adapters call, as read in the library's sources.

Each entry: qualified name -> (parameters as ``inspect.signature`` renders them
without annotations, number of values returned (None: not a call whose result
the adapters unpack), repository, path, commit read). tests/ep/test_deep_ep_double.py
checks that the double has exactly these signatures (on the hybrid-ep build, with
HYBRID_EP_BUILD's in place of the same names), so that an adapter call
that would not bind against the library does not bind against the double.
"""

DEEPEP_MAIN = ("deepseek-ai/DeepEP", "dd758caf451848bd150e1046af3d0a73e5fff38d")
"""DeepEP main, v2.1.0."""
DEEPEP_HYBRID = ("deepseek-ai/DeepEP", "94a9f8f6b146c07d97ec58f67cd6d303296d6098")
"""DeepEP branch hybrid-ep."""

LEGACY = "deep_ep/buffers/legacy.py"
ELASTIC = "deep_ep/buffers/elastic.py"
HYBRID = "deep_ep/hybrid_ep_buffer.py"

MANIFEST = {
    "Buffer.__init__": (
        "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, "
        "allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, "
        "enable_shrink=False, comm=None)", None, *DEEPEP_MAIN, LEGACY + ":33"),
    "Buffer.set_num_sms": ("(new_num_sms)", None, *DEEPEP_MAIN, LEGACY + ":154"),
    "Buffer.get_dispatch_config": ("(num_ranks)", None, *DEEPEP_MAIN, LEGACY + ":233"),
    "Buffer.get_combine_config": ("(num_ranks)", None, *DEEPEP_MAIN, LEGACY + ":263"),
    "Buffer.get_dispatch_layout": (
        "(self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False)",
        5, *DEEPEP_MAIN, LEGACY + ":293"),
    "Buffer.dispatch": (
        "(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, "
        "num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, "
        "config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False)",
        6, *DEEPEP_MAIN, LEGACY + ":322"),
    "Buffer.combine": (
        "(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, "
        "allocate_on_comm_stream=False)", 3, *DEEPEP_MAIN, LEGACY + ":408"),
    "Config.__init__": (
        "(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
        "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)",
        None, *DEEPEP_MAIN, "csrc/legacy/buffer.hpp:1751"),
    "Config.get_nvl_buffer_size_hint": ("(self, hidden_bytes, num_ranks)", None, *DEEPEP_MAIN, "csrc/legacy/config.hpp:53"),
    "Config.get_rdma_buffer_size_hint": ("(self, hidden_bytes, num_ranks)", None, *DEEPEP_MAIN, "csrc/legacy/config.hpp:75"),
    "EventOverlap.__init__": ("(self, event=None, extra_tensors=None)", None, *DEEPEP_MAIN, "deep_ep/utils/event.py:8"),
    "EventOverlap.current_stream_wait": ("(self, release_handle=False)", None, *DEEPEP_MAIN, "deep_ep/utils/event.py"),
    "ElasticBuffer.__init__": (
        "(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0, "
        "use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True, "
        "prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300, "
        "num_gpu_timeout_secs=100, explicitly_destroy=False)", None, *DEEPEP_MAIN, ELASTIC + ":228"),
    "ElasticBuffer.get_theoretical_num_sms": (
        "(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50)",
        None, *DEEPEP_MAIN, ELASTIC + ":729"),
    "ElasticBuffer.dispatch": (
        "(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None, "
        "num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None, "
        "previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False, "
        "handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False, "
        "use_tma_aligned_col_major_sf=False)", 5, *DEEPEP_MAIN, ELASTIC + ":855"),
    "ElasticBuffer.combine": (
        "(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None, "
        "previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False)",
        3, *DEEPEP_MAIN, ELASTIC + ":1046"),
    "EPHandle.__init__": (
        "(self, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx, "
        "num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list, "
        "psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert, "
        "num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx, "
        "token_metadata_at_forward, channel_linked_list)", None, *DEEPEP_MAIN, ELASTIC + ":59"),
    "HybridEPBuffer.__init__": (
        "(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts, use_fp8=False, "
        "num_sms_dispatch_api=None, num_sms_combine_api=None, num_sms_preprocessing_api=None, "
        "num_blocks_permute=None, num_blocks_unpermute=None, load_cached_kernels=False, use_shared_buffer=True, "
        "enable_custom_allgather=False, num_of_hybrid_ep_ranks_per_nvlink_domain=None, use_mnnvl=None)",
        None, *DEEPEP_HYBRID, HYBRID + ":35"),
    "HybridEPBuffer.dispatch_with_permute": (
        "(self, *, hidden, topk_idx=None, topk_weights=None, num_of_experts_per_rank=None, num_of_experts=None, "
        "use_fp8=None, routing_map=None, probs=None, scaling_factor=None, num_permuted_tokens=None, "
        "pad_multiple=None, handle=None, non_blocking=False, fuse_permute_dispatch=False, "
        "num_dispatched_tokens=None, use_host_meta=None)", 5, *DEEPEP_HYBRID, HYBRID + ":289"),
    "HybridEPBuffer.combine_with_unpermute": (
        "(self, *, hidden, probs=None, handle=None, pad_multiple=None, fuse_unpermute_combine=False, "
        "num_dispatched_tokens=None)", 2, *DEEPEP_HYBRID, HYBRID + ":434"),
    "indices_to_map": ("(topk_idx, topk_weights, num_of_tokens, num_of_experts)", 2, *DEEPEP_HYBRID, HYBRID + ":9"),
}

HYBRID_EP_BUILD = {
    "Buffer.__init__": (
        "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24, "
        "allow_nvlink_for_normal_mode=True, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, "
        "use_fabric=False, explicitly_destroy=False, comm=None)", None, *DEEPEP_HYBRID, "deep_ep/buffer.py:33"),
    "EventOverlap.current_stream_wait": ("(self)", None, *DEEPEP_HYBRID, "deep_ep/utils.py:36"),
}
"""Where the hybrid-ep branch's build differs from MANIFEST in what the adapters call (the rest of
its v1 ``Buffer`` has main's signatures)."""

DEEPEP_V2_5_EP = ("deepseek-ai/DeepEP", "13b3abaa6a896e65fc9a11d8aedc83afd80804ee")
"""DeepEP V2.5's deep_ep/buffers/ep.py, as stored at that commit (the README of the release: 93eb6eb2)."""
DEEPEP_V2_5_ALLOCATOR = ("deepseek-ai/DeepEP", "1a1ffbac1f9ba94e1f731f7647b5d6353fb38ade")
DEEPEP_V2_5_EVENT = ("deepseek-ai/DeepEP", "def865146e95aa9ea223e277c0a8a4c6b81e5ac7")
DEEPEP_V2_5_COMM = ("deepseek-ai/DeepEP", "93eb6eb238127e96c6d7a4a625a6dad158348509")

EP = "deep_ep/buffers/ep.py"

V2_5_BUILD = {
    "EPBuffer.__init__": (
        "(self, group, num_bytes=None, num_max_tokens_per_rank=0, hidden=0, num_topk=0, use_fp8_dispatch=False, "
        "lb_allocation_plan_or_num_bytes=0, deterministic=False, allow_hybrid_mode=True, "
        "allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=None, num_allocated_qps=0, "
        "num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False)", None, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.get_theoretical_num_sms": (
        "(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0, sm_read_gbs=0, sm_write_gbs=0)",
        None, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.dispatch": (
        "(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None, "
        "num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None, "
        "async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None, do_handle_copy=False, "
        "do_cpu_sync=None, do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False, "
        "defer_epilogue=False)", 5, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.combine": (
        "(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None, "
        "async_with_compute_stream=False, allocate_on_comm_stream=False, defer_epilogue=False)",
        3, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.lb_prefetch_weights": (
        "(self, redundant_expert_weights, expert_weights, redundancy_mapping, num_sms=0, previous_event=None)",
        None, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.lb_reduce_grads": (
        "(self, redundant_expert_grads, expert_grads, redundancy_mapping, num_sms=0, previous_event=None)",
        None, *DEEPEP_V2_5_EP, EP),
    "EPBuffer.destroy": ("(self)", None, *DEEPEP_V2_5_EP, EP),
    "EPHandle.__init__": MANIFEST["EPHandle.__init__"][:2] + (*DEEPEP_V2_5_EP, EP),
    "BufferAllocator.__init__": ("(self)", None, *DEEPEP_V2_5_ALLOCATOR, "deep_ep/buffers/allocator.py"),
    "BufferAllocator.allocate": ("(self, shape, dtype)", None, *DEEPEP_V2_5_ALLOCATOR, "deep_ep/buffers/allocator.py"),
    "EventOverlap.__init__": ("(self, event=None, extra_tensors=None)", None, *DEEPEP_V2_5_EVENT,
                              "deep_ep/utils/event.py"),
    "EventOverlap.current_stream_wait": ("(self, release_handle=False)", None, *DEEPEP_V2_5_EVENT,
                                         "deep_ep/utils/event.py"),
    "get_physical_domain_size": ("(group_or_buffer)", None, *DEEPEP_V2_5_COMM,
                                 "deep_ep/comm/handle.py (exported by deep_ep/__init__.py)"),
}
"""DeepEP V2.5's API as the adapters call it: the package exports these, and no ``Buffer`` or ``ElasticBuffer``
("Fully remove V1"; ``ElasticBuffer`` split into ``EPBuffer`` and others)."""

V2_5_REMOVED = ("Buffer", "Config", "ElasticBuffer", "HybridEPBuffer")
