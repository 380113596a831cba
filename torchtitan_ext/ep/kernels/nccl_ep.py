"""NCCL EP's kernels behind the ``ncclep`` backend: one EP group for every MoE layer of a job, and its handles.

The calls are NCCL EP's Python facade (``nccl.ep``), made on the real library (``implementation = "nccl_ep"``,
the nccl-extensions wheel on CUDA) or on its double (``"reference"``,
:mod:`torchtitan_ext.ep.kernels.nccl_ep_double`, on any device): the same code runs either way. High-throughput
mode, expert-major layout: the group is created once from the job's shape; a handle carries one routing, is
created once and rebound per step on the device (``Handle.update``), and goes back to a pool when the last op
that needs its routing (the dispatch's backward) has been freed, so one handle serves each routing in flight
(one per MoE layer without pipelining, more with microbatches in flight) and no more. Two assumptions hold that
safe: every call runs on the current stream (a handle returns to the pool when the host frees it, so a rebinding
is queued after the kernels that read it), and every rank frees its graphs at the same point of the program
(CPython's reference counting; a handle kept alive by a reference cycle would return at the cyclic collector's
time, and one rank could create a handle where another rebinds one).
"""

import importlib
import weakref
from dataclasses import dataclass

import torch

from torchtitan_ext.ep.kernels import KernelUnavailable
from torchtitan_ext.ep.kernels.calls import kernel_call

IMPLEMENTATIONS = ("auto", "nccl_ep", "reference")
LIBRARY_DEVICE_TYPE = "cuda"
"""The device the real library runs on (tests point it at the CPU to run the adapter on the double)."""
CUDA_MAJORS = (12, 13)
"""The CUDA majors the wheel ships ``libnccl_ep.so`` for (``nccl/ep/lib/cu12``, ``cu13``)."""


def install_command() -> str:
    """The pip command that installs NCCL EP for the CUDA this torch was built for. It installs apart from this
    package, which needs torch: resolved together, torch's own NCCL pin (2.29.7 in torch 2.13.0's CUDA 13 build)
    meets the wheel's (2.30.7), and pip may replace torch to satisfy both."""
    major = (torch.version.cuda or "").split(".")[0]
    if major not in {str(supported) for supported in CUDA_MAJORS}:
        return ('install a torch built for CUDA 12 or 13, then pip install "nccl-extensions[cuXX]==0.1.0" with XX '
                "its CUDA major")
    return f'pip install "nccl-extensions[cu{major}]==0.1.0"'


def uses_library(implementation: str, device_type: str | None) -> bool:
    """Whether ``ncclep.implementation`` means the real library on ``device_type`` (None: a machine not known yet,
    e.g. a dry run for a cluster, where ``auto`` means the library)."""
    if implementation == "auto":
        return device_type != "cpu"
    return implementation == "nccl_ep"


def import_facade():
    """``nccl.ep`` with its ``libnccl_ep.so`` loaded, or KernelUnavailable with the library's own message (the
    facade imports without the library; loading it needs the CUDA driver, ``libcuda.so.1``)."""
    try:
        ep = importlib.import_module("nccl.ep")
    except Exception as e:  # noqa: BLE001 - every failure of the import is the same answer
        raise KernelUnavailable(f"import nccl.ep failed: {type(e).__name__}: {e}") from None
    try:
        ep.get_lib_version()
    except Exception as e:  # noqa: BLE001 - likewise for loading the library
        raise KernelUnavailable(f"nccl.ep imports but its library does not load: {type(e).__name__}: {e}") from None
    return ep


def resolve_implementation(implementation: str, device_type: str) -> str:
    """``"nccl_ep"`` or ``"reference"`` for ``ncclep.implementation`` on this device; KernelUnavailable naming the
    field and the fix when the library is needed and cannot be used."""
    if implementation not in IMPLEMENTATIONS:
        raise KernelUnavailable(f"ncclep.implementation = '{implementation}': use one of {', '.join(IMPLEMENTATIONS)}")
    if not uses_library(implementation, device_type):
        return "reference"
    if device_type != LIBRARY_DEVICE_TYPE:
        raise KernelUnavailable("ncclep.implementation = 'nccl_ep' needs CUDA, and this machine has none: use "
                                "implementation = 'reference' (or 'auto') on CPU")
    try:
        import_facade()
    except KernelUnavailable as e:
        raise KernelUnavailable(f"ncclep.implementation resolves to NCCL EP on CUDA, but {e}: {install_command()} "
                                "on this CUDA machine (docs/ncclep.md#installing), or set "
                                "ncclep.implementation = 'reference' to run its (slow) double") from None
    return "nccl_ep"


def unavailable_reason() -> str | None:
    """Why the real NCCL EP cannot run here, in one line (the import's or the library's own message, else no CUDA
    device), or None when it can."""
    try:
        import_facade()
    except KernelUnavailable as e:
        return str(e)
    return None if torch.cuda.is_available() else "no CUDA device"


def facade(implementation: str):
    """The module whose calls run: ``nccl.ep`` or the double; with ``get_nccl_comm_from_group`` from its torch
    interop."""
    if implementation == "nccl_ep":
        ep = import_facade()
        interop = importlib.import_module("nccl.ep.interop.torch")
        return ep, interop.get_nccl_comm_from_group
    from torchtitan_ext.ep.kernels import nccl_ep_double

    return nccl_ep_double, nccl_ep_double.get_nccl_comm_from_group


@dataclass(frozen=True)
class GroupShape:
    """What the EP group is created for (every rank the same)."""

    num_experts: int
    """Experts dispatched over (replica slots included)."""
    max_tokens_per_rank: int
    """``max_dispatch_tokens_per_rank``: tokens one rank passes per dispatch, at most."""
    hidden_bytes: int
    """``max_token_bytes``: one token row's bytes."""
    top_k: int
    """``num_topk``."""
    max_recv_slots: int
    """``max_recv_tokens_per_rank``: the static budget of receive slots, or 0 for eager mode."""
    alignment: int
    """``dispatch_output_per_expert_alignment``: each expert zone's row multiple (a power of 2)."""
    num_channels: int
    """``num_channels`` (2 SMs each); 0: the library's choice."""
    max_num_sms: int
    """``max_num_sms``; 0: the library's choice."""
    zero_copy_off: bool
    """``zero_copy``: ``ZeroCopyMode.OFF`` where True, else ``AUTO``."""


class _PooledHandle:
    """A library handle with the layout tensors its ``update`` fills."""

    def __init__(self, kernels: "NcclEpKernels", device):
        local = kernels.local_experts
        self.counters = torch.zeros(local, dtype=torch.int64, device=device)
        self.total = torch.zeros(1, dtype=torch.int64, device=device)
        ep = kernels.ep
        self.layout_info = ep.LayoutInfo(expert_counters=ep.Tensor(self.counters), recv_total_counter=ep.Tensor(self.total))
        self.handle = None
        self.index = None
        """The routing the handle reads, kept alive with it."""


class NcclEpKernels:
    """NCCL EP for one job: its group, created at the first dispatch, and its pool of handles."""

    def __init__(self, implementation: str, group, shape: GroupShape, device: torch.device):
        self.ep, get_comm = facade(implementation)
        ep = self.ep
        self.shape = shape
        self.device = device
        self.local_experts = shape.num_experts // group.size()
        overflow = ep.OverflowPolicy.DROP if shape.max_recv_slots else ep.OverflowPolicy.TRAP
        config = ep.GroupConfig(
            algorithm=ep.Algorithm.HIGH_THROUGHPUT, num_experts=shape.num_experts,
            max_dispatch_tokens_per_rank=shape.max_tokens_per_rank, max_recv_tokens_per_rank=shape.max_recv_slots,
            max_token_bytes=shape.hidden_bytes, num_channels=shape.num_channels, max_num_sms=shape.max_num_sms,
            overflow_policy=overflow, num_topk=shape.top_k,
            zero_copy=ep.ZeroCopyMode.OFF if shape.zero_copy_off else ep.ZeroCopyMode.AUTO,
        )
        self.comm = get_comm(group)
        self.group = ep.Group.create(self.comm, config)
        self._handle_config = ep.HandleConfig(dispatch_output_per_expert_alignment=shape.alignment)
        self._idle: list[_PooledHandle] = []

    def stream(self):
        """What the facade's ``stream=`` takes: the current CUDA stream's pointer (0 off CUDA, ignored there)."""
        return torch.cuda.current_stream().cuda_stream if self.device.type == "cuda" else 0

    def route(self, topk_idx: torch.Tensor) -> _PooledHandle:
        """A handle bound to ``topk_idx`` (collective): an idle one rebound, or a new one. Its layout tensors hold
        the padded rows per local expert and the true padded total, on the device."""
        pooled = self._idle.pop() if self._idle else _PooledHandle(self, self.device)
        index = self.ep.Tensor(topk_idx)
        with kernel_call("ncclep.update_handle"):
            if pooled.handle is None:
                pooled.handle = self.group.create_handle(self.ep.Layout.EXPERT_MAJOR, index, layout_info=pooled.layout_info,
                                                         config=self._handle_config, stream=self.stream())
            else:
                pooled.handle.update(index, layout_info=pooled.layout_info, stream=self.stream())
        pooled.index = index
        return pooled

    def release_when_freed(self, owner, pooled: _PooledHandle) -> None:
        """Return ``pooled`` to the pool once ``owner`` (what holds its routing in the autograd graph) is freed."""
        weakref.finalize(owner, self._idle.append, pooled)

    def dispatch(self, pooled: _PooledHandle, tokens, out, weights=None, out_weights=None, backward=False) -> None:
        ep = self.ep
        config = ep.DispatchConfig(pass_direction=ep.PassDir.BWD if backward else ep.PassDir.FWD)
        inputs = ep.DispatchInputs(tokens=ep.Tensor(tokens), topk_weights=None if weights is None else ep.Tensor(weights))
        outputs = ep.DispatchOutputs(tokens=ep.Tensor(out),
                                     topk_weights=None if out_weights is None else ep.Tensor(out_weights))
        with kernel_call("ncclep.dispatch (backward)" if backward else "ncclep.dispatch"):
            pooled.handle.dispatch(inputs, outputs, config=config, stream=self.stream())

    def combine(self, pooled: _PooledHandle, rows, out, weights=None, out_weights=None, backward=False) -> None:
        ep = self.ep
        config = ep.CombineConfig(pass_direction=ep.PassDir.BWD if backward else ep.PassDir.FWD)
        inputs = ep.CombineInputs(tokens=ep.Tensor(rows), topk_weights=None if weights is None else ep.Tensor(weights))
        outputs = ep.CombineOutputs(tokens=ep.Tensor(out),
                                    topk_weights=None if out_weights is None else ep.Tensor(out_weights))
        with kernel_call("ncclep.combine (backward)" if backward else "ncclep.combine"):
            pooled.handle.combine(inputs, outputs, config=config, stream=self.stream())

    def destroy(self) -> None:
        """Release the idle handles, the group and its communicator (before the process group goes; a handle still
        held by an autograd graph goes with the library's group)."""
        for pooled in self._idle:
            pooled.handle.destroy()
        self._idle.clear()
        self.group.destroy()
        self.comm.destroy()
