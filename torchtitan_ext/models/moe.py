"""The MoE layer under expert parallelism: routing goes to the EP backend.

torchtitan's ``MoE`` reorders tokens itself and hands the experts
(expert-sorted tokens, counts). Under EP our backends need the routing
instead (tokens, top-k scores, top-k expert ids), so the parallelize plan
turns each MoE it applies EP to into an :class:`ExpertParallelMoE`: same
parameters, buffers and checkpoint keys, a forward that passes the routing to
the experts, whose EP hooks dispatch, run the experts and combine. Layers
without EP keep torchtitan's forward.
"""

import torch
from torchtitan.models.moe.moe import MoE


class ExpertParallelMoE(MoE):
    """torchtitan's MoE whose routed experts are wrapped by an EP backend."""

    @classmethod
    def adopt(cls, moe: MoE) -> "ExpertParallelMoE":
        """Turn ``moe`` into this class in place, the way FSDP2's ``fully_shard`` does."""
        moe.__class__ = cls
        return moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, expert_ids, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        # a backend may return the routed output with its combine still in flight
        # (torchtitan_ext.ep.in_flight): the shared experts run before its first use
        routed = self.experts(x, top_scores, expert_ids)
        if self.shared_experts is None:
            return routed.reshape(bs, slen, dim)
        shared = self.shared_experts(x)
        return (shared + routed).reshape(bs, slen, dim)
