"""The ``deepep`` backend: DeepEP's normal-mode kernels, through its V2.5, V2 or v1 API.

Dispatch sends each token once to every rank that owns one of its experts;
the received rows are expanded per local pick and stably sorted by local
expert into padded expert-major groups; combine scatter-adds each token's
picks and sends one partial row per rank back, where the library sums them
unweighted in fp32. Combine runs asynchronously and lands at the first use
of its output (``in_flight``), so the MoE's shared experts overlap it. Picks
whose score is exactly 0 are not sent (torchtitan's masking). Autograd:
dispatch backward is a combine of the gradient (with the top-k weights'
gradients), combine backward a cached dispatch.

``[deepep] api`` picks DeepEP V2.5's ``EPBuffer``, V2's ``ElasticBuffer`` or
v1's ``Buffer`` (:mod:`torchtitan_ext.ep.kernels.deepep_apis`); ``[deepep]
implementation`` the real library or the reference. One buffer is shared by
all MoE layers and created at the first dispatch. Under expert replication,
an ``EPBuffer`` whose NVLink domain is the whole EP group also carries the
replicas' weights and gradients (its load-balancing kernels).
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import ConfigError, MoEShape, Range, routed_expert_parameter_elements
from torchtitan_ext.ep.base import (
    check_kernels,
    gather_into_groups,
    RoutedExpertParallel,
    scale_rows,
    SharedKernelBuffer,
    sum_scored_rows,
    to_device,
    token_group_alignment,
    Variant,
)
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.handle import DispatchHandle
from torchtitan_ext.ep.in_flight import in_flight
from torchtitan_ext.ep.kernels import implementation_description as _implementation_description
from torchtitan_ext.ep.kernels import import_library, library_has, resolve_implementation, uses_library
from torchtitan_ext.ep.kernels.deep_ep import LB_ROW_ALIGNMENT
from torchtitan_ext.ep.kernels.deepep_apis import APIS
from torchtitan_ext.ep.layout import block_destinations
from torchtitan_ext.ep.planning_profile import PlanningProfile
from torchtitan_ext.ep.published_rates import nearest_sms, PublishedRate

LIBRARY_CLASS = {"legacy": "Buffer", "elastic": "ElasticBuffer", "ep": "EPBuffer"}
"""The deep_ep class behind each API."""

LB_ALLOCATION_ALIGNMENT = 2 * 1024 * 1024
"""Bytes each tensor of DeepEP V2.5's load-balancing region is aligned to (``get_num_allocation_alignment()``,
kNumAllocationAlignmentBytes)."""

INTRANODE_RANKS = (2, 4, 8)
"""EP degrees DeepEP's v1 intranode kernels are instantiated for."""

INTERNODE_NODES = (2, 3, 4, 6, 8, 12, 16, 18, 20)
"""Nodes of 8 ranks its v1 internode kernels are instantiated for on DeepEP main (csrc/kernels/legacy/launch.cuh)."""

HYBRID_EP_BUILD_INTERNODE_NODES = (2, 4, 8, 16, 18, 20)
"""The same on a build of the hybrid-ep branch (csrc/kernels/launch.cuh at 94a9f8f6): other node counts fail
at the first dispatch ("Unsupported RDMA ranks")."""


LEGACY_NVLINK_PEERS = 8
"""Ranks DeepEP's v1 kernels reach over NVLink; the others over RDMA (a "node" of its internode kernels)."""

LEGACY_DEFAULT_SMS = 20
"""v1's ``Buffer.num_sms`` when ``set_num_sms`` is not called (DeepEP main's deep_ep/buffers/legacy.py)."""

PUBLISHED_RATES = {
    "legacy": (
        PublishedRate("nvlink", 153.0, 158.0, 200.0, 8, 24,
                      "docs/published_ep_figures.md 1.1: DeepEP docs/legacy.md, H800 intranode EP8 (NVLink nominal "
                      "200 GB/s: DeepEP issue #16), 24 SMs in its test script"),
        # v1 within its 8 NVLink peers of a GB200 rack: the figures on one B200 node's NVLink 5 (900 GB/s, as
        # GB200's), which HybridEP's README measured; "nvlink" (HGX H100/H800, NVLink 4) keeps DeepEP's own H800 one
        *(PublishedRate("mnnvl", dispatch, combine, 900.0, 8, sms,
                        f"docs/published_ep_figures.md 4b: DeepEP on B200, 8 ranks, {sms} SMs, BF16, Torch API "
                        "(DeepEP hybrid-ep branch docs/README_Hybrid-EP.md)")
          for sms, dispatch, combine in ((16, 348.0, 302.0), (24, 494.0, 420.0), (28, 560.0, 477.0), (32, 619.0, 524.0),
                                         (36, 635.0, 549.0), (40, 629.0, 570.0), (44, 640.0, 577.0), (48, 646.0, 586.0))),
        PublishedRate("rdma", 51.0, 50.0, 50.0, 8, 24,
                      "docs/published_ep_figures.md 1.4: DeepEP docs/legacy.md, H800 + CX7 400 Gbit/s internode EP64 "
                      "(8 nodes), 24 SMs in its test script"),
    ),
    "elastic": (
        *(PublishedRate(fabric, dispatch, combine, 900.0, 8, sms,
                        f"docs/published_ep_figures.md {row}: DeepEP main README, SM100 NVLink EP8, {sms} SMs")
          for fabric in ("nvlink", "mnnvl")
          for row, sms, dispatch, combine in (("3.5", 24, 643.0, 675.0), ("3.4", 64, 726.0, 740.0))),
        PublishedRate("rdma", 61.0, 61.0, 50.0, 4, 6,
                      "docs/published_ep_figures.md 3.2: DeepEP main README, SM90 + CX7 EP 8 x 4, 6 SMs"),
    ),
}
PUBLISHED_RATES["ep"] = PUBLISHED_RATES["elastic"]
"""Per API: the figures DeepEP publishes for its normal kernels (V2 has none for NVLink at SM90: its SM100
figures, as a fraction of NVLink 5's rate, stand for both NVLink kinds). V2.5's ``EPBuffer`` is V2's buffer
split by job, and its README (DeepEP 93eb6eb) publishes no figures of its own: V2's stand for it."""


def resolve_api(api: str, implementation: str, device_type: str | None) -> str:
    """``"ep"``, ``"elastic"`` or ``"legacy"`` for ``[deepep] api`` and ``implementation`` on ``device_type``.

    ``auto``, when the job runs the installed deep_ep: V2.5 (ep) where it has
    ``EPBuffer``, else V2 (elastic) where it has ``ElasticBuffer``, else v1
    (the hybrid-ep branch, or a release before v2). Otherwise (the reference,
    or ``device_type`` None: a plan for a machine not known yet) V2, DeepEP
    main as pinned (v2.1.0).
    """
    if api != "auto":
        return api
    runs_library = implementation == "deep_ep" or (device_type is not None and uses_library(implementation, device_type))
    if not runs_library:
        return "elastic"
    return next((api for api in ("ep", "elastic") if library_has(LIBRARY_CLASS[api])), "legacy")


def _check_library_rank_count(ep: int) -> None:
    """ConfigError unless the installed deep_ep's v1 ``Buffer`` runs on ``ep`` ranks: its kernel config table
    (the hybrid-ep branch's lacks 48 and 96, which DeepEP main has), and across nodes the node counts its
    internode kernels are built for, which differ per build."""
    buffer_class = import_library().Buffer
    try:
        buffer_class.get_dispatch_config(ep)
        buffer_class.get_combine_config(ep)
    except (AssertionError, KeyError) as e:  # KeyError: the table lookup when Python runs with -O
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep}: the installed deep_ep's v1 Buffer has no kernel config "
            f"for it ({e}): pick another EP degree, or install DeepEP main and set deepep.api = 'elastic'"
        ) from None
    hybrid_ep_build = library_has("HybridEPBuffer")
    nodes = HYBRID_EP_BUILD_INTERNODE_NODES if hybrid_ep_build else INTERNODE_NODES
    if ep > 8 and ep // 8 not in nodes:
        build = "a build of the hybrid-ep branch" if hybrid_ep_build else "DeepEP main"
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep}: the installed deep_ep ({build}) has v1 internode kernels "
            f"for {', '.join(map(str, nodes))} nodes of 8 ranks, not {ep // 8}: pick one of those"
            + (", or install DeepEP main and set deepep.api = 'elastic'" if hybrid_ep_build else "")
        )


def hidden_bytes(hidden_dim: int, element_size: int) -> int:
    """Bytes per token DeepEP sizes its buffer for: at least 2 per element, so bf16 and fp8 share one buffer."""
    return hidden_dim * max(element_size, 2)


@dataclass
class _ReplicaRows:
    """What an ``EPBuffer``'s load-balancing region holds: ``slots`` replicas of one routed expert, whose row in
    each of its parameters holds ``parameter_elements`` (as the layer the style is applied to has them)."""

    slots: int
    parameter_elements: tuple[int, ...] = ()


def _create_kernels(job_config, shape: MoEShape, replica_rows: _ReplicaRows, group, example: torch.Tensor):
    """The API adapter over a new buffer: the library's or the reference's (whose V2 buffer takes V2.5's
    calls too; its replicas move by all-to-all)."""
    section = job_config.deepep
    api = resolve_api(section.api, section.implementation, example.device.type)
    implementation = resolve_implementation("deepep", section.implementation, example.device.type, LIBRARY_CLASS[api])
    if implementation == "deep_ep":
        from torchtitan_ext.ep.kernels import deep_ep

        _check_library_dtype(example)
        if api == "legacy":
            buffer = deep_ep.deepep_buffer(group, hidden_bytes(shape.hidden_dim, example.element_size()), section.num_sms)
        elif api == "elastic":
            buffer = deep_ep.elastic_buffer(group, shape)
        else:
            buffer, transport = deep_ep.ep_buffer(
                group, shape, replica_rows.slots, replica_rows.parameter_elements, example.dtype, section.num_sms
            )
            return APIS[api](buffer, section.num_sms, transport)
    else:
        from torchtitan_ext.ep.kernels.reference import ReferenceBuffer, ReferenceElasticBuffer

        if api == "legacy":
            buffer = ReferenceBuffer(group)
        else:
            buffer = ReferenceElasticBuffer(
                group, num_max_tokens_per_rank=shape.max_tokens_per_rank, hidden=shape.hidden_dim, num_topk=shape.top_k
            )
    return APIS[api](buffer, section.num_sms)


def _check_library_dtype(tokens: torch.Tensor) -> None:
    if tokens.dtype != torch.bfloat16:
        raise TypeError(
            f"DeepEP's combine kernels take bf16 tokens only, not {tokens.dtype}: "
            "set training.mixed_precision_param = 'bfloat16' (or deepep.implementation = 'reference')"
        )


@dataclass(frozen=True)
class _DeepEPDispatchState:
    handle: DispatchHandle
    pair_order: torch.Tensor
    """Valid received picks (row * K + k), expert-major."""
    destinations: torch.Tensor
    pair_scores: torch.Tensor | None
    num_received: int
    top_k: int
    num_tokens: int


class DeepEPExpertParallel(RoutedExpertParallel):
    """EP over DeepEP's normal-mode kernels (V2.5 EPBuffer, V2 ElasticBuffer or v1 Buffer)."""

    @dataclass
    class Config:
        """``[deepep]``: knobs of the deepep backend."""

        implementation: Literal["auto", "deep_ep", "reference"] = "auto"
        """
        Which kernels run the DeepEP calls.

        - "auto": the real deep_ep library on CUDA, the reference on CPU. On CUDA
          without deep_ep installed this is an error, never a silent fallback.
        - "deep_ep": the real library (CUDA only; built from source, see docs/backends.md).
        - "reference": torchtitan_ext's pure torch.distributed implementation of the
          same calls with the same results, on any device. Slow; for debugging and CI.
        """

        api: Literal["auto", "ep", "elastic", "legacy"] = "auto"
        """
        Which DeepEP API drives the kernels.

        - "ep": DeepEP V2.5's ``EPBuffer`` (V2's buffer split by job; V2.5 removed
          ``Buffer`` and ``ElasticBuffer``). Needs NCCL >= 2.32.3 and torch >= 2.10.
          Under expert replication its load-balancing kernels carry the replicas'
          weights (out) and fp32 gradients (home) instead of all-to-alls, where the
          EP group is one NVLink domain, an expert is a multiple of 32 bytes and
          deterministic algorithms are off; otherwise replicas move by all-to-all,
          as the job's log says.
        - "elastic": DeepEP V2's ``ElasticBuffer`` (DeepEP main, v2.1): fewer SMs,
          per-expert receive counts on the device. Needs NCCL >= 2.30.4, torch >= 2.10
          and NVSHMEM on the cluster.
        - "legacy": the v1 ``Buffer`` (exported by DeepEP main up to v2.1; the only one
          in builds of the hybrid-ep branch). EP degrees 2, 4, 8 within a node, or
          multiples of 8 across nodes.
        - "auto": with the installed deep_ep, the newest it has (ep, elastic, legacy);
          with the reference, or in a plan for a machine not known yet, elastic.

        All take the same routing and give the same results; the reference
        implements elastic and legacy, and runs "ep" through its elastic buffer
        (the same calls), moving replicas by all-to-all.
        """

        num_sms: int | None = None
        """
        Streaming multiprocessors the kernels use (v1: ``Buffer.set_num_sms``; V2 and
        V2.5: the ``num_sms`` of each call, V2.5's load-balancing kernels' too). Even
        integer >= 2 (one channel per 2 SMs); unset keeps the library's default (v1: 20;
        V2, V2.5: its computed minimum, 20 where it cannot compute one). More
        SMs speed up communication and leave fewer for the experts' GEMMs. Ignored
        by the reference implementation.
        """

    config_section = "deepep"
    sized_by_dispatch = True
    config_ranges = {"deepep.num_sms": Range(2, meaning="SMs, an even count")}

    shared_experts_overlap = "yes: combine runs asynchronously on DeepEP's communication stream"
    variants = {
        "deepep": Variant(("--deepep.api", "elastic"), "ElasticBuffer"),
        "deepep_legacy": Variant(("--deepep.api", "legacy"), "Buffer", in_matrix=False),
        # V2.5's EPBuffer has no reference kernels: it runs against the deep_ep double (tests/ep/test_deep_ep_double.py)
        "deepep_ep": Variant(("--deepep.api", "ep"), "EPBuffer", reference_kernels=False, in_matrix=False),
    }
    library_implementation = "deep_ep"
    ops_module = "torchtitan_ext.ep.ops.deepep"
    saved_ops = ("torchtitan_ext::deepep_dispatch", "torchtitan_ext::deepep_combine")

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        replica_rows = _ReplicaRows(job_config.expert_replication.slots_per_rank)
        buffer = SharedKernelBuffer(partial(_create_kernels, job_config, shape, replica_rows))
        return partial(cls, buffer=buffer, replica_rows=replica_rows, pad_multiple=token_group_alignment(job_config))

    @classmethod
    def device_budget(cls, job_config) -> DeviceBudget:
        # v1's Buffer takes its layout from a call of its own (get_dispatch_layout); "auto" may pick v1
        layout_call = job_config.deepep.api in ("legacy", "auto")
        return DeviceBudget(
            forward=Budget(host_syncs=1, collectives=2 + layout_call, h2d_copies=2),
            backward=Budget(collectives=2),
            why="the library's dispatch (its receive counts reach the host: one sync) and combine each pass; the "
                "expert-major permutation is computed from those host counts and copied to the device with the "
                "rows per expert, pinned",
        )

    @classmethod
    def validate_config(cls, job_config, device_type: str | None, shape: MoEShape) -> None:
        section = job_config.deepep
        if section.num_sms is not None and section.num_sms % 2:
            raise ConfigError(
                f"deepep.num_sms = {section.num_sms}: use an even integer >= 2 (one channel per 2 SMs)"
            )
        if not uses_library(section.implementation, device_type):
            return
        api = resolve_api(section.api, section.implementation, device_type)
        check_kernels("deepep", section.implementation, device_type, LIBRARY_CLASS[api])
        dtype = job_config.training.mixed_precision_param
        if dtype != "bfloat16":
            raise ConfigError(
                f"training.mixed_precision_param = '{dtype}', but DeepEP's combine kernels take bf16 tokens only "
                f"(deepep.implementation resolves to deep_ep): set it to 'bfloat16', or deepep.implementation = 'reference'"
            )
        if (shape.hidden_dim * 2) % 16:
            raise ConfigError(f"the model's hidden size {shape.hidden_dim} gives rows DeepEP cannot move: it needs a multiple of 8")
        ep = job_config.parallelism.expert_parallel_degree
        if api == "legacy" and not (ep in INTRANODE_RANKS or (ep % 8 == 0 and ep // 8 in INTERNODE_NODES)):
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep}: DeepEP's v1 kernels run on 2, 4 or 8 ranks within a node, "
                f"or on 8 x {{{', '.join(map(str, INTERNODE_NODES))}}} across nodes: pick one of those, "
                "or deepep.api = 'elastic'"
            )
        if api == "legacy" and device_type is not None:
            _check_library_rank_count(ep)

    @classmethod
    def kernels_take_bf16_tokens_only(cls, job_config, device_type: str | None) -> bool:
        return uses_library(job_config.deepep.implementation, device_type)

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        section = job_config.deepep
        api = section.api if section.api != "auto" else "auto (the newest of ep, elastic, legacy deep_ep has)"
        return {
            **super().describe(job_config, shape),
            "kernels": _implementation_description(section.implementation),
            "API": api,
            "SMs": str(section.num_sms or "library default"),
        }

    def __init__(self, *, buffer: SharedKernelBuffer, replica_rows: _ReplicaRows | None = None, **base_kwargs):
        """``base_kwargs``: :class:`RoutedExpertParallel`'s (score_before_experts, ...)."""
        super().__init__(**base_kwargs)
        self.buffer = buffer
        self.replica_rows = replica_rows

    def _apply(self, module: torch.nn.Module, device_mesh):
        if self.replica_rows is not None:
            self.replica_rows.parameter_elements = tuple(weight[0].numel() for weight in module.parameters(recurse=False))
        return super()._apply(module, device_mesh)

    def prepare_buffer(self, x, group) -> None:
        self.buffer.get(group, x)

    def dispatch(self, x, scores, expert_ids, num_experts, group, sent_counts=None):
        from torchtitan_ext.ep.ops.deepep import deepep_dispatch

        # a pick with score 0 contributes nothing; DeepEP does not send it
        expert_ids = expert_ids.masked_fill(scores == 0, -1)
        recv_x, recv_idx, recv_weights, counts, handle = deepep_dispatch(
            x, expert_ids, scores.float(), self.buffer.get(group, x), num_experts
        )
        num_received, top_k = recv_idx.shape
        local_experts = counts.numel()
        flat_ids = recv_idx.reshape(-1)
        sort_key = torch.where(flat_ids >= 0, flat_ids, local_experts)
        pair_order = torch.argsort(sort_key, stable=True)[: int(counts.sum())]
        destinations, pad_rows, padded, total_rows = block_destinations(counts.view(1, -1), self.pad_multiple)
        placed = destinations.numel()
        # both index lists in one host-to-device copy
        destinations, pad_rows = to_device(torch.cat([destinations, pad_rows]), x.device).split(
            [placed, pad_rows.numel()])
        # received row of every group row (row 0 for a pad row, zeroed): each group row is gathered once
        group_sources = torch.zeros(total_rows, dtype=torch.int64, device=x.device).index_copy_(
            0, destinations, pair_order // top_k)
        routed = gather_into_groups(recv_x, group_sources, pad_rows)
        pair_scores = recv_weights.reshape(-1).index_select(0, pair_order)
        if self.score_before_experts:
            # pad rows stay zero: their scores are 0
            routed = scale_rows(routed, pair_scores.new_zeros(total_rows).index_copy_(0, destinations, pair_scores))
        self._pending = _DeepEPDispatchState(
            handle=handle,
            pair_order=pair_order,
            destinations=destinations,
            pair_scores=None if self.score_before_experts else pair_scores,
            num_received=num_received,
            num_tokens=x.shape[0],
            top_k=top_k,
        )
        return routed, to_device(padded, x.device)

    def combine(self, routed_output, group):
        from torchtitan_ext.ep.ops.deepep import deepep_combine

        state = self._take_pending()
        # each received token's rows summed before the library returns them to their sources
        partial_rows = sum_scored_rows(routed_output.index_select(0, state.destinations),
                                       state.pair_order // state.top_k, state.pair_scores, state.num_received)
        combined, _ = deepep_combine(partial_rows, state.handle, state.num_tokens, self.collective_name("combine"))
        return in_flight(combined)


class DeepEPPlanningProfile(PlanningProfile):
    """DeepEP as the planner prices it: each token sent once to each rank holding any of its experts, at the figures DeepEP publishes for the configured API and SM count."""

    settings_legend = "deepep legacy/elastic: its API"
    sends_each_token_once_per_rank = True
    test_log_settings = (("legacy",),)
    """tests/legacy/test_intranode.py and test_internode.py time v1's kernels."""

    @classmethod
    def kernel_nvlink_ranks(cls, job_config) -> int | None:
        """v1: 8, its kernels' NVLink peers at most (``LEGACY_NUM_MAX_NVL_PEERS`` in DeepEP main's
        csrc/kernels/legacy/compiled.cuh; not GB200's multi-node NVLink, DeepEP issue #392); V2: the machine's."""
        section = job_config.deepep
        return LEGACY_NVLINK_PEERS if resolve_api(section.api, section.implementation, None) == "legacy" else None

    @classmethod
    def advised_alternatives(cls, job_config, fabrics: tuple[str | None, ...]) -> tuple[dict[str, object], ...]:
        """The other API: v1's kernels reach 8 NVLink peers, V2's the machine's, and each has its own figures.
        V2.5 (ep) removed both others: none. Not SM counts: DeepEP's combine runs beside the shared experts
        (asynchronously), so SMs it takes slow that compute by an amount no published figure gives."""
        section = job_config.deepep
        api = resolve_api(section.api, section.implementation, None)
        if api == "ep":
            return ()
        return ({"api": "elastic" if api == "legacy" else "legacy"},)

    @classmethod
    def rate_settings(cls, job_config) -> tuple:
        """The API: v1 and V2 are different kernels."""
        section = job_config.deepep
        return (resolve_api(section.api, section.implementation, None),)

    @classmethod
    def communication_sms(cls, job_config) -> float | None:
        """``num_sms``, or v1's default 20; None for V2 and V2.5 left to compute their own minimum (at run time,
        from the bandwidths they detect)."""
        section = job_config.deepep
        if section.num_sms is not None:
            return float(section.num_sms)
        return float(LEGACY_DEFAULT_SMS) if resolve_api(section.api, section.implementation, None) == "legacy" else None

    @classmethod
    def published_rates(cls, job_config) -> tuple[PublishedRate, ...]:
        section = job_config.deepep
        api = resolve_api(section.api, section.implementation, None)
        return nearest_sms(PUBLISHED_RATES[api], section.num_sms or (LEGACY_DEFAULT_SMS if api == "legacy" else None))

    @classmethod
    def planned_replica_region(cls, job_config) -> int:
        """V2.5's load-balancing region: the replicas' weights in the compute dtype and their fp32 gradients,
        each tensor 2 MiB-aligned; none where the job moves replicas by all-to-all whatever the group (an expert
        parameter's row not a multiple of the kernels' 32 bytes, or deterministic algorithms)."""
        slots = job_config.expert_replication.slots_per_rank
        section = job_config.deepep
        if not slots or resolve_api(section.api, section.implementation, None) != "ep" or job_config.debug.deterministic:
            return 0
        element_size = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param].itemsize
        parameter_elements = routed_expert_parameter_elements(job_config)
        if any(elements * element_size % LB_ROW_ALIGNMENT for elements in parameter_elements):
            return 0
        rows = slots * sum(parameter_elements)
        return sum(-(-rows * size // LB_ALLOCATION_ALIGNMENT) * LB_ALLOCATION_ALIGNMENT for size in (element_size, 4))

    @classmethod
    def planned_buffer(cls, job_config, shape: MoEShape) -> tuple[int | None, str]:
        section = job_config.deepep
        api = resolve_api(section.api, section.implementation, None)
        if api != "legacy":
            note = (
                "ElasticBuffer (V2.5: EPBuffer) sizes itself from the NCCL communicator (get_buffer_size_hint needs "
                "the live group): the job logs its size at the first dispatch; the reference allocates none"
            )
            region = cls.planned_replica_region(job_config)
            if region:
                note += (
                    f"; where its load-balancing kernels carry the replicas, a further {region / 2**20:,.0f} MiB "
                    f"(the {job_config.expert_replication.slots_per_rank} replicas' weights and fp32 gradients, "
                    "each 2 MiB-aligned)"
                )
            return None, note
        from torchtitan_ext.ep.kernels.deep_ep import deepep_buffer_bytes

        element_size = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param].itemsize
        try:
            nvl, rdma = deepep_buffer_bytes(
                job_config.parallelism.expert_parallel_degree,
                hidden_bytes(shape.hidden_dim, element_size),
                section.num_sms,
            )
        except ImportError:
            return None, "DeepEP's size hints need deep_ep installed; the reference allocates none"
        return nvl + rdma, f"deep_ep size hints: {nvl:,} NVLink + {rdma:,} RDMA bytes"
