"""The device-cost ledger: what one training step pays a GPU, counted on any device, per MoE layer and pass.

:class:`DeviceCostCounter` (a dispatch mode) counts, as a GPU run would pay them:

- host syncs: a value read out of device memory (``.item``, ``.tolist``, ``.cpu``, ``bool()``...), an operator
  whose output shape depends on device values (``nonzero``, boolean indexing, ...), and the syncs a kernel library
  makes inside its calls (:mod:`torchtitan_ext.ep.kernels.calls`);
- host-to-device copies, blocking (pageable, or without ``non_blocking``) or not;
- collectives, with their kind, group size and bytes, and the kernel libraries' calls;
- local bytes: what operators outside the GEMMs and the libraries read and write (the layout advisor's counting,
  :mod:`.local_traffic`);
- weight tensors materialised beyond the parameters (an operator on weights alone that writes a new tensor).

On a CPU every tensor is a host tensor, so the counter keeps its own account of which hold host data: values read
out of device tensors, tensors built from Python data, and what is computed from those alone; everything else
stands for device memory. :class:`LayerScopes` attributes each event to the MoE layer and pass (forward,
backward, recompute) it happened in. :func:`count_step` runs one training step of a job on every rank under the
counter; ``python -m torchtitan_ext.ledger`` prints the table. The budgets the backends and features declare are
:class:`~torchtitan_ext.ep.budget.DeviceBudget` (docs/device_costs.md).
"""

import os
import re
import sys
import threading
from unittest.mock import patch
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary
from torchtitan.models.moe.moe import GroupedExperts

from torchtitan_ext.ep import backend_class
from torchtitan_ext.ep.base import HOST_COPIES
from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.kernels import calls
from torchtitan_ext.planning.local_traffic import moved_tensors

_AFTER_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python).remove(
    torch._C.DispatchKey.PythonDispatcher
)
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read device values on the host (on a CPU tensor most of them dispatch no operator)."""
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_COLLECTIVE_NAMES = ("all_to_all", "alltoall", "all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter",
                     "broadcast", "barrier", "send", "recv")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "_scaled_grouped_mm", "_scaled_mm",
          "convolution"}
"""Operators whose passes over memory are the compute stream's, not the local traffic the ledger counts."""
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
        return Costs(
            self.host_syncs | other.host_syncs,
            self.h2d_copies | other.h2d_copies,
            max(self.collectives, other.collectives, key=len),
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


class DeviceCostCounter(TorchDispatchMode):
    """Counts what a GPU pays for the code run under it (the module docstring), per ``scopes.current()``."""

    def __init__(self, scopes: LayerScopes | None = None, model_parts=(), device_type: str = "cpu"):
        """``model_parts``: the model, whose parameters are the weights (a weight copy copies them);
        ``device_type``: the job's device, whose tensors are device memory (on a CPU, the tensors this counter has
        not seen hold host data)."""
        super().__init__()
        self.scopes = scopes
        self.host_is_device = device_type == "cpu"
        self.costs: dict[tuple, Costs] = defaultdict(Costs)
        self._host = WeakIdKeyDictionary()
        """Tensors holding host data."""
        self._weights = WeakIdKeyDictionary()
        """Tensors holding (a function of) weights alone."""
        self._model_parts = model_parts
        self._hooks = []
        self._reading = threading.local()
        self._patched = {}
        self._patched_torch = {}
        self._entered = 0

    # ---- bookkeeping ------------------------------------------------------------------------------------------

    def _costs(self) -> Costs:
        return self.costs[self.scopes.current() if self.scopes is not None else (OUTSIDE, "step")]

    def is_host(self, tensor: torch.Tensor) -> bool:
        if not self.host_is_device:
            return tensor.device.type == "cpu"
        # the deep_ep double's pinned memory, and our own copies to the host
        return tensor in self._host or type(tensor).__name__ == "HostTensor" or tensor in HOST_COPIES

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        return tensor in self._weights or isinstance(tensor, torch.nn.Parameter)

    def _weights_of(self, module, args) -> None:
        """A module's parameters as its forward sees them (FSDP's pre-forward, prepended, has unsharded them)."""
        for parameter in module.parameters(recurse=False):
            self._weights[parameter] = True
            self._weights[_local(parameter)] = True

    @staticmethod
    def _tensors(tree) -> list[torch.Tensor]:
        return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]

    def _on_kernel_call(self, name: str, host_syncs: int) -> None:
        costs = self._costs()
        costs.kernel_calls[name] += 1
        if host_syncs:
            costs.host_syncs[f"{name} (the library's)"] += host_syncs

    # ---- operators --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if calls.inside_kernel():
            return func(*args, **kwargs)
        tensors = self._tensors((args, kwargs))
        if (func.namespace == "torchtitan_ext" or func is torch.ops._c10d_functional.wait_tensor.default) and tensors:
            # count the op's body too (a dispatch mode alone sees only the op), and what an in-flight combine
            # runs when it lands, inside the wait for it
            with self:
                return func.redispatch(torch._C._dispatch_keys(tensors[0]) & _AFTER_PYTHON, *args, **kwargs)
        if any(isinstance(t, AsyncCollectiveTensor) for t in tensors):
            # an in-flight combine lands at its first use: its sums are counted where they run, here
            with self:
                args, kwargs = tree_map_only(AsyncCollectiveTensor, lambda t: t.trigger_wait(), (args, kwargs))
            tensors = self._tensors((args, kwargs))
        name = func.overloadpacket.__name__
        all_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        costs = self._costs()
        if func.namespace in _COLLECTIVE_NAMESPACES and any(part in name for part in _COLLECTIVE_NAMES):
            costs.collectives.append((*_collective(func.namespace, name, args), _caller()))
        elif not all_host and func.namespace == "aten":
            if _shape_from_device_values(func, name, args, kwargs):
                costs.host_syncs[f"aten.{name} (output shape from device values) at {_caller()}"] += 1
            if torch.Tag.data_dependent_output in func.tags and not getattr(self._reading, "depth", 0):
                costs.host_syncs[f"aten.{name} (a device value read) at {_caller()}"] += 1
        outputs = func(*args, **kwargs)
        out_tensors = self._tensors(outputs)
        if all_host or name == "lift_fresh":
            for tensor in out_tensors:
                self._host[tensor] = True
        elif func.namespace == "aten" and name not in _GEMMS:
            floats = [t for t in tensors if t.is_floating_point()]
            of_weights = bool(floats) and all(self._is_weight(t) for t in floats)
            for tensor in out_tensors if of_weights else ():
                self._weights[tensor] = True
            if not func.is_view:
                read, written = moved_tensors(func, args, kwargs, outputs)
                costs.local_bytes += sum(t.nbytes for t in read + written)
                if of_weights:
                    costs.largest_weight_copy = max([costs.largest_weight_copy, *(t.nbytes for t in out_tensors)])
        return outputs

    # ---- methods a dispatch mode cannot see on a CPU ----------------------------------------------------------

    def __enter__(self):
        self._entered += 1
        if self._entered == 1:  # the bodies of custom ops enter it again
            self._patch_methods()
            calls.LISTENERS.append(self._on_kernel_call)
            self._hooks = [module.register_forward_pre_hook(self._weights_of)
                           for part in self._model_parts for module in part.modules()
                           if next(module.parameters(recurse=False), None) is not None]
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._entered -= 1
        if self._entered == 0:
            for method, original in self._patched.items():
                setattr(torch.Tensor, method, original)
            for name, original in self._patched_torch.items():
                setattr(torch, name, original)
            self._patched, self._patched_torch = {}, {}
            calls.LISTENERS.remove(self._on_kernel_call)
            for hook in self._hooks:
                hook.remove()
        return result

    def _patch_methods(self) -> None:
        counter = self
        for method in _HOST_READS:
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def read(tensor, *args, _method=method, _original=original, **kwargs):
                if not calls.inside_kernel() and not counter.is_host(tensor):
                    counter._costs().host_syncs[f"Tensor.{_method} at {_caller()}"] += 1
                # the operator it dispatches (_local_scalar_dense under item) is this read
                counter._reading.depth = getattr(counter._reading, "depth", 0) + 1
                try:
                    result = _original(tensor, *args, **kwargs)
                finally:
                    counter._reading.depth -= 1
                if isinstance(result, torch.Tensor):
                    if result is tensor:  # on a CPU .cpu() is the tensor itself: the host copy is another object
                        result = result.view_as(result)
                    counter._host[result] = True
                return result

            setattr(torch.Tensor, method, read)
        original_to = torch.Tensor.to
        self._patched["to"] = original_to

        def to(tensor, *args, **kwargs):
            moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
            # a tensor subclass's own .to (the double's pinned memory) calls it again: the outermost call counts
            counter._reading.depth = getattr(counter._reading, "depth", 0) + 1
            try:
                result = original_to(tensor, *args, **kwargs)
            finally:
                counter._reading.depth -= 1
            if not moves or calls.inside_kernel() or counter._reading.depth:
                return result
            if counter.host_is_device:
                # on a CPU a copy asked non-blocking is one from host memory, pinned (to_device's, whose tensor may
                # come out of a library call unseen); otherwise the copy of a host tensor this counter saw
                if not (kwargs.get("non_blocking") or counter.is_host(tensor)):
                    return result
                if result is tensor:  # the device copy is the tensor itself here: make it another object
                    result = result.view_as(result)
                counter._costs().h2d_copies[_copy_kind(kwargs.get("non_blocking"))] += 1
            elif counter.is_host(tensor) and not counter.is_host(result):
                pinned = tensor.is_pinned() or type(tensor).__name__ == "HostTensor"
                counter._costs().h2d_copies[_copy_kind(kwargs.get("non_blocking") and pinned)] += 1
            return result

        torch.Tensor.to = to
        for name in ("tensor", "as_tensor"):
            original_factory = getattr(torch, name)
            self._patched_torch[name] = original_factory

            def factory(data, *args, _original=original_factory, **kwargs):
                result = _original(data, *args, **kwargs)
                on_device = kwargs.get("device") is not None and not calls.inside_kernel()
                if on_device and counter.host_is_device:
                    counter._host.pop(result, None)  # built on the host, copied to the device
                if on_device and not counter.is_host(result) and not isinstance(data, torch.Tensor):
                    counter._costs().h2d_copies[_copy_kind(False, "from Python data ")] += 1
                if kwargs.get("device") is None and not isinstance(data, torch.Tensor) and \
                        torch.get_default_device().type == "cpu":
                    counter._host[result] = True  # Python data, left in host memory
                return result

            setattr(torch, name, factory)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_OUTPUT_FIRST = {"alltoall_base_", "_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_",
                 "alltoall_", "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"}
"""c10d operators whose first argument is the output: what a rank sends is their second."""


def _collective(namespace: str, name: str, args) -> tuple[str, str, int, int]:
    """(kind, group name, group size, bytes this rank sends) of a c10d or functional collective's arguments."""
    group = None
    for arg in args:
        if isinstance(arg, torch.ScriptObject):  # c10d operators take the group boxed (and their reduce op)
            try:
                group = dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
    names = [arg for arg in args if isinstance(arg, str)]
    if namespace == "_c10d_functional" and names:  # functional collectives name their group last
        group = dist.distributed_c10d._resolve_process_group(names[-1])
    sent = args[1] if namespace == "c10d" and name in _OUTPUT_FIRST else args[0]
    size = sum(t.nbytes for t in tree_flatten(sent)[0] if isinstance(t, torch.Tensor))
    return name.strip("_"), group.group_name if group else "", group.size() if group else 1, size


COUNTED_STEP = 2
"""The step counted: the first builds what a job builds once (kernel buffers, tables); the second is every step's.
Under expert replication, the first step with replicas (when its plan is chosen and its tables copied)."""


@dataclass
class Ledger:
    """One counted training step: costs per (MoE layer or :data:`OUTSIDE`, pass), the most any rank paid."""

    costs: dict[tuple, Costs]
    ep_group: str
    """The EP group's name (collectives on it are the backends'); "" without expert parallelism."""
    budget: DeviceBudget | None
    """The job's MoE layer budget: its backend's plus its features'; None without expert parallelism."""
    saves_collectives: bool
    """Whether activation checkpointing's recompute saves the backend's collectives (per-op selective)."""

    def paid_by(self, source: str) -> Budget:
        """What the code of ``source`` (a file, "torchtitan_ext/training/faults.py") paid outside the MoE layers."""
        costs = self.costs.get((OUTSIDE, "step"), Costs())
        return Budget(
            sum(count for kind, count in costs.host_syncs.items() if kind.endswith(f" at {source}") or
                f" at {source}:" in kind),
            sum(1 for *_, caller in costs.collectives if caller.startswith(f"{source}:")),
            sum(count for kind, count in costs.h2d_copies.items() if source in kind),
        )

    def layers(self) -> list[int]:
        return sorted({scope for scope, _ in self.costs if scope != OUTSIDE})

    def over_budget(self) -> list[str]:
        """One line per MoE layer and pass, and per feature outside them, that pays more than its budget allows."""
        found = []
        for source, allowed in step_budgets().items():
            paid = self.paid_by(source)
            if any(getattr(paid, f) > getattr(allowed, f) for f in ("host_syncs", "collectives", "h2d_copies")):
                found.append(f"{source}: {paid} outside the MoE layers, budget {allowed}")
        if self.budget is None:
            return found
        for (layer, phase), costs in sorted(self.costs.items(), key=str):
            if layer == OUTSIDE:
                continue
            allowed = self.budget.of(phase, self.saves_collectives)
            non_blocking = sum(count for kind, count in costs.h2d_copies.items() if kind.startswith("non-blocking"))
            paid = Budget(costs.syncs, costs.collective_count(self.ep_group), non_blocking)
            blocking = sum(count for kind, count in costs.h2d_copies.items() if kind.startswith("blocking"))
            if blocking or any(getattr(paid, f) > getattr(allowed, f) for f in ("host_syncs", "collectives", "h2d_copies")):
                found.append(f"MoE layer {layer} {phase}: {paid} and {blocking} blocking host-to-device copies, "
                             f"budget {allowed}: {dict(costs.host_syncs)}, {costs.collectives}, {dict(costs.kernel_calls)}")
        return found


def _count_worker(rank: int, world_size: int, train_args: list[str], device_type: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.data import prepare_embedded_assets
    from torchtitan_ext.training import prepare
    from torchtitan_ext.training.trainer import Trainer

    prepare()
    job_config = load_job_config(train_args, device_type, world_size)
    job_config.metrics.log_freq = 1  # the counted step is a logged one
    job_config.checkpoint.enable = False
    prepare_embedded_assets(job_config)
    trainer = Trainer(job_config)
    chooser = trainer.replica_chooser
    counted_step = COUNTED_STEP if chooser is None else max(COUNTED_STEP, chooser.first_replicated_step)
    job_config.training.steps = counted_step
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, GroupedExperts):
                # as on a GPU with grouped GEMMs (SM90+): torchtitan's loop, where they are missing, reads the
                # group sizes on the host
                module.use_grouped_mm = True
    counted: dict[tuple, Costs] = {}
    train_step = trainer.train_step

    def counting_step(data_iterator):
        if trainer.step != counted_step:
            return train_step(data_iterator)
        scopes = LayerScopes(trainer.model_parts)
        counter = DeviceCostCounter(scopes, trainer.model_parts, device_type)
        try:
            with counter:
                train_step(data_iterator)
        finally:
            scopes.remove()
        counted.update(counter.costs)

    trainer.train_step = counting_step
    try:
        trainer.train()
    finally:
        trainer.close()
    ep_mesh = trainer.parallel_dims.get_optional_mesh("ep")
    return {"costs": counted, "ep_group": ep_mesh.get_group().group_name if ep_mesh is not None else ""}


def count_step(train_args: list[str], world_size: int, device_type: str = "cpu") -> Ledger:
    """The ledger of one training step of the job ``train_args`` on ``world_size`` processes of this machine."""
    from torchtitan_ext.config import parse
    from torchtitan_ext.runtime.workers import run_workers

    ranks = run_workers(world_size, _count_worker, train_args, device_type, device=device_type)
    costs: dict[tuple, Costs] = {}
    for rank in ranks:
        for scope, paid in rank["costs"].items():
            costs[scope] = costs[scope].merged(paid) if scope in costs else paid
    job_config = parse(train_args)
    ac = job_config.activation_checkpoint
    budget = job_budget(job_config) if ranks[0]["ep_group"] else None
    return Ledger(costs, ranks[0]["ep_group"], budget,
                  saves_collectives=ac.mode == "selective" and ac.selective_ac_option == "op")


def count_moe_call(job_config, shape, call, group, sync_debug: bool = False) -> dict[str, Costs]:
    """{"forward": costs, "backward": costs} of one MoE call of the job's backend in ``group`` (its dispatch and
    combine, the experts as the identity; ``call``: a :class:`~torchtitan_ext.planning.local_traffic.MoECall` on
    the group's device), counted after one that builds what a job builds once.

    ``sync_debug`` (CUDA): the passes whose budget has no host sync run under ``torch.cuda.set_sync_debug_mode
    ("error")`` outside the kernel library's calls, so that a sync the count missed fails them."""
    from torchtitan_ext.planning.local_traffic import backend_forward

    backend = backend_class(job_config)
    budget = backend.device_budget(job_config)
    style = backend.layer_factory(job_config, shape)(score_before_experts=False)
    backend_forward(style, call, shape, group).float().sum().backward()
    device_type = call.x.device.type
    costs = {}
    out = None
    for phase in ("forward", "backward"):
        counter = DeviceCostCounter(device_type=device_type)
        checking = sync_debug and getattr(budget, phase).host_syncs == 0
        with counter, _sync_errors(checking):
            if phase == "forward":
                out = backend_forward(style, call, shape, group)
                if isinstance(out, AsyncCollectiveTensor):
                    out = out.trigger_wait()  # an in-flight combine lands (sums its rows) inside the pass
                out = out.float()
            else:
                out.sum().backward()
        costs[phase] = counter.costs[OUTSIDE, "step"]
    return costs


def count_job_moe_call(job_config) -> dict[str, Costs]:
    """{"forward", "backward": costs} of one MoE call of the job's backend at the job's per-rank shape (tokens per
    rank, experts, top-k), in a gloo group of this process alone: for a job this machine cannot run (its model, its
    ranks). Counts of host syncs, copies, collectives and kernel calls are a group's of any size (each backend
    issues the same calls at every EP degree); bytes grow with the hidden size and the rest does not, so they are
    counted at two small hidden sizes and extended to the job's, as the local traffic is
    (:func:`~torchtitan_ext.planning.local_traffic.counted_hidden_sizes`)."""
    from dataclasses import replace

    from torchtitan.config import TORCH_DTYPE_MAP

    from torchtitan_ext.config import moe_shape
    from torchtitan_ext.ep.replication import dispatched_shape
    from torchtitan_ext.planning.local_traffic import counted_hidden_sizes, MoECall

    shape = dispatched_shape(job_config, moe_shape(job_config))
    dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counted = []
        for hidden in counted_hidden_sizes(shape):
            small = replace(shape, hidden_dim=hidden)
            call = MoECall.random(small, shape.max_tokens_per_rank, dtype)
            with patch.dict(os.environ):  # a buffer exports its library's environment, a rank's, not ours
                counted.append(count_moe_call(job_config, small, call, dist.group.WORLD))
    finally:
        if created:
            dist.destroy_process_group()
    (low, high), (at_low, at_high) = counted_hidden_sizes(shape), counted

    def extended(a: int, b: int) -> int:
        return round(a + (b - a) * (shape.hidden_dim - low) / (high - low))

    costs = {}
    for phase, small in at_low.items():
        large = at_high[phase]
        collectives = [(kind, group, size, extended(sent, sent_high), caller)
                       for (kind, group, size, sent, caller), (*_, sent_high, _) in zip(small.collectives,
                                                                                        large.collectives)]
        costs[phase] = Costs(small.host_syncs, small.h2d_copies, collectives, small.kernel_calls,
                             extended(small.local_bytes, large.local_bytes),
                             extended(small.largest_weight_copy, large.largest_weight_copy))
    return costs


EVERY_LAYER = "every MoE layer"
"""The layer a per-rank-shape count stands for: every MoE layer of the job pays alike."""


def moe_call_ledger(job_config) -> Ledger:
    """:func:`count_job_moe_call` as a :class:`Ledger` of one MoE layer (:data:`EVERY_LAYER`), against the job's
    budget (no activation checkpointing's recompute: one call is counted)."""
    costs = {(EVERY_LAYER, phase): paid for phase, paid in count_job_moe_call(job_config).items()}
    group = next((c[1] for paid in costs.values() for c in paid.collectives), "0")
    return Ledger(costs, group, job_budget(job_config), saves_collectives=False)


@contextmanager
def _sync_errors(enabled: bool):
    """CUDA's sync debug mode at "error" while enabled, except inside a kernel library's calls (the reference
    kernels that stand for a library sync where the library does not)."""
    if not enabled:
        yield
        return
    work = calls.library_work

    @contextmanager
    def library_work_unchecked():
        torch.cuda.set_sync_debug_mode(0)
        try:
            with work():
                yield
        finally:
            torch.cuda.set_sync_debug_mode("error")

    calls.library_work = library_work_unchecked
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        calls.library_work = work


def step_budgets() -> dict[str, Budget]:
    """What the features outside the MoE layers declare a (logged) step costs them, by the file of their code."""
    from torchtitan_ext.training import faults, metrics

    return {"torchtitan_ext/training/faults.py": faults.STEP_BUDGET,
            "torchtitan_ext/training/metrics.py": metrics.LOG_STEP_BUDGET}


def job_budget(job_config) -> DeviceBudget:
    """One MoE layer's budget in the job: its backend's, plus what expert replication adds."""
    from torchtitan_ext.ep.replication import replication_budget

    budget = backend_class(job_config).device_budget(job_config)
    if job_config.expert_replication.slots_per_rank:
        budget = budget.given_counts() + replication_budget(job_config)
    return budget


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f}" if count else "0"


def format_ledger(ledger: Ledger, title: str) -> str:
    """The ledger as a table: one row per pass of each group of MoE layers that paid alike, then the rest of the
    step; the budget under it."""
    rows = []
    layers = ledger.layers()
    groups: list[tuple[list[int], dict]] = []
    for layer in layers:
        paid = {phase: ledger.costs.get((layer, phase)) for phase in PASSES}
        signature = {phase: None if c is None else (dict(c.host_syncs), dict(c.h2d_copies),
                                                     [x[0] for x in c.collectives], dict(c.kernel_calls))
                     for phase, c in paid.items()}
        for members, other in groups:
            if other == signature:
                members.append(layer)
                break
        else:
            groups.append(([layer], signature))
    for members, _ in groups:
        name = members[0] if isinstance(members[0], str) else (
            f"MoE layer{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}")
        for phase in PASSES:
            costs = ledger.costs.get((members[0], phase))
            if costs is not None:
                rows.append((name, phase, costs))
    for phase in ("step",):
        if (OUTSIDE, phase) in ledger.costs:
            rows.append((OUTSIDE, "forward + backward + optimizer", ledger.costs[OUTSIDE, phase]))
    header = ["where", "pass", "host syncs", "H2D", "collectives (EP group / others)", "kernel calls",
              "local MB", "weight copy MB"]
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for where, phase, costs in rows:
        ep = [c for c in costs.collectives if c[1] == ledger.ep_group]
        others = [c for c in costs.collectives if c[1] != ledger.ep_group]
        syncs = ", ".join(f"{kind} x{count}" for kind, count in sorted(costs.host_syncs.items())) or "0"
        h2d = ", ".join(f"{kind} x{count}" for kind, count in sorted(costs.h2d_copies.items())) or "0"
        collectives = f"{_describe(ep)} / {_describe(others)}"
        kernel = ", ".join(f"{name} x{count}" for name, count in sorted(costs.kernel_calls.items())) or "0"
        lines.append(f"| {where} | {phase} | {syncs} | {h2d} | {collectives} | {kernel} | "
                     f"{_megabytes(costs.local_bytes)} | {_megabytes(costs.largest_weight_copy)} |")
    if ledger.budget is not None:
        b = ledger.budget
        lines += ["", f"Budget per MoE layer: forward {b.forward}, backward {b.backward} ({b.why})."]
        over = ledger.over_budget()
        lines.append("Within it." if not over else "Over it:\n" + "\n".join(over))
    return "\n".join(lines) + "\n"


def _describe(collectives: list) -> str:
    """"all_to_all_single x1 (0.00 MB), alltoall_base x2 (1.23 MB)": each kind, its count and bytes sent."""
    if not collectives:
        return "0"
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for kind, _, _, sent, _ in collectives:
        kinds[kind][0] += 1
        kinds[kind][1] += sent
    return ", ".join(f"{kind} x{count} ({_megabytes(sent)} MB)" for kind, (count, sent) in kinds.items())


def _shape_from_device_values(func, name: str, args, kwargs) -> bool:
    """Whether ``func``'s output shape depends on its inputs' values here (the host waits to learn it): operators
    tagged so, except where the call gives the size (``output_size``, ``num_classes``) or indexes by integers."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if name == "index":
        return any(index is not None and index.dtype == torch.bool for index in args[1])
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "one_hot":
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0
    return True


def _caller() -> str:
    """Where the code that made the host wait is: "torchtitan_ext/ep/nccl.py:123", the innermost frame of this
    package or of torchtitan outside this module (torch's own frames are the mechanism, not the cause)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for package in ("torchtitan_ext", "torchtitan"):
            marker = f"/{package}/"
            # to_device is the helper of every such copy: its caller is the place
            if marker in path and not path.endswith("device_ledger.py") and frame.f_code.co_name != "to_device":
                return f"{package}/{path.rsplit(marker, 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "torch"


def _copy_kind(non_blocking: bool, what: str = "") -> str:
    return f"{'non-blocking' if non_blocking else 'blocking'} {what}at {_caller()}"
