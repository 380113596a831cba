"""A double of NCCL EP's Python facade (``nccl.ep``), high-throughput mode with the expert-major layout, on
torch.distributed: the ``ncclep`` backend's kernels on a CPU, and the library every CPU test of that backend calls.

Written from the pinned sources of the nccl-extensions 0.1.0 wheel: its facade (``nccl/ep/group.py``,
``handle.py``, ``tensor.py``, ``enums.py``, ``interop/torch.py``), its header ``nccl_ep.h`` (NCCL EP 0.2.0, API
version 2), the limits of ``nccl_ep/common.hpp`` and the expert-major scan of ``device/scan_kernel.cuh``. The
names, keyword-only arguments, enum values, caller-allocated outputs and checks are the facade's; a check the
library makes with an assertion (which aborts the process) raises ``AssertionError`` with the library's own
text here. What the double computes, from those sources:

- ``Group.create_handle`` / ``Handle.update`` (collective): local expert e's zone starts at the prefix sum of the
  padded counts of the experts before it; its pairs are ordered by (source rank, token); the zone is padded to
  ``dispatch_output_per_expert_alignment``. ``LayoutInfo.expert_counters`` gets the padded counts,
  ``expert_offsets`` the zone starts and ``recv_total_counter`` the true (pre-drop) padded total. Under
  ``OverflowPolicy.DROP`` a slot at or above ``max_recv_tokens_per_rank`` is dropped and the reported counts and
  offsets are clamped to the budget (the scan's ``em_populate_cnt_tensors``); under ``TRAP`` an overflow stops
  with the kernel's message.
- ``Handle.dispatch`` writes each kept slot's token (and, forward, its weight) and zeroes the padding slots'
  token rows and weights (``ht_ep.cuh``'s local permute); nothing past the padded total, nothing for a dropped
  pair.
- ``Handle.combine`` sends each slot's row back to its token's rank, which sums the token's picks by ascending
  expert id in fp32 and rounds once: the nccl backend's order, so that the two train alike bit for bit on a CPU.
  The library's kernel (``local_permute_reduce``) sums each rank's picks first, in fp32 stored in the token
  dtype, then the ranks' partial sums: on a GPU the two backends agree within that rounding, not bit for bit.
  Backward it also returns each pick's slot weight in ``outputs.topk_weights`` [tokens, top_k] (0 for a dropped
  pick).

Streams are accepted and ignored (one CPU stream). The double imports nothing of torchtitan_ext.
"""

from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

FACADE_VERSION = "0.1.0"
"""The nccl-extensions wheel whose facade this follows."""
LIBRARY_VERSION = "0.2.0"
"""``NCCL_EP_MAJOR.MINOR.PATCH`` of the wheel's ``nccl_ep.h``."""
API_VERSION = 2
"""``NCCL_EP_API_VERSION`` of that header."""

MAX_HIDDEN_DIM = 16384
MAX_NUM_TOPK = 32
MAX_SUPPORTED_TOKENS_PER_RANK = 8192
NUM_MAX_RDMA_PEERS = 20
"""``nccl_ep/common.hpp``'s limits."""
LOCAL_PERMUTE_MAX_EXPERTS_PER_RANK = 256
"""``ht_ep.cuh``'s ``kLocalPermuteMaxExpertsPerRank``: the expert-major dispatch's experts per rank, at most."""
HT_TOKEN_BYTE_MULTIPLE = 16
"""HT's ``max_token_bytes`` and each token's bytes must be multiples of 16 (TMA copies)."""


class Algorithm(IntEnum):
    LOW_LATENCY = 0
    HIGH_THROUGHPUT = 1


class Layout(IntEnum):
    UNSET = 0
    EXPERT_MAJOR = 1
    RANK_MAJOR = 2
    FLAT = 3


class PassDir(IntEnum):
    FWD = 0
    BWD = 1


class OverflowPolicy(IntEnum):
    AUTO = 0
    TRAP = 1
    DROP = 2


class ZeroCopyMode(IntEnum):
    AUTO = 0
    OFF = 1
    ON = 2


class ExpertIdKind(IntEnum):
    AUTO = 0
    LOCAL = 1
    GLOBAL = 2


class DispatchQuantizationRecipe(IntEnum):
    NONE = 0
    FWD = 1
    DS_FP8E3M4 = 2


class CombineQuantizationRecipe(IntEnum):
    NONE = 0
    NVFP4 = 1


class NcclInvalid(Exception):
    """``nccl.core.typing.NcclInvalid``: what the facade raises for a misuse it catches in Python."""


_TOKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


class Tensor:
    """``nccl.ep.Tensor``: a descriptor of a caller-owned buffer (here: the torch tensor itself)."""

    def __init__(self, buffer, *, dtype=None, shape=None, window=None, window_offset=None) -> None:
        if not isinstance(buffer, torch.Tensor):
            raise NcclInvalid(f"Cannot resolve {type(buffer).__name__!r}: expected torch.Tensor")
        if dtype is not None or shape is not None:
            raise ValueError("`dtype`/`shape` are only valid with a raw integer pointer")
        if buffer.dim() == 0:
            raise ValueError("Tensor requires at least one dimension")
        if window is not None or window_offset is not None:
            raise NcclInvalid("the double has no NCCL windows (zero-copy)")
        self._buffer = buffer

    @property
    def buffer(self):
        return self._buffer

    @property
    def ndim(self) -> int:
        return self._buffer.dim()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self._buffer.shape)


class Communicator:
    """``nccl.core.Communicator``, standing for the torch process group it mirrors."""

    def __init__(self, group):
        self.group = group
        self.nranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def destroy(self) -> None:
        """Nothing to release: the torch process group is its owner's."""


def get_nccl_comm_from_group(group=None) -> Communicator:
    """``nccl.ep.interop.torch.get_nccl_comm_from_group``: a communicator of ``group``'s members."""
    if not dist.is_initialized():
        raise RuntimeError("PyTorch distributed is not initialized. Call torch.distributed.init_process_group(...) first.")
    return Communicator(group)


@dataclass
class AllocConfig:
    alloc_fn: int = 0
    free_fn: int = 0
    context: int = 0


@dataclass
class GroupConfig:
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    num_experts: int = 0
    max_dispatch_tokens_per_rank: int = 0
    max_recv_tokens_per_rank: int = 0
    max_token_bytes: int = 0
    rdma_buffer_size: int = 0
    num_qp_per_rank: int = 0
    num_channels: int = 0
    max_num_sms: int = 0
    alloc: AllocConfig = field(default_factory=AllocConfig)
    enable_mask: bool = False
    timeout_ns: int = 0
    zero_copy: ZeroCopyMode = ZeroCopyMode.AUTO
    overflow_policy: OverflowPolicy = OverflowPolicy.AUTO
    num_topk: int = 0


@dataclass
class HandleConfig:
    dispatch_output_per_expert_alignment: int = 0


@dataclass
class DispatchConfig:
    send_only: int = 0
    round_scales: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: DispatchQuantizationRecipe = DispatchQuantizationRecipe.NONE


@dataclass
class CombineConfig:
    send_only: int = 0
    pass_direction: PassDir = PassDir.FWD
    quantization_recipe: CombineQuantizationRecipe = CombineQuantizationRecipe.NONE


@dataclass
class LayoutInfo:
    expert_counters: Tensor | None = None
    src_rank_counters: Tensor | None = None
    expert_offsets: Tensor | None = None
    recv_total_counter: Tensor | None = None
    recv_topk_idx_kind: ExpertIdKind = ExpertIdKind.AUTO


@dataclass
class DispatchInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class DispatchOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None
    topk_idx: Tensor | None = None


@dataclass
class CombineInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class CombineOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """One-tensor all-gather under this torch's name for it (2.13: ``all_gather_single``)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, group=group)


def _require(condition: bool, message: str) -> None:
    """The library's ``assert(condition && "message")``."""
    if not condition:
        raise AssertionError(message)


class Group:
    """``nccl.ep.Group``: created collectively from a communicator and a :class:`GroupConfig`."""

    def __init__(self, comm: Communicator, config: GroupConfig):
        self._comm = comm
        self.config = config
        self.num_local_experts = config.num_experts // comm.nranks
        self._destroyed = False

    @classmethod
    def create(cls, comm: Communicator, config: GroupConfig) -> "Group":
        _check_group_config(config, comm.nranks)
        budgets = [None] * comm.nranks
        dist.all_gather_object(budgets, config.max_recv_tokens_per_rank, group=comm.group)
        _require(all(budget == budgets[0] for budget in budgets),
                 "ncclEpCreateGroup: max_recv_tokens_per_rank must be identical across ranks")
        return cls(comm, config)

    def _check_valid(self, operation: str) -> None:
        if self._destroyed:
            raise NcclInvalid(f"Cannot {operation}: Group is not initialized or has been destroyed")

    def create_handle(self, layout: Layout, topk_idx: Tensor, *, layout_info: LayoutInfo | None = None,
                      config: HandleConfig | None = None, stream) -> "Handle":
        self._check_valid("create_handle")
        _require(layout != Layout.UNSET, "ncclEpInitHandle: layout must be set explicitly")
        _require(not (self.config.algorithm == Algorithm.HIGH_THROUGHPUT
                      and layout not in (Layout.FLAT, Layout.EXPERT_MAJOR)),
                 "ncclEpInitHandle: HT mode supports flat and expert-major layouts")
        if self.config.algorithm != Algorithm.HIGH_THROUGHPUT or layout != Layout.EXPERT_MAJOR:
            raise NotImplementedError("the double implements the high-throughput expert-major layout only")
        alignment = (config or HandleConfig()).dispatch_output_per_expert_alignment
        _require(alignment & (alignment - 1) == 0, "dispatch_output_per_expert_alignment must be a power of two")
        if self.config.max_recv_tokens_per_rank == 0:
            _require(self.config.num_topk > 0, "NCCL EP: eager mode (max_recv_tokens_per_rank = NCCL_EP_AUTO) "
                                               "requires ncclEpGroupConfig_t::num_topk for the Expert-Major layout")
        handle = Handle(self, max(alignment, 1))
        handle.update(topk_idx, layout_info=layout_info, stream=stream)
        return handle

    def destroy(self) -> None:
        self._destroyed = True


def _check_group_config(config: GroupConfig, nranks: int) -> None:
    _require(config.algorithm in (Algorithm.LOW_LATENCY, Algorithm.HIGH_THROUGHPUT),
             "ncclEpCreateGroup: invalid algorithm, supported: low_latency, high_throughput")
    _require(config.num_experts > 0, "ncclEpCreateGroup: num_experts must be greater than 0")
    _require(config.num_experts % nranks == 0, "ep_group->config.num_experts % ep_group->nRanks == 0")
    _require(config.max_token_bytes > 0, "ncclEpCreateGroup: max_token_bytes must be greater than 0")
    high_throughput = config.algorithm == Algorithm.HIGH_THROUGHPUT
    if high_throughput and config.max_token_bytes % HT_TOKEN_BYTE_MULTIPLE:
        raise AssertionError(f"NCCL EP: HT max_token_bytes ({config.max_token_bytes}) must be a multiple of "
                             f"{HT_TOKEN_BYTE_MULTIPLE} bytes")
    _require(not (high_throughput and config.max_dispatch_tokens_per_rank == 0),
             "ncclEpCreateGroup: max_dispatch_tokens_per_rank must be set for HT backend")
    _require(not (high_throughput and config.max_recv_tokens_per_rank != 0
                  and config.max_recv_tokens_per_rank < config.max_dispatch_tokens_per_rank),
             "ncclEpCreateGroup: HT mode requires max_recv_tokens_per_rank >= max_dispatch_tokens_per_rank")
    _require(not (config.num_topk != 0 and config.num_topk > config.num_experts),
             "ncclEpCreateGroup: num_topk must be <= num_experts")
    _require(not (high_throughput and config.max_recv_tokens_per_rank == 0
                  and config.overflow_policy == OverflowPolicy.DROP),
             "ncclEpCreateGroup: eager mode (max_recv_tokens_per_rank = NCCL_EP_AUTO) does not support "
             "NCCL_EP_OVERFLOW_DROP")
    _require(0 < config.num_experts // nranks <= LOCAL_PERMUTE_MAX_EXPERTS_PER_RANK,
             "experts_per_rank > 0 && experts_per_rank <= ::ht_ep::kLocalPermuteMaxExpertsPerRank")
    if config.zero_copy == ZeroCopyMode.ON:
        raise NotImplementedError("the double has no NCCL windows: ZeroCopyMode.ON")


@dataclass
class _Routing:
    """One handle's routing, as this rank sees it (``G = R * max_dispatch_tokens_per_rank`` global tokens)."""

    num_tokens: int
    top_k: int
    pick_order: torch.Tensor
    """[this rank's tokens, top_k] each token's picks by ascending expert id: the order combine sums them in."""
    slot_token: torch.Tensor
    """[kept slots] global token (source rank * max tokens + token) of each kept slot."""
    slot_index: torch.Tensor
    """[kept slots] its slot."""
    slot_pick: torch.Tensor
    """[kept slots] which of the token's top-k picks it serves."""
    pad_slots: torch.Tensor
    """Padding slots below the budget (their token rows are zeroed)."""
    capacity: int
    """Slots the dispatch output has: the budget, or in eager mode the padded total."""


class Handle:
    """``nccl.ep.Handle``: one routing, rebound each step by :meth:`update`."""

    def __init__(self, group: Group, alignment: int):
        self._group = group
        self._alignment = alignment
        self._routing: _Routing | None = None
        self._destroyed = False

    def _check_valid(self, operation: str) -> None:
        if self._destroyed:
            raise NcclInvalid(f"Cannot {operation}: Handle is not initialized or has been destroyed")

    def update(self, topk_idx: Tensor, *, layout_info: LayoutInfo | None = None, stream) -> None:
        """Collective: every rank's routing, and this rank's slots."""
        self._check_valid("update")
        group, comm = self._group, self._group._comm
        config = group.config
        ids = topk_idx.buffer
        _require(ids.dtype in (torch.int32, torch.int64), "topk_idx must be ncclInt32 or ncclInt64")
        num_tokens, top_k = ids.shape
        _require(num_tokens <= config.max_dispatch_tokens_per_rank, "Token count exceeds HT buffer capacity")
        if config.num_topk:
            _require(top_k <= config.num_topk, "NCCL EP: num_topk exceeds ncclEpGroupConfig_t::num_topk")
        max_tokens = config.max_dispatch_tokens_per_rank
        padded_ids = ids.new_full((max_tokens, top_k), -1, dtype=torch.int64)
        padded_ids[:num_tokens] = ids.long()
        every_ids = padded_ids.new_empty((comm.nranks * max_tokens, top_k))
        _all_gather(every_ids, padded_ids, comm.group)
        local = group.num_local_experts
        first = comm.rank * local
        # pair (global token g, pick k) lands on local expert ids - first when that is in [0, L)
        mine = (every_ids >= first) & (every_ids < first + local)
        token, pick = mine.nonzero(as_tuple=True)  # ordered by global token: (source rank, token)
        expert = every_ids[token, pick] - first
        order = torch.argsort(expert, stable=True)
        token, pick, expert = token[order], pick[order], expert[order]
        counts = torch.bincount(expert, minlength=local)
        padded = torch.where(counts > 0, (counts + self._alignment - 1) // self._alignment * self._alignment, 0)
        starts = torch.cumsum(padded, 0) - padded
        true_total = int(padded.sum())
        within = torch.arange(token.numel(), device=token.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        slot = starts[expert] + within
        budget = config.max_recv_tokens_per_rank
        capacity = budget if budget else true_total
        drop = config.overflow_policy == OverflowPolicy.DROP
        if true_total > capacity and not drop:
            raise AssertionError(
                f"scan_impl_flat(em): padded EM slots {true_total} > max_recv_tokens_per_rank {capacity}; "
                "increase ncclEpGroupConfig_t::max_recv_tokens_per_rank or set overflow_policy = NCCL_EP_OVERFLOW_DROP")
        kept = slot < capacity
        pads = torch.cat([torch.arange(int(s) + int(c), int(s) + int(p), device=token.device)
                          for s, c, p in zip(starts.tolist(), counts.tolist(), padded.tolist())]
                         or [torch.empty(0, device=token.device)])
        self._routing = _Routing(num_tokens, top_k, torch.argsort(ids.long(), dim=1, stable=True),
                                 token[kept], slot[kept], pick[kept],
                                 pads[pads < capacity].long(), capacity)
        if layout_info is not None:
            room = (capacity - starts).clamp(min=0)
            reported = torch.minimum(padded, room) if drop else padded
            offsets = starts.clamp(max=capacity) if drop else starts
            for name, values in (("expert_counters", reported), ("expert_offsets", offsets)):
                descriptor = getattr(layout_info, name)
                if descriptor is not None:
                    out = descriptor.buffer
                    _require(out.dim() == 1, "tensor must be 1D")
                    _require(out.dtype in (torch.int32, torch.int64), "tensor must be ncclInt32 or ncclInt64")
                    _require(out.shape[0] >= local, "tensor size must be >= num_local_experts")
                    out[:local] = values.to(out.dtype)
            if layout_info.recv_total_counter is not None:
                layout_info.recv_total_counter.buffer.fill_(true_total)

    def _routing_for(self, operation: str) -> _Routing:
        self._check_valid(operation)
        _require(self._routing is not None, "HT FWD dispatch: ht.topk_idx missing (ncclEpUpdateHandle not called?)")
        return self._routing

    def dispatch(self, inputs: DispatchInputs, outputs: DispatchOutputs, *, layout_info: LayoutInfo | None = None,
                 config: DispatchConfig | None = None, stream) -> None:
        routing = self._routing_for("dispatch")
        config = config or DispatchConfig()
        group = self._group
        tokens = inputs.tokens.buffer
        _require(tokens.dim() == 2, "tokens must be 2D [tokens, hidden]")
        if tokens.dtype not in _TOKEN_DTYPES:
            raise AssertionError("tokens has unsupported dtype")
        _require(tokens.shape[1] * tokens.element_size() <= group.config.max_token_bytes,
                 "HT dispatch token bytes must not exceed group's max_token_bytes")
        _require((tokens.shape[1] * tokens.element_size()) % HT_TOKEN_BYTE_MULTIPLE == 0,
                 "HT dispatch requires token bytes per token to be 16B aligned for TMA")
        _require(tokens.shape[0] == routing.num_tokens, "inputs->tokens must hold the handle's tokens")
        if config.quantization_recipe != DispatchQuantizationRecipe.NONE:
            raise NotImplementedError("the double transports tokens unquantized (DispatchQuantizationRecipe.NONE)")
        _require(inputs.scales is None, "inputs->scales must be null for NONE")
        _require(outputs.scales is None, "outputs->scales must be null for NONE")
        forward = config.pass_direction == PassDir.FWD
        if forward:
            _require(inputs.topk_weights is not None, "topk_weights_in != nullptr")
            _require(outputs.topk_weights is not None, "recv_topk_weights != nullptr")
            _require(outputs.topk_weights.ndim == 1, "HT EM recv_topk_weights must be 1D [num_recv_tokens]")
        else:
            _require(inputs.topk_weights is None, "topk_weights_in == nullptr")
            _require(outputs.topk_weights is None and outputs.topk_idx is None, "recv_topk_weights == nullptr")
        out = outputs.tokens.buffer
        if out.shape[0] < routing.capacity:
            raise AssertionError(f"NCCL EP: eager dispatch recv buffer too small: {out.shape[0]} tokens < "
                                 f"{routing.capacity} required (size from ncclEpLayoutInfo_t::recv_total_counter)")
        every = self._all_tokens(tokens)
        _require(out.dtype == tokens.dtype and out.shape[1] == tokens.shape[1],
                 "outputs->tokens must match the inputs' dtype and row width")
        out[routing.slot_index] = every[routing.slot_token]
        out[routing.pad_slots] = 0
        if forward:
            weights = inputs.topk_weights.buffer
            _require(weights.dim() == 2 and weights.dtype == torch.float32, "topk_weights->ndim == 2")
            _require(tuple(weights.shape) == (routing.num_tokens, routing.top_k), "topk_weights->ndim == 2")
            every_weights = self._all_tokens(weights)
            outputs.topk_weights.buffer[routing.slot_index] = every_weights[routing.slot_token, routing.slot_pick]
            outputs.topk_weights.buffer[routing.pad_slots] = 0

    def _all_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, each rank's padded to ``max_dispatch_tokens_per_rank`` ([G, ...])."""
        comm, max_tokens = self._group._comm, self._group.config.max_dispatch_tokens_per_rank
        padded = rows.new_zeros((max_tokens, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        every = rows.new_empty((comm.nranks * max_tokens, *rows.shape[1:]))
        _all_gather(every, padded.contiguous(), comm.group)
        return every

    def _to_sources(self, per_global_token: torch.Tensor) -> torch.Tensor:
        """[G, ...] partial results of every global token -> each source rank's [max tokens, ...], summed over
        ranks in fp32."""
        comm, max_tokens = self._group._comm, self._group.config.max_dispatch_tokens_per_rank
        received = torch.empty_like(per_global_token)
        dist.all_to_all_single(received, per_global_token.contiguous(), group=comm.group)
        return received.view(comm.nranks, max_tokens, *per_global_token.shape[1:]).sum(0)

    def combine(self, inputs: CombineInputs, outputs: CombineOutputs, *, config: CombineConfig | None = None,
                stream) -> None:
        routing = self._routing_for("combine")
        config = config or CombineConfig()
        comm, max_tokens = self._group._comm, self._group.config.max_dispatch_tokens_per_rank
        rows = inputs.tokens.buffer
        if rows.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise AssertionError(f"NCCL EP: combine unsupported token dtype {rows.dtype}")
        if config.quantization_recipe != CombineQuantizationRecipe.NONE:
            raise NotImplementedError("the double transports tokens unquantized (CombineQuantizationRecipe.NONE)")
        backward = config.pass_direction == PassDir.BWD
        if backward:
            _require(inputs.topk_weights is not None, "topk_weights != nullptr")
            _require(inputs.topk_weights.ndim == 1, "HT EM BWD combine: input topk_weights must be 1D [num_recv_tokens]")
            _require(outputs.topk_weights is not None, "expert-major combine requires topk_weights in outputs")
        else:
            _require(inputs.topk_weights is None, "topk_weights_in == nullptr")
        num_global = comm.nranks * max_tokens
        # every pick's row goes back to its token's rank (exactly one rank holds it; the others send zeros), which
        # sums the token's picks by ascending expert id in fp32 and rounds once
        per_pick = rows.new_zeros((num_global, routing.top_k, rows.shape[1]), dtype=torch.float32)
        per_pick[routing.slot_token, routing.slot_pick] = rows[routing.slot_index].float()
        picks = self._to_sources(per_pick)[:routing.num_tokens]
        tokens = torch.arange(routing.num_tokens, device=picks.device)
        total = picks.new_zeros((routing.num_tokens, rows.shape[1]))
        for position in range(routing.top_k):
            total += picks[tokens, routing.pick_order[:, position]]
        out = outputs.tokens.buffer
        out.copy_(total.to(out.dtype))
        if backward:
            weights = rows.new_zeros((num_global, routing.top_k), dtype=torch.float32)
            weights[routing.slot_token, routing.slot_pick] = inputs.topk_weights.buffer[routing.slot_index].float()
            outputs.topk_weights.buffer.copy_(self._to_sources(weights)[:routing.num_tokens])

    def complete(self, *, config: int = 0, stream) -> None:
        raise AssertionError("ncclEpComplete: only LL mode is supported")

    def destroy(self) -> None:
        self._destroyed = True
