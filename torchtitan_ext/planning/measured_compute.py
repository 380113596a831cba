"""One rank's compute per training step, measured on this machine: the layout advisor's compute stream.

``python -m torchtitan_ext.plan ... --topology T --measure-compute`` measures it
(:mod:`torchtitan_ext.measuring.compute`); the advisor prices a layout's compute from it in place of FLOPs.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredCompute:
    """Medians over the timed steps of the slowest process's time in each (a synchronous step waits for it)."""

    forward_backward_s: float
    """One microbatch's forward and backward through the whole model, in seconds."""
    optimizer_s: float
    """Gradient clipping and the optimizer's step over all of the model's parameters, in seconds
    (FSDP steps only a rank's shards: the advisor scales it by the rank's share)."""
    processes: int
    """Processes that ran at once."""
    dispatch_work_s: dict[str, float]
    """Per backend: one MoE call's dispatch and combine, forward and backward, on one rank's tokens,
    without its collectives and beyond torchtitan's own sort (which the forward-backward contains), in
    seconds; 0 where those took all of the time."""
    routed_experts_s: float
    """The routed experts' part of ``forward_backward_s``: every MoE layer's grouped experts, forward and
    backward, on the rows that layer saw, in seconds."""

    def step_seconds(self, passes: float, parameter_share: float) -> float:
        """One rank's step: ``passes`` forward-backward passes (microbatches, more with recomputation) and
        the optimizer over ``parameter_share`` of the parameters."""
        return passes * self.forward_backward_s + parameter_share * self.optimizer_s

    def routed_experts_seconds(self, passes: float) -> float:
        """The routed experts' part of :meth:`step_seconds` at ``passes`` forward-backward passes."""
        return passes * self.routed_experts_s
