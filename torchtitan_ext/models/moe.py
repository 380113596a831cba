"""The MoE layer under expert parallelism: routing goes to the EP backend.

torchtitan's ``MoE`` reorders tokens itself and hands the experts
(expert-sorted tokens, counts). Under EP our backends need the routing
instead (tokens, top-k scores, top-k expert ids), so the parallelize plan
turns each MoE it applies EP to into an :class:`ExpertParallelMoE`: same
parameters, buffers and checkpoint keys, a forward that passes the routing to
the experts, whose EP hooks dispatch, run the experts and combine. Layers
without EP keep torchtitan's forward. Under an expert placement the routers'
logical expert ids are mapped to physical slots before dispatch.
"""

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.moe.moe import MoE, MoEArgs
from torchtitan.tools.utils import has_cuda_capability

from torchtitan_ext.ep.base import Routing
from torchtitan_ext.ep.replication.split import ReplicaRouter


def grouped_mm_where_supported(moe_args: MoEArgs) -> MoEArgs:
    """``moe_args`` with grouped GEMMs off where torchtitan turns them off itself (below SM90, and on a CPU),
    as a copy: torchtitan's model args do it in place, in the flavour that every job of the process
    shares, with a warning at every model build that says nothing about the job."""
    if moe_args.use_grouped_mm and not has_cuda_capability(9, 0):
        return dataclasses.replace(moe_args, use_grouped_mm=False)
    return moe_args


class TensorParallelTokenSplit:
    """EP borrowing the TP ranks (expert TP off): each TP rank dispatches 1/TP of the tokens.

    The MoE's tokens, scores and expert ids are replicated over the TP mesh (the
    router runs on all of them, so every TP rank keeps the same router and load
    statistics). Each TP rank dispatches one contiguous slice of the flattened
    tokens; any slice would do, since both directions below treat them alike.

    - :meth:`split` takes the slice as a Replicate -> Shard(0) redistribution:
      its backward all-gathers the slices' gradients, so every TP rank gets the
      exact gradient of all tokens and scores (and so of the router), as if it
      had dispatched every token itself.
    - :meth:`unsplit` puts the slice's output back in place with zeros elsewhere:
      the TP ranks' outputs sum to the whole (Partial), which the MoE's output
      layout reduce-scatters together with the shared experts' partial output.
    """

    def __init__(self, tp_mesh: DeviceMesh):
        self.mesh = tp_mesh

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.mesh.size()
        if tensor.shape[0] % parts:
            raise ValueError(
                f"{tensor.shape[0]} tokens do not split evenly over tensor parallel degree {parts}: "
                "make local_batch_size x seq_len divisible by it"
            )
        if not tensor.is_floating_point():
            return tensor.chunk(parts)[self.mesh.get_local_rank()]
        replicated = DTensor.from_local(tensor, self.mesh, (Replicate(),), run_check=False)
        return replicated.redistribute(self.mesh, (Shard(0),)).to_local()

    def unsplit(self, part: torch.Tensor) -> torch.Tensor:
        parts, rank = self.mesh.size(), self.mesh.get_local_rank()
        rows = part.shape[0]
        return torch.nn.functional.pad(part, (0, 0, rank * rows, (parts - rank - 1) * rows))


class ExpertParallelMoE(MoE):
    """torchtitan's MoE whose routed experts are wrapped by an EP backend."""

    token_split: TensorParallelTokenSplit | None = None
    expert_slot: torch.Tensor | None = None
    """Physical slot of each logical expert under an expert placement (torchtitan_ext.balancing.migration);
    None: expert e in slot e."""
    replicas: ReplicaRouter | None = None
    """Under expert replication: the per-step split of each pair among its expert's copies."""

    @classmethod
    def adopt(cls, moe: MoE, token_split: TensorParallelTokenSplit | None = None) -> "ExpertParallelMoE":
        """Turn ``moe`` into this class in place, the way FSDP2's ``fully_shard`` does."""
        moe.__class__ = cls
        moe.token_split = token_split
        return moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, expert_ids, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        # after the router's own counts: statistics and load balancing stay per logical expert
        logical_ids = expert_ids
        slots = expert_ids if self.expert_slot is None else self.expert_slot[expert_ids]
        tokens, scores, sent_counts = x, top_scores, None
        if self.token_split is not None:
            split = self.token_split.split
            tokens, scores, slots, logical_ids = split(x), split(top_scores), split(slots), split(logical_ids)
        if self.replicas is not None:
            # on the pairs this rank dispatches: the split counts what each rank sends
            slots, sent_counts = self.replicas.assign(slots, counting=self.training)
        routing = Routing(scores, slots, logical_ids, sent_counts)
        # a backend may return the routed output with its combine still in flight
        # (torchtitan_ext.ep.in_flight): the shared experts run before its first use,
        # which is the un-split under TP borrowing, or the sum
        routed = self.experts(tokens, routing)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.token_split is not None:
            routed = self.token_split.unsplit(routed)
        out = routed if shared is None else shared + routed
        return out.reshape(bs, slen, dim)
