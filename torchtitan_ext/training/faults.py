"""What a training process does about faults: preemption, non-finite values, stuck peers, torn checkpoints.

- **Preemption**: SIGTERM or SIGUSR1 (SLURM's warning, forwarded by
  ``torchtitan_ext.supervise``) only sets a flag
  (:class:`torchtitan_ext.runtime.preemption.PreemptionRequest`). At the end of the
  step, all ranks agree on it (one all-reduce per step), save a full
  checkpoint of that step and stop cleanly (:class:`Preempted`); the same
  command resumes there.
- **Non-finite values**: every MoE router flags, on the device, a non-finite
  score. Before the optimizer steps, the ranks agree (the same all-reduce)
  whether any local loss or router output of this step was non-finite. Then
  ``[faults] on_nonfinite``: "stop" ends the run naming the step and the first
  MoE layer whose router went non-finite (:class:`NonFiniteLoss`);
  "skip_step" leaves parameters and optimizer state as they were, warns with
  the same facts, and goes on.
- **Stuck or dead peers**: a failed collective is named by where it was
  (:mod:`torchtitan_ext.runtime.collectives`).
- **Torn checkpoints**: see :mod:`.checkpoints`.

The per-step agreement costs one small all-reduce and one host read per step.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from torchtitan_ext.config import register_section
from torchtitan_ext.ep.budget import Budget


@dataclass
class Faults:
    on_nonfinite: Literal["stop", "skip_step"] = "stop"
    """
    What a step does when its loss, or an MoE router's output, is not finite
    (NaN or Inf) on any rank:

    - "stop": the run ends with one line naming the step and the first MoE layer
      whose router produced a non-finite score (exit status 1); the last
      checkpoint is untouched;
    - "skip_step": that step's update is skipped (parameters and optimizer state
      stay as they were; the learning-rate schedule advances), a warning names the
      step and the layer, and training goes on.

    Either way it costs one small all-reduce and one host read per step, which
    also carries the ranks' agreement on a preemption signal.
    """


register_section("faults", Faults)


class Preempted(Exception):
    """The ranks stopped at a step boundary after a preemption signal; ``saved``: whatever the job
    saves is complete on disk."""

    def __init__(self, message: str, saved: bool):
        super().__init__(message)
        self.saved = saved


class NonFiniteLoss(RuntimeError):
    """A step produced a non-finite loss or router output, and ``[faults] on_nonfinite = "stop"``."""


class RouterHealth:
    """Per MoE layer, whether its router produced a non-finite score this step (a device flag)."""

    def __init__(self, model_parts, num_layers: int, device: torch.device):
        self.flags = torch.zeros(num_layers, dtype=torch.int32, device=device)
        for part in model_parts:
            for name, module in part.named_modules():
                if name.endswith("moe.router") and name.startswith("layers."):
                    module.register_forward_hook(self._hook(int(name.split(".")[1])))

    def _hook(self, layer: int):
        def hook(module, inputs, outputs):
            if module.training:
                with torch.no_grad():
                    self.flags[layer] |= (~torch.isfinite(outputs[0])).any().to(torch.int32)

        return hook

    def reset(self) -> None:
        self.flags.zero_()


STEP_BUDGET = Budget(host_syncs=1, collectives=1)
"""What :func:`agree` costs every step: one all-reduce and one host read of it (the optimizer's step waits for the
ranks' agreement on non-finite values and preemption)."""


def agree(preempt: bool, local_loss: torch.Tensor | None, routers: RouterHealth | None, device) -> dict:
    """All ranks' view of this step in one all-reduce: {"preempt", "nonfinite_loss", "layer"}.

    ``layer`` is the first MoE layer whose router produced a non-finite score on any rank, or None.
    """
    # filled on the device: no host-to-device copy
    parts = [torch.full((1,), int(preempt), dtype=torch.int32, device=device)]
    loss_bad = torch.zeros(1, dtype=torch.int32, device=device)
    if local_loss is not None:
        loss_bad = (~torch.isfinite(local_loss.detach().reshape(-1))).any().to(torch.int32).reshape(1)
    parts.append(loss_bad)
    if routers is not None:
        parts.append(routers.flags)
    state = torch.cat(parts)
    if dist.is_initialized():
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
    values = state.tolist()
    bad_layers = [layer for layer, flag in enumerate(values[2:]) if flag]
    return {"preempt": bool(values[0]), "nonfinite_loss": bool(values[1]),
            "layer": bad_layers[0] if bad_layers else None}


def describe_nonfinite(step: int, state: dict) -> str:
    what = "loss" if state["nonfinite_loss"] else "router output"
    where = (
        f"the router of MoE layer {state['layer']} produced non-finite scores first"
        if state["layer"] is not None
        else "no MoE router produced a non-finite score: the loss went non-finite elsewhere"
    )
    return f"non-finite {what} at step {step} ({where})"
