"""The ``nccl`` backend: all-to-all over torch.distributed functional collectives.

NCCL on GPU, gloo on CPU; torchtitan's "standard" backend. Each rank sorts
its (token, expert) pairs by expert, exchanges the per-expert counts (one
small all-to-all, then a host sync for the split sizes), sends the rows with
one all-to-all, and reorders what it received (source rank major) into
expert-major groups padded to the grouped-GEMM alignment: at least 8 rows
(bf16), 16 for FP8 and 32 for MXFP8 grouped GEMMs. Combine reverses both
steps and sums each token's top-k rows in fp32.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.tensor import distribute_tensor, DTensor, Partial, Replicate, Shard

from torchtitan_ext.ep.base import MoEShape, RoutedExpertParallel, scale_rows, token_group_alignment
from torchtitan_ext.ep.layout import block_destinations


@dataclass(frozen=True)
class _NcclDispatchState:
    pair_order: torch.Tensor
    """Pairs (token * K + k) in send order: sorted by expert, stable."""
    sorted_scores: torch.Tensor | None
    """Scores in send order, when they multiply the expert outputs."""
    destinations: torch.Tensor
    """Row of every received row in the expert-major layout."""
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    top_k: int


class NcclExpertParallel(RoutedExpertParallel):
    """EP over all-to-all collectives (NCCL on GPU, gloo on CPU).

    Applied on a 1-D "ep" mesh it is plain EP; on an ["ep", "etp"] mesh it also
    shards each expert's hidden dimension over "etp" (expert tensor parallelism,
    the only backend that supports it).
    """

    sac_save_ops = (torch.ops._c10d_functional.all_to_all_single.default,)
    min_pad_multiple = 8

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        return partial(cls, pad_multiple=token_group_alignment(job_config))

    def _partition_fn(self, name, mod, device_mesh):
        if device_mesh.ndim == 1:
            return super()._partition_fn(name, mod, device_mesh)
        # expert TP on an [ep, etp] mesh: experts over "ep", w1/w3 column-wise and w2 row-wise over "etp"
        for param_name, hidden_dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            param = getattr(mod, param_name)
            sharded = distribute_tensor(param, device_mesh, [Shard(0), Shard(hidden_dim)])
            mod.register_parameter(param_name, torch.nn.Parameter(sharded))

    def _token_dispatch(self, mod, inputs, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_dispatch(mod, inputs, device_mesh)
        # every expert-TP rank computes a partial result from the same tokens and scores,
        # so their gradients are partial sums over "etp"
        x, scores, expert_ids = inputs
        x, scores = (
            DTensor.from_local(t, device_mesh["etp"], (Replicate(),)).to_local(grad_placements=(Partial(),))
            for t in (x, scores)
        )
        return super()._token_dispatch(mod, (x, scores, expert_ids), device_mesh["ep"])

    def _token_combine(self, mod, routed_output, device_mesh):
        if device_mesh.ndim == 1:
            return super()._token_combine(mod, routed_output, device_mesh)
        return super()._token_combine(mod, routed_output, device_mesh["ep"])

    def dispatch(self, x, scores, expert_ids, num_experts, group):
        ep_degree = group.size()
        local_experts = num_experts // ep_degree
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        pair_order = torch.argsort(flat_ids, stable=True)
        with torch.no_grad():
            counts = torch.bincount(flat_ids, minlength=num_experts)
            recv_counts = all_to_all_single(counts, None, None, group=group)
            # split sizes must be on the host: one device-to-host sync, as in torchtitan
            send_counts, recv_counts = torch.stack([counts, recv_counts]).view(2, ep_degree, local_experts).cpu()
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        rows = x[pair_order // top_k]
        sorted_scores = scores.reshape(-1)[pair_order]
        if self.score_before_experts:
            rows = scale_rows(rows, sorted_scores)
        received = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
        destinations, padded, total_rows = block_destinations(recv_counts, self.pad_multiple)
        destinations = destinations.to(x.device)
        routed = received.new_zeros((total_rows, x.shape[1])).index_copy(0, destinations, received)
        self._pending = _NcclDispatchState(
            pair_order=pair_order,
            sorted_scores=None if self.score_before_experts else sorted_scores,
            destinations=destinations,
            send_splits=send_splits,
            recv_splits=recv_splits,
            num_tokens=num_tokens,
            top_k=top_k,
        )
        return routed, padded.to(x.device)

    def combine(self, routed_output, group):
        state = self._take_pending()
        rows = routed_output.index_select(0, state.destinations)
        returned = all_to_all_single_autograd(rows, state.send_splits, state.recv_splits, group)
        returned = returned.float()
        if state.sorted_scores is not None:
            returned = returned * state.sorted_scores.float().unsqueeze(-1)
        hidden = routed_output.shape[1]
        pairs = returned.new_zeros((state.num_tokens * state.top_k, hidden)).index_copy(
            0, state.pair_order, returned
        )
        return pairs.view(state.num_tokens, state.top_k, hidden).sum(1).to(routed_output.dtype)
