"""The device-cost counter: a dispatch mode that counts what a step pays a GPU, on any device.

:class:`DeviceCostCounter` counts, as a GPU run would pay them:

- host syncs: a value read out of device memory (``.item``, ``.tolist``, ``.cpu``, ``bool()``...), an operator
  whose output shape depends on device values (``nonzero``, boolean indexing, ...), and the syncs a kernel library
  makes inside its calls (:mod:`torchtitan_ext.ep.kernels.calls`);
- host-to-device copies, blocking (pageable, or without ``non_blocking``) or not;
- collectives, with their kind, group size and bytes, and the kernel libraries' calls; where their in-flight results
  are waited for;
- local bytes: what operators outside the GEMMs and the libraries read and write (the layout advisor's counting,
  :mod:`torchtitan_ext.planning.local_traffic`);
- weight tensors materialised beyond the parameters (an operator on weights alone that writes a new tensor).

On a CPU every tensor is a host tensor, so the counter keeps its own account of which hold host data: values read
out of device tensors, tensors built from Python data, and what is computed from those alone; everything else
stands for device memory. Each event goes to the MoE layer and pass :class:`~.device_costs.LayerScopes` gives it.
"""


import sys
import threading
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from torchtitan_ext.ep.base import HOST_COPIES, named_layer
from torchtitan_ext.ep.kernels import calls
from torchtitan_ext.measuring.device_costs import Costs, LayerScopes, OUTSIDE
from torchtitan_ext.planning.local_traffic import moved_tensors, run_below_python, tensors_in


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read device values on the host (on a CPU tensor most of them dispatch no operator)."""
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_COLLECTIVE_NAMES = ("all_to_all", "alltoall", "all_gather", "allgather", "all_reduce", "allreduce", "reduce_scatter",
                     "broadcast", "barrier", "send", "recv")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "_scaled_grouped_mm", "_scaled_mm",
          "convolution"}
"""Operators whose passes over memory are the compute stream's, not the local traffic the ledger counts."""


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

    def _charged(self, func, args):
        """Where a replica fetch's collective is charged: the layer it fetches for (the next one, fetched ahead)."""
        if self.scopes is None or func.name() != "torchtitan_ext::replica_weights":
            return nullcontext()
        # the name it fails with is its layer's, also when the layer before issues it
        named = [layer for arg in args if isinstance(arg, str) and (layer := named_layer(arg)) is not None]
        return self.scopes.charged_to(named[0]) if named else nullcontext()

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
        tensors = tensors_in((args, kwargs))
        if any(isinstance(t, AsyncCollectiveTensor) for t in tensors):
            # an in-flight combine lands at its first use: its sums are counted where they run, here. Below Python
            # an operator would get the pending wrapper, whose storage holds no data
            with self:
                args, kwargs = tree_map_only(AsyncCollectiveTensor, lambda t: t.trigger_wait(), (args, kwargs))
            tensors = tensors_in((args, kwargs))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            costs = self._costs()
            costs.waits.append((len(costs.collectives), _caller()))
        if (func.namespace == "torchtitan_ext" or func is torch.ops._c10d_functional.wait_tensor.default) and tensors:
            # count the op's body too (a dispatch mode alone sees only the op), and what an in-flight combine
            # runs when it lands, inside the wait for it
            with self, self._charged(func, args):
                return run_below_python(func, tensors[0], args, kwargs)
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
        out_tensors = tensors_in(outputs)
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
    size = sum(t.nbytes for t in tensors_in(sent))
    return name.strip("_"), group.group_name if group else "", group.size() if group else 1, size


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


_LEDGER_MODULES = ("device_cost_counter.py", "device_costs.py", "device_ledger.py")


def _caller() -> str:
    """Where the code that made the host wait is: "torchtitan_ext/ep/nccl.py:123", the innermost frame of this
    package or of torchtitan outside the ledger's own modules (torch's own frames are the mechanism, not the cause)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for package in ("torchtitan_ext", "torchtitan"):
            marker = f"/{package}/"
            # to_device is the helper of every such copy: its caller is the place
            if marker in path and not path.endswith(_LEDGER_MODULES) and frame.f_code.co_name != "to_device":
                return f"{package}/{path.rsplit(marker, 1)[1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "torch"


def _copy_kind(non_blocking: bool, what: str = "") -> str:
    return f"{'non-blocking' if non_blocking else 'blocking'} {what}at {_caller()}"
