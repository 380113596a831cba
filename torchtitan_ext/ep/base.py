"""What every EP backend shares: the ``ExpertParallel`` contract and its inputs.

A backend is an ``ExpertParallel`` (a ``ParallelStyle``) applied to the routed
experts. It shards their weights on dim 0 over the EP mesh (torchtitan's
``_partition_fn``), and wraps the experts' forward:

- ``_token_dispatch``: (tokens [N, H], :class:`Routing`: top-k scores [N, K]
  and expert ids [N, K]) -> (expert-major rows [M, H], padded rows per local
  expert [L]);
- ``_token_combine``: expert output rows [M, H] -> [N, H], each token's
  top-k results summed, back on its source rank in its source order.

Scores multiply the rows before the experts (``score_before_experts``, Llama4)
or the expert outputs before combine (DeepSeek-V3); either way in fp32,
rounded to the activation dtype.
"""

import importlib
import re
from dataclasses import dataclass
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary
from torchtitan.components.quantization import FP8_GROUP_ALIGNMENT_SIZE, MXFP8_GROUP_ALIGNMENT_SIZE
from torchtitan.distributed.expert_parallel import ExpertParallel

from torchtitan_ext.config import ConfigError, MoEShape, Range
from torchtitan_ext.ep.budget import DeviceBudget
from torchtitan_ext.ep.handle import KernelBuffer
from torchtitan_ext.ep.kernels import KernelUnavailable, resolve_implementation
from torchtitan_ext.ep.layout import into_groups
from torchtitan_ext.runtime.collectives import naming_collective
from torchtitan_ext.runtime.workers import before_process_group_teardown


def moe_layer_name(layer_id: int | str) -> str:
    """"MoE layer 3": how a layer's collectives are named (:meth:`RoutedExpertParallel.collective_name`)."""
    return f"MoE layer {layer_id}"


def named_layer(name: str) -> int | None:
    """The MoE layer a collective's name is of (its layer's, or the next one's for a fetch issued ahead); None for
    a name of no layer."""
    found = _LAYER_NAMED.match(name)
    return int(found.group(1)) if found else None


_LAYER_NAMED = re.compile(r"MoE layer (\d+) ")


@dataclass(frozen=True)
class Variant:
    """One named way to run a backend: its section's overrides, and what the named variant sets
    (:mod:`torchtitan_ext.ep.backends`) select it by."""

    overrides: tuple[str, ...] = ()
    """Overrides of the backend's own section ("--section.field", "value", ...)."""
    library_class: str | None = None
    """The deep_ep class its kernels call where the real library runs; None: no kernel library."""
    reference_kernels: bool = True
    """The reference kernels implement it, so a CPU runs it; False: only the deep_ep double does."""
    may_drop_when_padded: bool = False
    """It may drop (token, expert) pairs once groups are padded (a capacity of 1.0 that padding overflows)."""
    in_matrix: bool = True
    """It runs in the costliest test matrices (one variant per kernel family: the gradient matrix, the benches'
    defaults)."""


class Routing:
    """A MoE layer's routing, as its experts module receives it next to the tokens.

    A plain object rather than two tensor arguments (and deliberately not a
    dataclass or a tuple, which FSDP2 walks into): FSDP2's mixed precision
    casts every floating-point tensor it finds in the experts' forward
    arguments to the parameter dtype, and the scores must stay fp32 end to
    end (their gradient flows back to the router), as in torchtitan's own MoE.
    """

    __slots__ = ("scores", "expert_ids", "logical_ids", "sent_counts")

    def __init__(self, scores: torch.Tensor, expert_ids: torch.Tensor, logical_ids: torch.Tensor | None = None,
                 sent_counts: torch.Tensor | None = None):
        self.scores = scores
        """[N, K] top-k routing scores, fp32."""
        self.expert_ids = expert_ids
        """[N, K] dispatched expert ids (slots under a placement or replication), int64."""
        self.logical_ids = expert_ids if logical_ids is None else logical_ids
        """[N, K] the router's expert ids, which the load statistics count."""
        self.sent_counts = sent_counts
        """[EP, dispatched experts] the pairs every rank of the EP group sends to each dispatched expert, on the
        device, where the routing already knows them (expert replication's split); None: a backend that needs
        them exchanges its own."""


def check_kernels(backend: str, implementation: str, device_type: str | None, class_name: str) -> None:
    """ConfigError unless ``[backend] implementation`` can run on ``device_type`` (the library's
    ``class_name`` importable where it is needed)."""
    if device_type is None:
        return
    try:
        resolve_implementation(backend, implementation, device_type, class_name)
    except KernelUnavailable as e:
        raise ConfigError(str(e)) from None


def token_group_alignment(job_config) -> int:
    """Row multiple the expert GEMMs need: 32 for MXFP8, 16 for FP8 grouped GEMMs, else 1."""
    converters = job_config.model.converters
    if "quantize.grouped_mm.mx" in converters:
        return MXFP8_GROUP_ALIGNMENT_SIZE
    if "quantize.grouped_mm.float8" in converters:
        return FP8_GROUP_ALIGNMENT_SIZE
    return 1


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums of ``dtype`` values accumulate in: fp32, or ``dtype`` where it is wider (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def scored_rows_fp32(rows: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
    """rows in fp32 (fp64 rows stay fp64), times their scores per row when given. The product promotes the rows as
    they are: no fp32 copy of them (bitwise the same as copying first)."""
    return rows.to(accumulation_dtype(rows.dtype)) if scores is None else rows * scores.float().unsqueeze(-1)


def row_dots_fp32(rows: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """Each row's dot product with the same row of ``others``, summed in fp32 over exact fp32 products, without an
    fp32 copy of either (a 1 x 1 fp32 zero takes part in type promotion; no reduction op takes bf16 inputs to an
    fp32 result on every device)."""
    return torch.addcmul(rows.new_zeros((1, 1), dtype=torch.float32), rows, others).sum(-1)


def _rows_times_scores(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    # computed in fp32 and written in the rows' dtype by one kernel: a GPU casts as it writes, no fp32 temporary
    # (a contiguous destination: compiled code refuses a strided out=)
    return torch.mul(rows, scores.float().unsqueeze(-1), out=rows.new_empty(rows.shape))


class _ScaleRows(torch.autograd.Function):
    """rows * scores per row, with a backward that makes no fp32 copy of the rows or of their gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # the rows are kept only for the scores' gradient
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, scores)
        return _rows_times_scores(rows, scores)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, scores = ctx.saved_tensors
        grad_rows = _rows_times_scores(grad, scores) if ctx.needs_input_grad[0] else None
        grad_scores = row_dots_fp32(grad, rows).to(scores.dtype) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_scores


def scored_sum_into(out: torch.Tensor, rows: torch.Tensor, target_of_row: torch.Tensor,
                    scores: torch.Tensor | None) -> None:
    """``out`` [targets, H] = the rows at each target (``target_of_row``) times their ``scores`` (when given), summed
    in fp32 (fp64 in fp64): in place when ``out`` is of that dtype, else in a total rounded once into it."""
    accumulation = accumulation_dtype(out.dtype)
    total = out.zero_() if out.dtype == accumulation else torch.zeros_like(out, dtype=accumulation)
    total.index_add_(0, target_of_row, scored_rows_fp32(rows, scores))
    if total is not out:
        out.copy_(total)


class _SumScoredRows(torch.autograd.Function):
    """Rows times their scores, summed per target in fp32 and rounded once; a backward without fp32 copies."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, target_of_row: torch.Tensor, scores: torch.Tensor | None,
                num_targets: int) -> torch.Tensor:
        # the rows are kept only for the scores' gradient
        ctx.save_for_backward(None if scores is None else rows, target_of_row, scores)
        summed = rows.new_empty((num_targets, rows.shape[1]))
        scored_sum_into(summed, rows, target_of_row, scores)
        return summed

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, target_of_row, scores = ctx.saved_tensors
        grad_rows, grad_scores = scored_sum_backward(grad, rows, target_of_row, scores)
        return grad_rows, None, grad_scores, None


def scored_sum_backward(grad: torch.Tensor, rows: torch.Tensor | None, target_of_row: torch.Tensor,
                        scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows' gradient, the scores') of per-target sums of ``rows`` times ``scores`` in fp32, rounded to the
    rows' dtype, given the sums' gradient ``grad`` (in that dtype): bitwise autograd's through the fp32 formula,
    without its fp32 copies. Without scores, None for theirs and ``rows`` is not needed."""
    grad_rows = grad.index_select(0, target_of_row)
    if scores is None:
        return grad_rows, None
    grad_scores = row_dots_fp32(grad_rows, rows).to(scores.dtype)
    grad_rows.mul_(scores.float().unsqueeze(-1))  # in fp32, rounded once to the rows' dtype
    return grad_rows, grad_scores


def sum_scored_rows(rows: torch.Tensor, target_of_row: torch.Tensor, scores: torch.Tensor | None,
                    num_targets: int) -> torch.Tensor:
    """[num_targets, H]: the rows at each target (``target_of_row``) times their ``scores`` (when given), summed in
    fp32 and rounded once to the rows' dtype. Its gradients equal autograd's through that fp32 formula, bitwise."""
    return _SumScoredRows.apply(rows, target_of_row, scores, num_targets)


class _GatherIntoGroups(torch.autograd.Function):
    """:func:`~torchtitan_ext.ep.layout.into_groups` with a backward that reads the groups' gradient once."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group_sources: torch.Tensor, pad_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(group_sources, pad_rows)
        ctx.num_rows = rows.shape[0]
        return into_groups(rows, group_sources, pad_rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        group_sources, pad_rows = ctx.saved_tensors
        # the pad rows' gradients are summed into one extra row, dropped: autograd's in-place fill would copy the
        # whole gradient to zero them first
        sources = group_sources.index_fill(0, pad_rows, ctx.num_rows)
        summed = grad.new_zeros((ctx.num_rows + 1, grad.shape[1])).index_add_(0, sources, grad)
        return summed[:ctx.num_rows], None, None


def gather_into_groups(rows: torch.Tensor, group_sources: torch.Tensor, pad_rows: torch.Tensor) -> torch.Tensor:
    """``rows`` gathered into padded expert-major groups, pad rows zero (``group_sources``: each group row's row, any
    row for a pad row); its gradient sums each group row's into its row, bitwise autograd's (in the same order)."""
    return _GatherIntoGroups.apply(rows, group_sources, pad_rows)


def scale_rows(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """rows * scores per row, in fp32, rounded once to the rows' dtype; the gradients as autograd would give them
    through that fp32 product (bitwise), without its fp32 temporaries."""
    return _ScaleRows.apply(rows, scores)


class DispatchStats:
    """One MoE layer's dispatches since the last read, counted on the device.

    Updated in training forwards without host syncs (index-adds into
    fixed-size tensors, by :func:`~torchtitan_ext.ep.ops.counting.count_once`, which skips
    activation checkpointing's recompute, compiled or not); evaluation forwards (``counting``
    off) are skipped. Read once per logged step (:meth:`read_and_reset`).
    """

    def __init__(self):
        self.counting = True
        """Whether the current forward counts: the EP style sets it from the module's ``training`` flag."""
        self.routed_per_expert: torch.Tensor | None = None
        """[E] (token, expert) picks routed to each global expert, from this rank's router."""
        self.received_rows: torch.Tensor | None = None
        """Rows this rank's experts processed (one per received pair, plus pad rows)."""
        self.kept_pairs: torch.Tensor | None = None
        """(token, expert) pairs this rank's experts received and kept, for a backend that can drop
        (HybridEP): the pairs routed to them less the dropped ones. The dropped pairs are the routed
        pairs less the kept ones, summed over all ranks at the log step."""

    @staticmethod
    def _count(total: torch.Tensor | None, size: int, index: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
        """``total`` (zeros of ``size`` when None) with ``values`` added (at ``index``) unless recomputing."""
        from torchtitan_ext.ep.ops.counting import count_once

        if total is None:
            total = torch.zeros(size, dtype=torch.int64, device=values.device)
        count_once(total, index, values.detach())
        return total

    def record_routing(self, expert_ids: torch.Tensor, num_experts: int) -> None:
        if self.counting:
            flat = expert_ids.reshape(-1)
            self.routed_per_expert = self._count(self.routed_per_expert, num_experts, flat, torch.ones_like(flat))

    def record_rows(self, rows_per_expert: torch.Tensor) -> None:
        if self.counting:
            self.received_rows = self._count(self.received_rows, 1, None, rows_per_expert.sum().view(1))

    def record_kept(self, kept_per_local_expert: torch.Tensor) -> None:
        if self.counting:
            self.kept_pairs = self._count(self.kept_pairs, 1, None, kept_per_local_expert.sum().view(1))

    def read_and_reset(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(routed per expert [E], received rows [1], kept pairs [1]) since the last read; None if nothing happened."""
        counters = (self.routed_per_expert, self.received_rows, self.kept_pairs)
        self.routed_per_expert = self.received_rows = self.kept_pairs = None
        return counters


_created_buffers: "weakref.WeakSet[SharedKernelBuffer]" = weakref.WeakSet()


def destroy_kernel_buffers() -> None:
    """Destroy every kernel buffer this process created (each rank calls it, before the process group goes).

    DeepEP's buffers are created with ``explicitly_destroy=True``: their destroy is a barrier and NCCL or
    NVSHMEM finalization over the EP group's communicator, which must still be alive. Left to the
    destructor, that barrier would run after the process group was destroyed, or hang an exit whose peer
    is gone; a job that ends with a failed collective therefore exits without it.
    """
    for buffer in list(_created_buffers):
        buffer.destroy()


before_process_group_teardown(destroy_kernel_buffers)


class SharedKernelBuffer:
    """One kernel buffer for every MoE layer of a job, created at the first dispatch.

    Its size comes from the config (``MoEShape``), not from the call, so it is
    allocated once; creating it lazily keeps dry runs and meta-device model
    construction free of communication buffers.
    """

    def __init__(self, create: Callable[[Any, torch.Tensor], Any]):
        self._create = create
        self._buffer: KernelBuffer | None = None
        _created_buffers.add(self)

    def destroy(self) -> None:
        """Release the buffer (a collective for DeepEP's); a later dispatch would create a new one."""
        if self._buffer is not None:
            self._buffer.value.destroy()
            self._buffer = None

    def get(self, group, example: torch.Tensor, *settings) -> KernelBuffer:
        """The buffer; ``example`` (the first dispatched tokens) gives device and dtype, ``settings`` what else the
        first layer's call knows that sizes it (passed on to the constructor)."""
        if self._buffer is None:
            # Creation runs collectives (handle exchange) inside the first dispatch. Selective
            # activation checkpointing's caching mode must not record them: its recompute
            # never creates the buffer again, so cached outputs would shift onto other ops.
            with _disable_current_modes():
                self._buffer = KernelBuffer(self._create(group, example, *settings))
        return self._buffer


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (host memory: counts a kernel library or a host sync produced) on ``device``.

    Pinned and copied with ``non_blocking``, so that the copy is queued on the
    stream instead of making the host wait for it. A no-op for a tensor already
    on ``device``, except pinned memory (a library's host staging area, which
    it may reuse), which is always copied out.
    """
    pinned = tensor.is_pinned()
    if tensor.device.type == "cpu" and device.type != "cpu" and not pinned:
        tensor = tensor.pin_memory()
    copied = tensor.to(device, non_blocking=True)
    return copied.clone() if copied is tensor and pinned else copied


HOST_COPIES = WeakIdKeyDictionary()
"""Tensors :func:`to_host` made: host memory, wherever the process computes (the device-cost ledger reads it)."""


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, queued on the stream (pinned, ``non_blocking``) instead of making the
    host wait: read it only once the stream has passed the copy."""
    if tensor.device.type == "cpu":
        copy = tensor.clone()
    else:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
    HOST_COPIES[copy] = True
    return copy


class RoutedExpertParallel(ExpertParallel, ABC):
    """Base of the EP backends: experts take (tokens, scores, expert ids)."""

    config_section: ClassVar[str | None] = None
    """Name of this backend's own config section (``[deepep]``, ``[hybridep]``), which holds
    its knobs and nobody else's; None when it has none."""

    Config: ClassVar[type | None] = None
    """That section's dataclass, nested in the backend class."""

    config_ranges: ClassVar[dict[str, Range]] = {}
    """Valid ranges of the section's numeric fields, keyed "section.field"."""


    variants: ClassVar[dict[str, "Variant"]] = {}
    """The named settings of this backend that tests, benchmarks and checks run it in (the one named as the backend
    is its default), gathered into the named sets of :mod:`torchtitan_ext.ep.backends`."""

    library_implementation: ClassVar[str | None] = None
    """The section's ``implementation`` value that selects the real kernel library ("deep_ep", "nccl_ep"); None:
    the backend has no kernel choice."""

    reference_syncs_host: ClassVar[bool] = False
    """Whether the backend's CPU kernels (its double) make the host wait inside the library's calls, where the
    library does not: a CUDA graph then captures the backend on the library only."""

    ops_module: ClassVar[str | None] = None
    """Module of this backend's custom ops: imported when the backend first builds a layer or names its
    saved ops, so that parsing a config that selects it registers no op with torch."""

    saved_ops: ClassVar[tuple[str, ...]] = ()
    """Ops ("namespace::name") whose outputs selective activation checkpointing must save, so that
    recomputation never repeats a collective."""

    min_pad_multiple: ClassVar[int] = 1
    """Smallest row multiple this backend pads expert groups to."""

    supports_expert_tensor_parallel: ClassVar[bool] = False
    """Whether expert_tensor_parallel_degree > 1 works with this backend."""

    shared_experts_overlap: ClassVar[str] = "no: combine has landed when the experts return"
    """Whether the MoE's shared experts run while this backend's combine is in flight, and how."""

    sized_by_dispatch: ClassVar[bool] = False
    """Whether its buffers or per-call sizes are made for a training dispatch (``MoEShape.max_tokens_per_rank``): a
    call with more tokens cannot run (a validation pass's larger batch is refused in the job's config check)."""

    needs_expert_parallelism: ClassVar[bool] = True
    """Whether selecting this backend with expert_parallel_degree = 1 is a config error
    (a kernel backend has nothing to do there)."""

    def __init__(self, *, score_before_experts: bool, pad_multiple: int = 1):
        super().__init__()
        self.score_before_experts = score_before_experts
        self.pad_multiple = max(pad_multiple, self.min_pad_multiple)
        self.stats = DispatchStats()
        self.layer_name = "an MoE layer"
        """Which layer this style serves ("MoE layer 3"), for error messages; set by the parallelize plan."""
        self._pending = None

    @classmethod
    def sac_save_ops(cls) -> tuple:
        """The overloads of :attr:`saved_ops`, after importing :attr:`ops_module` (which registers them)."""
        if cls.ops_module is not None:
            importlib.import_module(cls.ops_module)
        return tuple(
            getattr(getattr(torch.ops, namespace), name).default
            for namespace, _, name in (op.partition("::") for op in cls.saved_ops)
        )

    @classmethod
    @abstractmethod
    def layer_factory(cls, job_config, shape: MoEShape) -> Callable[..., "RoutedExpertParallel"]:
        """Per-layer constructor (keyword: score_before_experts);
        the layers it makes share whatever the backend shares (its buffer)."""

    @classmethod
    @abstractmethod
    def device_budget(cls, job_config) -> DeviceBudget:
        """What one MoE layer of this backend may cost a GPU per training step (the device-cost ledger holds it)."""

    @classmethod
    def validate_config(cls, job_config, device_type: str | None, shape: MoEShape) -> None:
        """Reject this backend's invalid knobs and combinations with a ConfigError naming the
        field and the fix (its section's ranges are checked before).

        ``device_type`` None: validating for another machine (a dry run), which skips
        the checks of what this machine can run.
        """

    @classmethod
    def library_unavailable_reason(cls) -> str | None:
        """Why this machine cannot run the backend's real kernel library, or None when it can (or has none)."""
        return None

    @classmethod
    def kernels_take_bf16_tokens_only(cls, job_config, device_type: str | None) -> bool:
        """Whether the job's kernels refuse or misread anything but bf16 tokens (a library's do; the
        reference and torch.distributed take any dtype)."""
        return False

    @classmethod
    def drop_remedy(cls, job_config) -> str:
        """How to stop this backend from dropping tokens (only backends that can drop say more)."""
        return "this backend does not drop tokens"

    @classmethod
    def library_environment(cls, job_config) -> dict[str, str]:
        """Environment variables the backend's kernel library reads (exported by launchers)."""
        return {}

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        """The backend's settings for this job, for reports (dry run, planner, logs)."""
        pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
        return {
            "backend": cls.__name__,
            "expert group padding": f"multiples of {pad} rows",
            "shared experts overlap combine": cls.shared_experts_overlap,
        }

    @abstractmethod
    def dispatch(
        self, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor,
        num_experts: int, group, sent_counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert-major rows, padded rows per local expert); remembers what combine needs. ``sent_counts``:
        :attr:`Routing.sent_counts`, for a backend that would otherwise exchange the counts itself."""

    @abstractmethod
    def combine(self, routed_output: torch.Tensor, group) -> torch.Tensor:
        """Expert outputs back to [N, H] on their source ranks; may return them in flight
        (:mod:`torchtitan_ext.ep.in_flight`), landing at first use."""

    def collective_name(self, step: str) -> str:
        """"MoE layer 3 dispatch (NcclExpertParallel)": what a failing collective is reported as (the layer named by
        :func:`moe_layer_name`)."""
        return f"{self.layer_name} {step} ({type(self).__name__})"

    def _token_dispatch(self, mod, inputs, device_mesh):
        x, routing = inputs
        self.stats.counting = mod.training
        self.stats.record_routing(routing.logical_ids, mod.num_experts)
        # replica slots (torchtitan_ext.ep.replication.experts) add to the experts dispatched over
        dispatched = getattr(mod, "dispatched_experts", mod.num_experts)
        group = device_mesh.get_group()
        queue_replica_fetch = getattr(mod, "queue_replica_fetch", None)
        if queue_replica_fetch is not None:
            # the replicas' fetch goes ahead of the dispatch, through the transport a kernel buffer may carry
            self.prepare_buffer(x, group)
            queue_replica_fetch()
        with naming_collective(self.collective_name("dispatch")):
            rows, rows_per_expert = self.dispatch(
                x, routing.scores, routing.expert_ids, dispatched, group, routing.sent_counts
            )
        if queue_replica_fetch is not None:
            # the next layer's replicas move while this layer's experts compute
            mod.fetch_following_ahead(experts_queued=False)
        self.stats.record_rows(rows_per_expert)
        return rows, rows_per_expert

    def prepare_buffer(self, x: torch.Tensor, group) -> None:
        """Create the kernel buffer the dispatch of ``x`` would (a backend with one overrides this), ahead of it:
        the buffer may register the group's replica transport (:mod:`torchtitan_ext.ep.replication`)."""

    def _token_combine(self, mod, routed_output, device_mesh):
        with naming_collective(self.collective_name("combine")):
            combined = self.combine(routed_output, device_mesh.get_group())
        fetch_following_ahead = getattr(mod, "fetch_following_ahead", None)
        if fetch_following_ahead is not None:
            fetch_following_ahead(experts_queued=True)
        return combined

    def _take_pending(self):
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"{type(self).__name__}: combine called without a dispatch")
        return pending
