"""The double's own machinery: which build it is, import failures, host memory, accounting."""

import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

BUILD = os.environ.get("DEEP_EP_DOUBLE_BUILD", "main")
"""Which build of deep_ep this double stands for: "main", "hybrid-ep" or "v2.5"."""

LISTENERS: list[Callable[[str], None]] = []
"""Called with "host_sync" each time a library call makes the host wait for the device."""

CREATION_MODE_STACKS: list[int] = []
"""For each buffer created: how many dispatch modes (e.g. selective checkpointing's cache) were active."""

_depth = 0


def check_import() -> None:
    """What ``import deep_ep`` checks on DeepEP main (deep_ep/__init__.py:46-84 at dd758ca)."""
    failure = os.environ.get("DEEP_EP_DOUBLE_IMPORT_FAILURE", "")
    if failure == "nccl":
        raise AssertionError("Invalid NCCL versions: the loaded libnccl.so differs from the one deep_ep was built with")
    if failure == "cuda_home":
        raise AssertionError("assert cuda_home is not None")


def inside_library() -> bool:
    """Whether the current call stack is inside a library call (tests tell the adapters' ops from its own)."""
    return _depth > 0


@contextmanager
def library_call(host_syncs: int = 0) -> Iterator[None]:
    """Run the library's work; report the host syncs it makes."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    for _ in range(host_syncs):
        for listener in list(LISTENERS):
            listener("host_sync")


def record_creation() -> None:
    CREATION_MODE_STACKS.append(len(_get_current_dispatch_mode_stack()))


def check_torch_deterministic() -> None:
    """deep_ep/utils/envs.py:183-189: both settings on at once are refused."""
    assert not (
        torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    ), "DeepEP does not support deterministic algorithms with fill_uninitialized_memory"


def runtime_assert(condition: bool, text: str) -> None:
    """EP_HOST_ASSERT: an ``EPException``, which pybind turns into RuntimeError."""
    if not condition:
        raise RuntimeError(f"Assertion exception: {text}")


def c_assert(condition: bool, text: str) -> None:
    """A C ``assert`` in the hybrid-ep sources: the real library aborts the process."""
    if not condition:
        raise RuntimeError(f"abort (C assert): {text}")


class HostTensor(torch.Tensor):
    """A tensor in pinned host memory: it takes part in no computation.

    Only metadata, ``tolist``, ``is_pinned`` and a copy to the device
    (``.to(device, ...)``, which returns an ordinary tensor) are allowed;
    anything else (a grouped GEMM's group sizes, an index, a sum) raises, as
    feeding host memory to device kernels would fail or read garbage.
    """

    _ALLOWED = {"tolist", "is_pinned", "__repr__", "__format__", "numel", "dim", "size", "__len__", "__index__"}

    @staticmethod
    def wrap(tensor: torch.Tensor) -> "HostTensor":
        return tensor.as_subclass(HostTensor)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "to" or func is torch.Tensor.to:
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.to(*args, **kwargs).as_subclass(torch.Tensor).clone()
        if name == "is_pinned":
            return True
        if name in cls._ALLOWED or name == "__get__":  # metadata (properties arrive as __get__)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(
            f"deep_ep double: {name} on a tensor in pinned host memory; copy it to the device first "
            "(.to(device, non_blocking=True))"
        )


# ---- buffer lifetimes and the borrowed communicator -------------------------------------------------


def _state() -> SimpleNamespace:
    """What the double tracks about torch.distributed, kept on that module: tests re-import ``deep_ep`` (one
    per build), and the patches below must be made once and read one state."""
    state = getattr(dist, "_deep_ep_double", None)
    if state is None:
        state = SimpleNamespace(live=weakref.WeakSet(), communicated=set())
        dist._deep_ep_double = state
        for name in ("barrier", "all_reduce", "all_gather", "all_gather_object", "all_to_all", "all_to_all_single",
                     "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor",
                     "all_gather_single", "reduce_scatter_single"):  # the last two: torch 2.13's names
            if hasattr(dist, name):
                setattr(dist, name, _noting_the_group(getattr(dist, name), state))
        dist.destroy_process_group = _destroy_process_group_after_the_buffers(dist.destroy_process_group, state)
    return state


def register_live(buffer) -> None:
    """A ``Buffer`` or ``ElasticBuffer`` whose ``destroy()`` (a barrier and finalization over the group's
    communicator) must run before the process group is destroyed."""
    _state().live.add(buffer)


def communicated(group) -> bool:
    """Whether ``group`` has run a collective: before, ``backend._comm_ptr()`` is 0 (comm.py:61-64), since torch
    creates a group's NCCL communicator at its first collective."""
    return group.group_name in _state().communicated


def _noting_the_group(collective, state):
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def noted(*args, **kwargs):
        group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        state.communicated.add((group or dist.distributed_c10d._get_default_group()).group_name)
        return collective(*args, **kwargs)

    return noted


def _destroy_process_group_after_the_buffers(destroy, state):
    @functools.wraps(destroy)
    def checked(group=None):
        alive = [type(buffer).__name__ for buffer in state.live if not buffer.destroyed]
        assert not alive, (
            f"deep_ep double: the process group is destroyed under live {', '.join(alive)}: their destructor would "
            "run a barrier and NCCL/NVSHMEM finalization on a communicator already gone (create them with "
            "explicitly_destroy=True and call destroy() first)"
        )
        return destroy(group)

    return checked


_state()
