"""Constructors for the real deep_ep buffers (CUDA clusters only).

``deep_ep.Buffer`` already has the call signatures the DeepEP backend uses, so
it is used as is. HybridEP's handle is a tuple whose last element is the
overflow flag; :class:`LibraryHybridEPBuffer` wraps it so the backend reads
the flag and the dropped-pair count the same way for both implementations.

This module is imported only when ``implementation`` resolves to ``deep_ep``.
Nothing here has run in this project's CI (no GPU there): the conformance
tests marked ``deep_ep`` exercise it on a CUDA machine with the library built.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_ext.ep.layout import padded_offsets


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
    """A DeepEP v1 normal-mode buffer sized by the library's own hints."""
    from deep_ep import Buffer

    return Buffer(group, *deepep_buffer_bytes(group.size(), hidden_bytes, num_sms))


@dataclass(frozen=True)
class LibraryHybridEPHandle:
    raw: tuple
    overflow_flag: torch.Tensor
    num_dropped: torch.Tensor


class LibraryHybridEPBuffer:
    """``deep_ep.HybridEPBuffer`` with the handle carrying the dropped-pair count.

    The library reports overflow as a flag only; the count follows from the
    contract's tail rule applied to the global per-expert counts (one small
    all-reduce, no host sync).
    """

    def __init__(self, group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                 num_sms_dispatch_api, num_sms_combine_api, environment: dict[str, str]):
        from deep_ep import HybridEPBuffer

        # the library reads these when the buffer is created
        os.environ.update(environment)
        self.group = group
        self.num_local_experts = num_local_experts
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
        tokens, out_probs, scaling, tokens_per_expert, raw = self.library.dispatch_with_permute(
            hidden=hidden, routing_map=routing_map, probs=probs,
            num_of_experts_per_rank=num_of_experts_per_rank,
            num_permuted_tokens=num_permuted_tokens, pad_multiple=pad_multiple,
            non_blocking=non_blocking, handle=None if handle is None else handle.raw,
        )
        if handle is None:
            handle = LibraryHybridEPHandle(
                raw=raw,
                overflow_flag=raw[-1],
                num_dropped=self._dropped_pairs(routing_map, tokens.shape[0], pad_multiple or 1),
            )
        return tokens, out_probs, scaling, tokens_per_expert.to(torch.int64), handle

    def _dropped_pairs(self, routing_map, num_rows: int, pad_multiple: int) -> torch.Tensor:
        counts = routing_map.sum(0)
        dist.all_reduce(counts, group=self.group)
        rank, local = self.group.rank(), self.num_local_experts
        counts = counts[rank * local : (rank + 1) * local]
        _, offsets = padded_offsets(counts, pad_multiple)
        kept = torch.minimum(counts, (num_rows - offsets).clamp(min=0))
        return (counts - kept).sum()

    def combine_with_unpermute(self, *, hidden, probs=None, handle, pad_multiple=None):
        return self.library.combine_with_unpermute(
            hidden=hidden, probs=probs, handle=handle.raw, pad_multiple=pad_multiple
        )
