"""Each EP backend's passes over the token rows outside its kernels, counted: the layout advisor's local work on GPUs.

:func:`count_local_traffic` runs one MoE call's dispatch and combine, forward and backward, in a process
group of this process alone (identity experts), under :class:`LocalTrafficCounter`: the bytes every
operator reads and writes, the bodies of the backends' own operators included, except views, the collectives
and the library calls. It counts at two small hidden sizes and extends the line to the job's; :class:`LocalTraffic`
holds the result (:meth:`LocalTraffic.receiving` grows it for a backend that sends a token once per rank).
The advisor prices it at the topology's ``memory_bandwidth_GBps``, in eager mode.
See docs/planning.md, the advisor's `local` column.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
import torchtitan.models.moe.utils as tt_moe_utils
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.models.moe.moe import TokenReorderer

from torchtitan_ext.config import ConfigError, MoEShape
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.ep.base import token_group_alignment
from torchtitan_ext.ep.kernels.calls import inside_kernel

_AFTER_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python).remove(
    torch._C.DispatchKey.PythonDispatcher
)


def run_below_python(func, tensor: torch.Tensor, args, kwargs):
    """``func`` run past the Python dispatch key, as ``tensor``'s keys route it: a dispatch mode that is entered
    around this call then sees the operators ``func``'s body runs (a mode alone sees only ``func``)."""
    return func.redispatch(torch._C._dispatch_keys(tensor) & _AFTER_PYTHON, *args, **kwargs)

_aten = torch.ops.aten
_ALLOCATE_ONLY = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided}
"""Operators that allocate without writing: no pass over memory."""
_SHAPE_FROM_ARGUMENTS = {_aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.new_zeros, _aten.new_ones,
                         _aten.new_full}
"""Operators that read only their tensor arguments' shape and dtype: they write their output."""
_OVERWRITE_FIRST = {_aten.copy_, _aten.fill_, _aten.zero_}
"""In-place operators that write their first argument without reading it."""


def counted_hidden_sizes(shape: MoEShape) -> tuple[int, int]:
    """The two small hidden sizes counted (the job's is on the line through them): neither is the expert count
    or top-k, so that a token vector's shape is no routing tensor's."""
    low, high = [size for size in (24, 40, 56) if size not in (shape.num_experts, shape.top_k)][:2]
    return low, high


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs, in order: within tuples, lists and dicts, the only
    containers an operator's schema has. torch's pytree finds the same through its registry of containers; the
    counters call this for every operator, and the registry's lookups were a tenth of a counted step."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [tensor for item in tree for tensor in tensors_in(item)]
    if isinstance(tree, dict):
        return [tensor for item in tree.values() for tensor in tensors_in(item)]
    return []


def moved_tensors(func, args, kwargs, out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors ``func`` reads, tensors it writes), each once."""
    packet = func.overloadpacket
    if packet in _SHAPE_FROM_ARGUMENTS:
        return [], [out]
    if packet is _aten.index_put_:
        # writes (or, accumulating, reads and writes) only its values' rows of the destination
        indices, values = args[1], args[2]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        written = [values, values] if accumulate else [values]
        return [index for index in indices if index is not None] + [values], written
    if packet in (_aten.index_copy_, _aten.index_add_):
        # the source's rows of the destination: written (an add reads them too)
        index, source = args[2], args[3]
        return [index, source], [source, source] if packet is _aten.index_add_ else [source]
    if packet is _aten.index_fill_:
        # the indexed rows of the destination, written
        destination, dim, index = args[0], args[1], args[2]
        return [index], [destination.narrow(dim, 0, index.numel())]
    # an out= destination is written, not read
    read_kwargs = {name: value for name, value in kwargs.items() if name != "out"}
    tensors = tensors_in((args, read_kwargs))
    if packet in _OVERWRITE_FIRST:
        tensors = tensors[1:]
    return tensors, tensors_in(out)


class LocalTrafficCounter(TorchDispatchMode):
    """Adds up the bytes each ATen operator reads and writes: each tensor argument read once and each output
    written once, except views and allocations, which move nothing, a ``*_like`` or ``new_*`` factory, which
    reads nothing, an overwrite (``copy_``, ``fill_``, ``zero_``, an ``out=`` destination), which does not read its
    destination, and the indexed writes (``index_put_``, ``index_copy_``, ``index_add_``, ``index_fill_``), which
    touch only the rows they index.

    A dispatch mode sees only the operators called outside any other operator's kernel, so a backend's own operator
    (``torchtitan_ext::*``) runs its body under this mode: the adapter code in it (the nccl operator's gathers into
    groups and zeroing of pad rows, HybridEP's routing map) is counted. What the collectives and the library calls
    run is not: the all-to-all's price holds it. A combine that lands later is counted where it lands, inside the
    wait for its result, unless its landing finishes a library kernel
    (:func:`~torchtitan_ext.ep.kernels.calls.inside_kernel`).

    ``token_bytes`` is the part in token vectors: [``tokens``, ``hidden``] tensors (a shape no other tensor
    has). At EP > 1 a backend that sends each token once per rank receives more tokens than it sends."""

    def __init__(self, tokens: int | None = None, hidden: int | None = None):
        super().__init__()
        self.token_shape = (tokens, hidden)
        self.bytes = 0
        self.token_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # a combine lands (sums its rows) inside the wait: run the wait's kernel with this mode on, to see them
            with self:
                if isinstance(args[0], AsyncCollectiveTensor):
                    # its own wait returns the landed tensor; a wait below Python would return the wrapper,
                    # whose storage holds no data
                    return args[0].trigger_wait()
                return run_below_python(func, args[0], args, kwargs)
        tensors = tensors_in((args, kwargs))
        if func.namespace == "torchtitan_ext" and tensors and not inside_kernel():
            # a backend's own operator: run its body with this mode on, to count the permutes and sums it runs
            # around its collectives and library calls (which stay uncounted); an in-flight argument lands first
            # (below Python an operator would get the pending wrapper, whose storage holds no data)
            with self:
                args, kwargs = tree_map_only(AsyncCollectiveTensor, lambda t: t.trigger_wait(), (args, kwargs))
                return run_below_python(func, tensors[0], args, kwargs)
        out = func(*args, **kwargs)
        if (func.namespace not in ("aten", "prims") or inside_kernel() or func.is_view
                or func.overloadpacket in _ALLOCATE_ONLY):
            return out
        read, written = moved_tensors(func, args, kwargs, out)
        for tensor in read + written:
            self.bytes += tensor.nbytes
            if tuple(tensor.shape) == self.token_shape:
                self.token_bytes += tensor.nbytes
        return out


@dataclass(frozen=True)
class LocalTraffic:
    """Bytes one rank's MoE call moves through device memory outside its kernels, at the job's shape, as counted
    in a group of one (every token received once)."""

    forward_bytes: float
    backward_bytes: float
    forward_token_bytes: float = 0.0
    """The part of ``forward_bytes`` in token vectors ([tokens, hidden] tensors)."""
    backward_token_bytes: float = 0.0
    """The part of ``backward_bytes`` in token vectors."""

    def receiving(self, tokens_per_sent_token: float) -> "LocalTraffic":
        """This traffic where a rank holds ``tokens_per_sent_token`` tokens for each token it sends (its token
        vectors grow by that factor): a backend that sends each token once per rank, at EP > 1, which counts
        its own sent tokens' vectors with the received ones."""
        grown = tokens_per_sent_token - 1
        return LocalTraffic(
            self.forward_bytes + grown * self.forward_token_bytes, self.backward_bytes + grown * self.backward_token_bytes,
            tokens_per_sent_token * self.forward_token_bytes, tokens_per_sent_token * self.backward_token_bytes,
        )

    @property
    def bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes

    @property
    def forward_share(self) -> float:
        """The forward's part, in [0, 1]: a recomputed layer moves it again."""
        return self.forward_bytes / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class MoECall:
    """Random inputs of one MoE call: tokens, their scores and expert picks."""

    x: torch.Tensor
    scores: torch.Tensor
    expert_ids: torch.Tensor

    @classmethod
    def random(cls, shape: MoEShape, tokens: int, dtype: torch.dtype) -> "MoECall":
        scores, expert_ids, after_routing = _random_routing(tokens, shape.num_experts, shape.top_k,
                                                            torch.get_default_dtype())
        generator = torch.Generator()
        generator.set_state(after_routing)
        x = torch.randn(tokens, shape.hidden_dim, generator=generator).to(dtype)
        return cls(x, scores.clone(), expert_ids.clone())


@lru_cache(maxsize=4)
def _random_routing(tokens: int, num_experts: int, top_k: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random scores, each token's ``top_k`` distinct experts (both drawn in ``dtype``, torch's default dtype at the
    call), and the generator's state after them (the token rows come next, from seed 0). Drawn once per shape: the
    routing is the same at every hidden size and for every backend counted (25 ms on 2 cores for 16,384 tokens over
    256 experts; a full argsort of [tokens, E] took seconds)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, top_k, generator=generator, dtype=dtype)
    picks = torch.rand(tokens, num_experts, generator=generator, dtype=dtype).topk(top_k, dim=1, largest=False)
    return scores, picks.indices, generator.get_state()


def torchtitan_sort_forward(call: MoECall, shape: MoEShape, score_before_experts: bool,
                            group_alignment: int | None = None) -> torch.Tensor:
    """torchtitan's MoE.forward around the experts at EP = 1, the experts as the identity. With
    ``group_alignment``, also the padding of each expert's rows to that multiple that torchtitan's grouped GEMMs
    run through without EP (its ``indices_padding_wrapper``: a gather into padded groups and a scatter back)."""
    tokens, top_k = call.expert_ids.shape
    x, scores = call.x.detach().requires_grad_(), call.scores.detach().requires_grad_()
    # float ids: torch.histc, which counts the picks, takes no integers on a CPU (the order and counts are the same)
    sorted_scores, sorted_picks, counts = TokenReorderer(shape.num_experts, top_k)(scores, call.expert_ids.float())
    routed = x[sorted_picks // top_k]
    if score_before_experts:
        routed = (routed.float() * sorted_scores.reshape(-1, 1)).to(x.dtype)
    if group_alignment is not None:
        with _host_padding(group_alignment):
            input_shape, padded, permuted_indices, _ = tt_moe_utils._permute(routed, counts.long(), 1, shape.num_experts)
            routed = tt_moe_utils._unpermute(padded, input_shape, permuted_indices)
    unsorted = torch.zeros((tokens * top_k, shape.hidden_dim), dtype=x.dtype)
    unsorted[sorted_picks] = routed
    unsorted = unsorted.reshape(tokens, top_k, shape.hidden_dim)
    if score_before_experts:
        return unsorted.sum(dim=1)
    return torch.bmm(scores.reshape(-1, 1, top_k), unsorted.float()).to(x.dtype).squeeze(1)


@contextmanager
def _host_padding(group_alignment: int):
    """torchtitan's padding at ``group_alignment``, its indices computed on the host (the count runs on CPU tensors,
    whatever device this process would train on)."""
    saved = tt_moe_utils.generate_permute_indices, tt_moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    tt_moe_utils.generate_permute_indices = partial(generate_permute_indices, use_cpu=True)
    tt_moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = group_alignment
    try:
        yield
    finally:
        tt_moe_utils.generate_permute_indices, tt_moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = saved


def backend_forward(style, call: MoECall, shape: MoEShape, group=None, expert_ids: torch.Tensor | None = None,
                    sent_counts: torch.Tensor | None = None) -> torch.Tensor:
    """One MoE call's dispatch and combine through ``style`` (a backend's layer) in ``group`` (default: the default
    process group), the experts as the identity. ``expert_ids`` and ``sent_counts``: what expert replication's split
    hands the backend (default: the call's picks, and the backend exchanges the counts itself)."""
    group = group or dist.group.WORLD
    rows, _ = style.dispatch(call.x.detach().requires_grad_(), call.scores.detach().requires_grad_(),
                             call.expert_ids if expert_ids is None else expert_ids, shape.num_experts, group,
                             sent_counts)
    return style.combine(rows, group)


def _counted(forward, tokens: int, hidden: int) -> tuple[int, int, int, int]:
    """(forward bytes, backward bytes, and their parts in token vectors) of ``forward()``, a call on ``tokens``
    tokens of ``hidden`` elements, and of its output's backward."""
    with LocalTrafficCounter(tokens, hidden) as forward_counter:
        out = forward()
        if isinstance(out, AsyncCollectiveTensor):
            out = out.trigger_wait()  # a combine's sum runs when it lands
    gradient = torch.ones_like(out)
    with LocalTrafficCounter(tokens, hidden) as backward_counter:
        out.backward(gradient)
    return forward_counter.bytes, backward_counter.bytes, forward_counter.token_bytes, backward_counter.token_bytes


_counts: dict[tuple, LocalTraffic] = {}


def _count(backend_name: str | None, job_config, shape: MoEShape, tokens: int, dtype: torch.dtype,
           score_before_experts: bool) -> LocalTraffic:
    counts = []
    low, high = counted_hidden_sizes(shape)
    for hidden in (low, high):
        small = replace(shape, hidden_dim=hidden)
        call = MoECall.random(small, tokens, dtype)
        if backend_name is None:
            # torchtitan pads each expert's rows for its grouped GEMMs, the GPU path (no EP pads them then)
            counts.append(_counted(lambda: torchtitan_sort_forward(
                call, small, score_before_experts, token_group_alignment(job_config)), tokens, hidden))
        else:
            style = BACKENDS[backend_name].layer_factory(job_config, small)(score_before_experts=score_before_experts)
            counts.append(_counted(lambda: backend_forward(style, call, small), tokens, hidden))
    at_low, at_high = counts
    return LocalTraffic(*(
        low_bytes + (high_bytes - low_bytes) / (high - low) * (shape.hidden_dim - low)
        for low_bytes, high_bytes in zip(at_low, at_high)
    ))


def count_local_traffic(backend_name: str | None, job_config, shape: MoEShape, tokens: int, dtype: torch.dtype,
                        score_before_experts: bool) -> LocalTraffic:
    """The bytes one MoE call of ``tokens`` tokens moves outside the kernels through ``backend_name``'s layer
    (None: torchtitan's own sort, at EP = 1), at ``shape`` (the job's hidden size, experts and top-k), rows in
    ``dtype``, with the backend's settings in ``job_config``. Counted once per process and setting that shapes it
    (:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.traffic_settings`); seconds at DeepSeek-V3's shape."""
    section = None if backend_name is None else BACKENDS[backend_name].config_section
    settings = PLANNING_PROFILES[backend_name].traffic_settings(getattr(job_config, section)) if section else None
    # replica slots do not enter: a group of one has no replicas
    key = (backend_name, settings, token_group_alignment(job_config), shape, tokens, dtype, score_before_experts)
    if key in _counts:
        return _counts[key]
    created = not dist.is_initialized()
    if not created and (dist.get_world_size() != 1 or dist.get_backend() != "gloo"):
        raise ConfigError("counting a backend's local traffic needs a gloo process group of this process alone (or "
                          "none): run the layout advisor outside a multi-process job")
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # a backend's buffer exports its library's environment, as a training rank's must: not this process's
        with patch.dict(os.environ):
            _counts[key] = _count(backend_name, job_config, shape, tokens, dtype, score_before_experts)
    finally:
        if created:
            dist.destroy_process_group()
    return _counts[key]
