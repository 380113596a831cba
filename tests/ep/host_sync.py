"""Counting what would make a GPU stream wait for the host, on a CPU.

On a CPU every tensor is a host tensor, so :class:`HostSyncCounter` keeps its
own account of which tensors hold host data: values read out of device
tensors (``.cpu()``, ``.tolist()``), tensors built from Python data
(``torch.tensor``), pinned host memory a kernel library returns (the
double's ``HostTensor``), and whatever is computed from those alone.
Everything else stands for device memory. It then counts, in the EP layer's
own code:

- device-to-host syncs: a scalar or a copy read out of device memory
  (``.item``, ``.tolist``, ``.cpu``, ``bool()``...), and ops whose output shape
  depends on device values (``nonzero``, boolean indexing, ``bincount``, ...);
- synchronous host-to-device copies: host data moved to the device without
  ``non_blocking=True`` (a pageable or unpinned copy makes the host wait);
- collectives issued by that code.

It sees inside the backends' custom ops (a dispatch mode alone sees only the
op: here it redispatches their bodies under itself) and leaves the kernel
library's own work to the library: calls into the deep_ep double are not
counted, and the syncs the library makes are reported by the double and
counted apart (``library_syncs``).
"""

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_VALUE_SHAPED = {
    "aten.nonzero.default", "aten.masked_select.default", "aten.bincount.default",
    "aten.unique_consecutive.default", "aten._unique2.default", "aten.repeat_interleave.Tensor",
}
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_COLLECTIVE_NAMES = ("all_to_all", "alltoall", "all_gather", "allgather", "all_reduce", "allreduce",
                     "reduce_scatter", "broadcast", "barrier", "send", "recv")


def _inside_library() -> bool:
    try:
        from deep_ep import _double
    except ImportError:
        return False
    return _double.inside_library()


class HostSyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events: Counter = Counter()
        self.library_syncs = 0
        self._host: dict[int, weakref.ref] = {}
        """id -> weak reference of the tensors holding host data (tensors compare by value, so no WeakSet)."""
        self._patched = {}
        self._entered = 0

    # ---- bookkeeping --------------------------------------------------------------------

    def is_host(self, tensor: torch.Tensor) -> bool:
        if type(tensor).__name__ == "HostTensor":
            return True
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark(self, outputs) -> None:
        for tensor in tree_flatten(outputs)[0]:
            if isinstance(tensor, torch.Tensor):
                self._host[id(tensor)] = weakref.ref(tensor)

    def _on_library_event(self, kind: str) -> None:
        if kind == "host_sync":
            self.library_syncs += 1

    # ---- ops ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _inside_library():
            return func(*args, **kwargs)
        if func.namespace == "torchtitan_ext":
            with self:  # count the op's body too
                keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                return func.redispatch(keyset, *args, **kwargs)
        name = str(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        all_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if func.namespace in _COLLECTIVE_NAMESPACES and any(part in name for part in _COLLECTIVE_NAMES):
            self.events[f"collective ({name})"] += 1
        if not all_host:
            if name in _VALUE_SHAPED and not (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size")):
                self.events[f"device-to-host sync ({name})"] += 1
            if name == "aten.index.Tensor" and any(
                index is not None and index.dtype == torch.bool for index in args[1]
            ):
                self.events["device-to-host sync (boolean indexing)"] += 1
            if name == "aten._local_scalar_dense.default":
                self.events["device-to-host sync (scalar read)"] += 1
        outputs = func(*args, **kwargs)
        if all_host or name == "aten.lift_fresh.default":
            self._mark(outputs)
        return outputs

    # ---- methods a dispatch mode cannot see on a CPU ------------------------------------

    def __enter__(self):
        self._entered += 1
        if self._entered == 1:  # the bodies of custom ops enter it again
            self._patch_methods()
            try:
                from deep_ep import _double
            except ImportError:
                pass
            else:
                _double.LISTENERS.append(self._on_library_event)
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._entered -= 1
        if self._entered == 0:
            self._unpatch_methods()
        return result

    def _patch_methods(self) -> None:
        counter = self
        for method in _READS:
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def read(tensor, *args, _method=method, _original=original, **kwargs):
                if not _inside_library() and not counter.is_host(tensor):
                    counter.events[f"device-to-host sync (Tensor.{_method})"] += 1
                result = _original(tensor, *args, **kwargs)
                if isinstance(result, torch.Tensor):
                    counter._mark(result)
                return result

            setattr(torch.Tensor, method, read)
        original_to = torch.Tensor.to
        self._patched["to"] = original_to

        def to(tensor, *args, **kwargs):
            moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
            if moves and not _inside_library() and counter.is_host(tensor) and not kwargs.get("non_blocking"):
                counter.events["synchronous host-to-device copy (Tensor.to)"] += 1
            return original_to(tensor, *args, **kwargs)

        torch.Tensor.to = to

    def _unpatch_methods(self) -> None:
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched = {}
        try:
            from deep_ep import _double
        except ImportError:
            return
        if self._on_library_event in _double.LISTENERS:
            _double.LISTENERS.remove(self._on_library_event)
