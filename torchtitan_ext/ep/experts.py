"""The routed experts' per-expert loop, each expert's weights taken unbound from the stack.

Without grouped GEMMs (a CPU, a GPU below SM90) torchtitan's ``GroupedExperts`` runs one expert at a time and
indexes each out of the stacked [E, ...] weight. Each index's backward writes a zero-filled gradient of the
whole stack, and autograd sums the E of them: E x E experts' bytes written and (E - 1) x E added per
projection, per layer and step (with 16 local experts, half of the experts' forward and backward on a CPU:
docs/balancing.md, "The CPU's per-expert loop"). Unbound, the E gradients are stacked once.
Outputs and gradients equal torchtitan's. :class:`UnboundLoopExperts` is ``GroupedExperts`` with that loop
(:func:`adopt_unbound_loop` turns a model's experts into it, in place); its grouped GEMMs are torchtitan's, or a
model converter's low-precision ones.
"""

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.moe import moe as torchtitan_moe
from torchtitan.models.moe.moe import _run_experts_for_loop, GroupedExperts


def run_experts_for_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's per-expert loop on the experts' weights unbound (it only indexes them by expert)."""
    return _run_experts_for_loop(w1.unbind(0), w2.unbind(0), w3.unbind(0), x, num_tokens_per_expert)


class UnboundLoopExperts(GroupedExperts):
    """GroupedExperts whose per-expert loop takes each expert's weights unbound, and whose grouped GEMMs run a
    model converter's low-precision recipe when it gave them one."""

    low_precision = None
    """The recipe a model converter set (:class:`torchtitan_ext.models.converters.LowPrecisionGroupedMM`): the three
    grouped GEMMs quantize on the fly, on a CPU too; None: torchtitan's GEMMs."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm and self.low_precision is None:
            return super().forward(x, num_tokens_per_expert)
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        return self.run_experts(*weights, x, num_tokens_per_expert)

    def run_experts(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on these (local) weights: the low-precision grouped GEMMs, torchtitan's grouped GEMMs, or
        the per-expert loop."""
        if self.low_precision is not None:
            return self.low_precision.run_experts(w1, w2, w3, x, num_tokens_per_expert)
        if self.use_grouped_mm:
            # looked up at each call: torchtitan's compile swaps in its compiled version
            return torchtitan_moe._run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)


def adopt_unbound_loop(model: torch.nn.Module) -> None:
    """Every torchtitan ``GroupedExperts`` of ``model`` turned, in place, into :class:`UnboundLoopExperts` (same
    parameters and state dict keys); subclasses, which bring their own forward, are left as they are."""
    for module in model.modules():
        if type(module) is GroupedExperts:
            module.__class__ = UnboundLoopExperts
