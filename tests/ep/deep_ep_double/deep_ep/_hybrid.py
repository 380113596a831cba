"""``HybridEPBuffer`` of DeepEP's hybrid-ep branch at 94a9f8f6 (deep_ep/hybrid_ep_buffer.py), computing with
the double's own arithmetic (:mod:`deep_ep._kernels`).

Its kernels are compiled on first use (csrc/hybrid_ep/jit/compiler.cu): ``$CUDA_HOME/bin/nvcc`` into
``<HYBRID_EP_CACHE_DIR, else $HOME, else /tmp>/.deepep/hybrid_ep/jit/proc-<pid>``; the double needs both at
its first dispatch, as the library does.
"""

import dataclasses
import os
import pwd
from pathlib import Path

import torch
import torch.distributed as dist

from deep_ep import _kernels
from deep_ep._double import c_assert, HostTensor, library_call, record_creation

TOKENS_PER_CHUNK = 64
"""NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API's default."""

UNINITIALISED_FLAG = 7
"""What the never-written overflow flag of a blocking dispatch holds here (the library: whatever was in memory)."""

UNINITIALISED_MAP = True
"""What the never-written local_expert_routing_map holds here: dispatch_with_permute always runs the
preprocessing with enable_permute (its permute-fusion build), which never writes that map (executor.cu:110-112 allocates it with
torch::empty; hybrid_ep_backend.cuh:5584-5586: "Valid only when permute fusion is NOT enabled")."""


def indices_to_map(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_of_tokens: int, num_of_experts: int):
    """hybrid_ep_buffer.py:9-31: (routing_map bool [T, E], probs fp32 [T, E] or None)."""
    routing_map = torch.zeros(num_of_tokens, num_of_experts, dtype=torch.bool)
    routing_map.scatter_(1, topk_idx.to(torch.int64), True)
    probs = None
    if topk_weights is not None:
        probs = torch.zeros(num_of_tokens, num_of_experts, dtype=torch.float32)
        probs.scatter_(1, topk_idx.to(torch.int64), topk_weights.float())
    return routing_map, probs


def _check_inputs(hidden: torch.Tensor, probs: torch.Tensor | None) -> None:
    """The tokens, and the probs when given, contiguous; probs fp32."""
    c_assert(hidden.is_contiguous(), "hidden.is_contiguous()")
    if probs is not None:
        c_assert(probs.is_contiguous(), "probs.value().is_contiguous()")
        c_assert(probs.dtype == torch.float32, "probs.value().dtype() == torch::kFloat32")


class _HybridHandle(tuple):
    """The 11-tuple handle (hybrid_ep_buffer.py:419-431): sparse_to_dense_map, rdma_to_attn_map,
    attn_to_rdma_map, num_dispatched_tokens_tensor, local_expert_routing_map, dense_chunk_layout,
    dense_to_expert_map, tokens_per_expert (raw, clipped when dropping), num_of_tokens_per_rank,
    config, overflow_flag."""

    layout = None


def jit_compile() -> None:
    """What the first kernel build needs (compiler.cu:20-55, 149-151): nvcc at $CUDA_HOME/bin/nvcc and a
    writable per-process cache folder."""
    nvcc = Path(os.environ.get("CUDA_HOME", "") + "/bin/nvcc")
    if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
        raise RuntimeError(f"Failed to compile the code, compile command: {nvcc} ...")
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        home = ""
    base = os.environ.get("HYBRID_EP_CACHE_DIR") or home or "/tmp"
    (Path(base) / ".deepep" / "hybrid_ep" / "jit" / f"proc-{os.getpid()}").mkdir(parents=True, exist_ok=True)


class HybridEPBuffer:
    """deep_ep.HybridEPBuffer (hybrid_ep_buffer.py:35-479)."""

    def __init__(self, group, hidden_dim: int, max_num_of_tokens_per_rank: int, num_local_experts: int,
                 use_fp8: bool = False, num_sms_dispatch_api: int = None, num_sms_combine_api: int = None,
                 num_sms_preprocessing_api: int = None, num_blocks_permute: int = None,
                 num_blocks_unpermute: int = None, load_cached_kernels: bool = False,
                 use_shared_buffer: bool = True, enable_custom_allgather: bool = False,
                 num_of_hybrid_ep_ranks_per_nvlink_domain: int = None, use_mnnvl: bool = None):
        record_creation()
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        configured = os.environ.get("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN")
        # the library counts the peer-accessible GPUs: up to 8 on an HGX node
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = int(configured) if configured else min(self.group_size, 8)
        domain = self.num_of_hybrid_ep_ranks_per_nvlink_domain
        assert self.group_size % domain == 0
        if not (hidden_dim % 16 == 0 and (num_local_experts * domain) % 4 == 0
                and (TOKENS_PER_CHUNK * domain) % 4 == 0):
            raise RuntimeError("The buffer config is not valid.")
        c_assert(
            self.group_size <= domain or os.environ.get("DEEP_EP_DOUBLE_MULTINODE_BUILD") == "1",
            "Inter-node communication is not supported. Please rebuild with HYBRID_EP_MULTINODE flag",
        )
        handles = [None] * self.group_size
        dist.all_gather_object(handles, ("ipc handle", self.rank), group=group)
        self.num_local_experts = num_local_experts
        self.compiled = False

    def dispatch_with_permute(self, *, hidden: torch.Tensor, topk_idx: torch.Tensor = None,
                              topk_weights: torch.Tensor = None, num_of_experts_per_rank: int = None,
                              num_of_experts: int = None, use_fp8: bool = None, routing_map: torch.Tensor = None,
                              probs: torch.Tensor = None, scaling_factor: torch.Tensor = None,
                              num_permuted_tokens: int = None, pad_multiple: int = None, handle: tuple = None,
                              non_blocking: bool = False, fuse_permute_dispatch: bool = False,
                              num_dispatched_tokens: int = None, use_host_meta: bool = None):
        num_tokens = hidden.shape[0]
        _check_inputs(hidden, probs)  # hybrid_ep.cu:279-285
        remainder = num_tokens % TOKENS_PER_CHUNK
        if remainder and (remainder * self.num_of_hybrid_ep_ranks_per_nvlink_domain * 4) % 16:
            raise RuntimeError("TMA 16B alignment error")
        if not self.compiled:
            jit_compile()
            self.compiled = True
        if handle is not None:
            if num_permuted_tokens is None:  # HandleImpl.num_permuted_tokens is a C++ int64_t
                raise TypeError("incompatible function arguments: num_permuted_tokens must be an int")
            c_assert(num_permuted_tokens >= 0, "args.num_permuted_tokens >= 0")
            layout = handle.layout
            if num_permuted_tokens != layout.num_rows:
                layout = dataclasses.replace(
                    layout, num_rows=int(num_permuted_tokens),
                    row_of=torch.where(layout.row_of < num_permuted_tokens, layout.row_of, -1),
                    pad_rows=[(first, min(count, num_permuted_tokens - first))
                              for first, count in layout.pad_rows if first < num_permuted_tokens],
                )
            with library_call():
                tokens, _ = _kernels.hybrid_permute(self._as_read(hidden), layout, self.group)
            return self._as_written(tokens, hidden.dtype), None, None, None, handle
        if routing_map is not None:
            assert routing_map.dtype == torch.bool
        if non_blocking:
            assert num_permuted_tokens is not None and num_permuted_tokens >= 0
            if pad_multiple is not None and pad_multiple > 0:
                assert num_permuted_tokens % pad_multiple == 0
        assert hidden.shape[0] == routing_map.shape[0]
        with library_call(host_syncs=0 if non_blocking else 1):  # blocking: cudaStreamSynchronize for the sizes
            layout = _kernels.hybrid_layout(
                routing_map, num_of_experts_per_rank, num_permuted_tokens if non_blocking else None, pad_multiple,
                self.group,
            )
            tokens, out_probs = _kernels.hybrid_permute(
                self._as_read(hidden), layout, self.group, probs, num_of_experts_per_rank
            )
        tokens_per_expert = layout.tokens_per_expert
        flag = (torch.tensor([int(layout.dropped)], dtype=torch.int32) if non_blocking
                else torch.full((1,), UNINITIALISED_FLAG, dtype=torch.int32))
        dispatched = torch.tensor([tokens.shape[0]], dtype=torch.int32)
        handle = _HybridHandle((
            torch.zeros(num_tokens, self.num_of_hybrid_ep_ranks_per_nvlink_domain, dtype=torch.int32),
            torch.zeros(num_tokens, 1, dtype=torch.bool),
            torch.zeros(num_tokens, 0, dtype=torch.bool),
            dispatched if non_blocking else HostTensor.wrap(dispatched),
            torch.full((num_tokens * self.group_size, self.num_local_experts), UNINITIALISED_MAP),
            torch.zeros(1, dtype=torch.int32),
            layout.row_of.to(torch.int32),
            layout.kept,
            num_tokens,
            "HybridEpConfigInstance",
            flag,
        ))
        handle.layout = layout
        if not non_blocking:
            tokens_per_expert = HostTensor.wrap(tokens_per_expert)  # pinned host memory in blocking mode
        return self._as_written(tokens, hidden.dtype), out_probs, None, tokens_per_expert, handle

    def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: torch.Tensor = None, handle: tuple = None,
                               pad_multiple: int = None, fuse_unpermute_combine: bool = False,
                               num_dispatched_tokens: int = None):
        assert handle is not None, "The handle is necessary in the combine pass."
        c_assert(hidden.element_size() == 2, "elementSize(hidden) == 2")
        _check_inputs(hidden, probs)  # hybrid_ep.cu:348-356
        c_assert(hidden.dtype == torch.bfloat16, "args.permuted_tokens.dtype() == torch::kBFloat16")
        with library_call():
            return _kernels.hybrid_unpermute(hidden, handle.layout, self.group, probs)

    @staticmethod
    def _as_read(hidden: torch.Tensor) -> torch.Tensor:
        """Without FP8 the kernels read every token as 16-bit words: bf16 is read as it is, anything
        else is reinterpreted (fp32: the first half of each row's bytes), never refused."""
        if hidden.dtype == torch.bfloat16:
            return hidden
        return hidden.contiguous().view(torch.bfloat16)[:, : hidden.shape[1]]

    @staticmethod
    def _as_written(tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The output has the input's dtype, filled with 16-bit words (garbage for any other dtype)."""
        if dtype == torch.bfloat16:
            return tokens
        out = torch.full((tokens.shape[0], tokens.shape[1]), float("nan"), dtype=dtype)
        out.view(torch.bfloat16)[:, : tokens.shape[1]] = tokens
        return out
