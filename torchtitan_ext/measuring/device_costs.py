"""What the device-cost ledger counts, per MoE layer and pass: :class:`Costs` (host syncs, host-to-device copies,
collectives, kernel-library calls, local bytes, weight copies) and :class:`LayerScopes`, which attributes each event
to the MoE layer and pass (forward, backward, recompute) it happened in."""


import re
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from torchtitan_ext.ep.recompute import recomputing


OUTSIDE = "outside MoE layers"
_MOE_LAYER = re.compile(r"layers\.(\d+)\.(?:.*\.)?moe")
"""A MoE module's name (wrappers between the layer and its moe: activation checkpointing's)."""
PASSES = ("forward", "backward", "recompute")


@dataclass
class Costs:
    """What one MoE layer (or the rest of the step) paid in one pass."""

    host_syncs: Counter = field(default_factory=Counter)
    """What made the host wait -> how many times."""
    h2d_copies: Counter = field(default_factory=Counter)
    """"blocking at <where>" / "non-blocking at <where>" -> host-to-device copies."""
    collectives: list = field(default_factory=list)
    """(kind, group name, group size, bytes this rank sent, where it was issued) per collective issued outside a
    kernel library."""
    waits: list = field(default_factory=list)
    """(collectives issued before it, where) per ``wait_tensor`` call on a collective's result, in the order the
    host issued them: where the compute stream waits for an in-flight one (a no-op where it has already landed)."""
    kernel_calls: Counter = field(default_factory=Counter)
    """Kernel library call -> how many times."""
    local_bytes: int = 0
    largest_weight_copy: int = 0
    """Bytes of the largest weight tensor materialised beyond the parameters."""

    @property
    def syncs(self) -> int:
        return sum(self.host_syncs.values())

    def collective_count(self, group_name: str | None = None) -> int:
        """Collectives issued (on the group ``group_name`` only, when given) and the kernel library's calls."""
        own = sum(1 for _, name, _, _, _ in self.collectives if group_name is None or name == group_name)
        return own + sum(self.kernel_calls.values())

    def merged(self, other: "Costs") -> "Costs":
        """The larger of each count (ranks of one job run the same code: their counts differ only where a rank
        received nothing)."""
        # a wait's position counts its own rank's collectives: both lists come from one rank
        issued_more = max(self, other, key=lambda costs: len(costs.collectives))
        return Costs(
            self.host_syncs | other.host_syncs,
            self.h2d_copies | other.h2d_copies,
            issued_more.collectives,
            issued_more.waits,
            self.kernel_calls | other.kernel_calls,
            max(self.local_bytes, other.local_bytes),
            max(self.largest_weight_copy, other.largest_weight_copy),
        )


class LayerScopes:
    """Which MoE layer and pass the code running now belongs to.

    Forward (and activation checkpointing's recompute, inside backward) is what runs inside a MoE module's forward;
    backward is what runs between the gradient of its output arriving and the gradient of its input leaving:
    autograd runs a layer's backward nodes before any earlier layer's, whose inputs wait for this one's.
    """

    def __init__(self, model_parts):
        self._local = threading.local()
        self._handles = []
        for part in model_parts:
            for name, module in part.named_modules():
                layer = _MOE_LAYER.fullmatch(name)
                if layer is not None:
                    layer = int(layer.group(1))
                    self._handles.append(module.register_forward_pre_hook(self._entered(layer)))
                    self._handles.append(module.register_forward_hook(self._left(layer)))

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack, self._local.backward = [], None
        return self._local.stack

    def _entered(self, layer: int):
        def hook(module, args):
            self._stack().append((layer, "recompute" if recomputing() else "forward"))
            for tensor in tree_flatten(args)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad and not recomputing():
                    tensor.register_hook(self._backward_ends(layer))
        return hook

    def _left(self, layer: int):
        def hook(module, args, output):
            self._stack().pop()
            if recomputing():
                return
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._backward_starts(layer))
        return hook

    def _backward_starts(self, layer: int):
        def hook(grad):
            self._stack()
            self._local.backward = layer
        return hook

    def _backward_ends(self, layer: int):
        def hook(grad):
            self._stack()
            if self._local.backward == layer:
                self._local.backward = None
        return hook

    @contextmanager
    def charged_to(self, layer: int):
        """Charge what runs inside to MoE layer ``layer``, in the current pass: work a layer issues for another
        (the next layer's replica fetch, issued ahead of it)."""
        stack = self._stack()
        stack.append((layer, self.current()[1]))
        try:
            yield
        finally:
            stack.pop()

    def current(self) -> tuple[int | str, str]:
        """(MoE layer id, or :data:`OUTSIDE`; pass)."""
        stack = self._stack()
        if stack:
            return stack[-1]
        if self._local.backward is not None:
            return self._local.backward, "backward"
        return OUTSIDE, "step"

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
