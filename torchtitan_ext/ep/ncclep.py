"""The ``ncclep`` backend: NCCL EP (NVIDIA's EP library, the nccl-extensions wheel), high-throughput mode.

:class:`NcclEPExpertParallel` dispatches into NCCL EP's expert-major layout, each expert's zone padded by the
library to the grouped GEMMs' row multiple (32 under MXFP8), and combines back with the library's unweighted
sum; backward runs the library's backward passes. One EP group serves every MoE layer
(:mod:`torchtitan_ext.ep.kernels.nccl_ep`). Eager mode (the default) sizes each dispatch from the library's
padded total, one host sync per layer, and drops nothing; a receive capacity factor gives the group a static
budget of slots (no host sync), beyond which the library drops slots and reports the true total, counted here as
dropped pairs. See docs/ncclep.md.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch.distributed._functional_collectives import all_to_all_single
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError, MoEShape, Range
from torchtitan_ext.ep.base import RoutedExpertParallel, scale_rows, SharedKernelBuffer, token_group_alignment, Variant
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.handle import DispatchHandle
from torchtitan_ext.ep.layout import round_up
from torchtitan_ext.ep.kernels import KernelUnavailable
from torchtitan_ext.ep.kernels import nccl_ep
from torchtitan_ext.ep.kernels import nccl_ep_double as library_limits
from torchtitan_ext.ep.planning_profile import PlanningProfile
from torchtitan_ext.ep.published_rates import PublishedRate


def receive_slots(shape: MoEShape, ep: int, factor: float | None, pad_multiple: int) -> int:
    """``max_recv_tokens_per_rank``: roundup(int(N * R * min(L, K) * factor) + L * (P - 1), P) slots, or 0 (eager
    mode) unset. At 1.0 the worst case: every token to every local expert, each zone padded."""
    if factor is None:
        return 0
    local_experts = shape.num_experts // ep
    pairs = int(shape.max_tokens_per_rank * ep * min(local_experts, shape.top_k) * factor)
    return round_up(pairs + local_experts * (pad_multiple - 1), pad_multiple)


def _create_kernels(shape: MoEShape, section, group, example: torch.Tensor, alignment: int):
    implementation = nccl_ep.resolve_implementation(section.implementation, example.device.type)
    ep = group.size()
    slots = receive_slots(shape, ep, section.max_recv_capacity_factor, alignment)
    group_shape = nccl_ep.GroupShape(
        num_experts=shape.num_experts, max_tokens_per_rank=shape.max_tokens_per_rank,
        hidden_bytes=shape.hidden_dim * example.element_size(), top_k=shape.top_k, max_recv_slots=slots,
        alignment=alignment, num_channels=section.num_channels, max_num_sms=section.max_num_sms,
        zero_copy_off=section.zero_copy == "off",
    )
    logger.info(f"NCCL EP group ({implementation}): {group_shape}")
    return nccl_ep.NcclEpKernels(implementation, group, group_shape, example.device)


@dataclass(frozen=True)
class _NcclEPDispatchState:
    handle: DispatchHandle
    row_weights: torch.Tensor | None
    """Each row's routing weight, when it multiplies the expert outputs."""


class NcclEPExpertParallel(RoutedExpertParallel):
    """EP over NCCL EP's high-throughput kernels (expert-major layout)."""

    @dataclass
    class Config:
        """``[ncclep]``: knobs of the ncclep backend (NCCL EP, installed as docs/ncclep.md#installing says)."""

        implementation: Literal["auto", "nccl_ep", "reference"] = "auto"
        """Which kernels run the calls: "nccl_ep" the library (CUDA), "reference" its double on torch.distributed
        (any device, slow), "auto" the library on CUDA and the double on CPU (never a silent fallback: on CUDA
        without the library it is an error)."""

        mode: Literal["ht", "ll"] = "ht"
        """NCCL EP's algorithm: "ht" (high-throughput, forward and backward passes: training); "ll" (low-latency)
        has no backward pass and is refused for training."""

        max_recv_capacity_factor: float | None = None
        """
        Unset: eager mode. Each dispatch reads the library's padded receive total on the host (one host sync per
        MoE layer) and sizes its output exactly: no pair is ever dropped.

        A float in (0, 1]: a static budget of M = roundup(int(N * R * min(L, K) * factor) + L * (P - 1), P)
        receive slots per rank (the group's ``max_recv_tokens_per_rank``; N tokens per rank, R = EP degree, L
        experts per rank, K = top_k, P the pad multiple, each zone's padding counted in): no host sync. 1.0 is
        the worst case and never drops. Slots at or above M are dropped by the library (``OverflowPolicy.DROP``:
        the tail of the expert-major order), counted and reported (the pairs kept are counted from one all-to-all
        of the pair counts). M must be at least N (the library's rule).
        """

        num_channels: int = 0
        """Channels per rank (each takes 2 SMs). 0: the library's choice. Integer >= 0."""

        max_num_sms: int = 0
        """Most SMs NCCL EP's kernels may use. 0: the library's default. Integer >= 0."""

        zero_copy: Literal["auto", "off", "on"] = "auto"
        """The group's ``ZeroCopyMode``: "auto" and "off" (passed as such) stage through the library's buffers; "on"
        needs the dispatch output and combine input in NCCL-registered windows, which this backend does not
        allocate: refused."""

        ranks_per_nvlink_domain: int | None = None
        """Ranks NCCL reaches over NVLink (the library's LSA team: 8 on an HGX node, up to 72 on GB200 NVL72). Read
        only by the checks of the library's limits and by the planner. Unset: min(EP degree, 8). Must divide
        expert_parallel_degree."""

    config_section = "ncclep"
    sized_by_dispatch = True
    config_ranges = {
        "ncclep.max_recv_capacity_factor": Range(0, 1, exclusive_minimum=True, meaning="static receive budget; unset: eager"),
        "ncclep.num_channels": Range(0, meaning="channels; 0: the library's choice"),
        "ncclep.max_num_sms": Range(0, meaning="SMs; 0: the library's default"),
        "ncclep.ranks_per_nvlink_domain": Range(1, meaning="ranks"),
    }

    min_pad_multiple = 8  # torchtitan's token-group alignment for grouped GEMMs, as the nccl backend pads
    shared_experts_overlap = "no: NCCL EP's high-throughput combine has no asynchronous mode (send_only is LL-only)"
    variants = {
        "ncclep": Variant(()),
        "ncclep_static": Variant(("--ncclep.max_recv_capacity_factor", "1.0"), in_matrix=False),
    }
    library_implementation = "nccl_ep"
    reference_syncs_host = True  # the double reads the routing on the host; NCCL EP's static mode does not
    ops_module = "torchtitan_ext.ep.ops.ncclep"
    saved_ops = ("_c10d_functional::all_to_all_single", "torchtitan_ext::ncclep_dispatch", "torchtitan_ext::ncclep_combine")

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        section = job_config.ncclep
        kernels = SharedKernelBuffer(partial(_create_kernels, shape, section))
        return partial(cls, kernels=kernels, shape=shape, capacity_factor=section.max_recv_capacity_factor,
                       pad_multiple=token_group_alignment(job_config))

    @classmethod
    def device_budget(cls, job_config) -> DeviceBudget:
        update = "the library's handle update (its routing exchange), dispatch and combine forward, dispatch and combine backward"
        if job_config.ncclep.max_recv_capacity_factor is not None:
            return DeviceBudget(forward=Budget(collectives=4), backward=Budget(collectives=2),
                                why=f"{update}; a static receive budget: no host sync, and the pair counts' all-to-all "
                                    "(unless the routing carries them) to count the pairs it keeps",
                                counts_exchange=Budget(collectives=1))
        return DeviceBudget(forward=Budget(host_syncs=1, collectives=3), backward=Budget(collectives=2),
                            why=f"{update}; eager mode reads the padded receive total on the host to size the dispatch")

    @classmethod
    def validate_config(cls, job_config, device_type: str | None, shape: MoEShape) -> None:
        section, parallelism = job_config.ncclep, job_config.parallelism
        ep = parallelism.expert_parallel_degree
        if section.mode == "ll":
            raise ConfigError("ncclep.mode = 'll': NCCL EP's low-latency mode has no backward pass (PassDir is "
                              "high-throughput only), so it cannot train: set ncclep.mode = 'ht'")
        if section.zero_copy == "on":
            raise ConfigError("ncclep.zero_copy = 'on' needs the dispatch output and combine input in NCCL-registered "
                              "windows, which this backend does not allocate: set ncclep.zero_copy = 'auto'")
        domain = section.ranks_per_nvlink_domain
        if domain is not None and ep % domain:
            raise ConfigError(f"ncclep.ranks_per_nvlink_domain = {domain} does not divide "
                              f"parallelism.expert_parallel_degree = {ep}: use a divisor of {ep}")
        pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
        factor = section.max_recv_capacity_factor
        if factor is not None:
            slots = receive_slots(shape, ep, factor, pad)
            if slots < shape.max_tokens_per_rank:
                raise ConfigError(
                    f"ncclep.max_recv_capacity_factor = {factor} gives {slots} receive slots per rank, fewer than the "
                    f"{shape.max_tokens_per_rank} tokens a rank dispatches; NCCL EP's high-throughput mode needs "
                    "max_recv_tokens_per_rank >= max_dispatch_tokens_per_rank: raise it (the planner, "
                    "python -m torchtitan_ext.plan, shows the slots each value gives)")
        if nccl_ep.uses_library(section.implementation, device_type):  # the double has no such limits
            cls._check_library_limits(job_config, shape)
        if device_type is not None:
            try:
                nccl_ep.resolve_implementation(section.implementation, device_type)
            except KernelUnavailable as e:
                raise ConfigError(str(e)) from None
            if nccl_ep.uses_library(section.implementation, device_type):
                cls._check_cuda_build()

    @classmethod
    def library_unavailable_reason(cls) -> str | None:
        return nccl_ep.unavailable_reason()

    @staticmethod
    def _check_library_limits(job_config, shape: MoEShape) -> None:
        """What NCCL EP 0.2.0 asserts (its process aborts) or is built for, checked from the config: the constants
        of ``nccl_ep/common.hpp`` its kernels are instantiated for, the expert-major dispatch's experts per rank,
        and the high-throughput kernels' alignment rules."""
        section = job_config.ncclep
        ep = job_config.parallelism.expert_parallel_degree
        local_experts = shape.num_experts // ep
        element = torch.empty((), dtype=getattr(torch, job_config.training.mixed_precision_param)).element_size()
        token_bytes = shape.hidden_dim * element
        domain = section.ranks_per_nvlink_domain or min(ep, 8)
        assumed = "" if section.ranks_per_nvlink_domain else " (assumed: set ncclep.ranks_per_nvlink_domain)"
        checks = (
            (shape.hidden_dim <= library_limits.MAX_HIDDEN_DIM,
             f"the model's hidden size {shape.hidden_dim} exceeds NCCL EP's MAX_HIDDEN_DIM = {library_limits.MAX_HIDDEN_DIM}: "
             "use another backend"),
            (token_bytes % library_limits.HT_TOKEN_BYTE_MULTIPLE == 0,
             f"a token row is {token_bytes} bytes (hidden {shape.hidden_dim} x {element} bytes of "
             f"training.mixed_precision_param); NCCL EP's high-throughput kernels need a multiple of "
             f"{library_limits.HT_TOKEN_BYTE_MULTIPLE}: use a hidden size that makes it one"),
            (shape.top_k <= library_limits.MAX_NUM_TOPK,
             f"the model's top_k = {shape.top_k} exceeds NCCL EP's MAX_NUM_TOPK = {library_limits.MAX_NUM_TOPK}: "
             "use another backend"),
            (shape.max_tokens_per_rank <= library_limits.MAX_SUPPORTED_TOKENS_PER_RANK,
             f"{shape.max_tokens_per_rank} tokens per rank per dispatch (training.local_batch_size x seq_len) exceed "
             f"NCCL EP's MAX_SUPPORTED_TOKENS_PER_RANK = {library_limits.MAX_SUPPORTED_TOKENS_PER_RANK}: lower "
             "local_batch_size or seq_len (or raise pipeline microbatches)"),
            (local_experts <= library_limits.LOCAL_PERMUTE_MAX_EXPERTS_PER_RANK,
             f"{local_experts} experts per rank exceed NCCL EP's expert-major dispatch limit "
             f"(kLocalPermuteMaxExpertsPerRank = {library_limits.LOCAL_PERMUTE_MAX_EXPERTS_PER_RANK}): raise "
             "parallelism.expert_parallel_degree"),
            ((local_experts * domain) % 4 == 0,
             f"{local_experts} local experts x {domain} ranks per NVLink domain{assumed} = {local_experts * domain}: "
             "NCCL EP's high-throughput dispatch needs a multiple of 4 (experts per NVLink team, 16-byte TMA copies "
             "of their probabilities); change expert_parallel_degree or ncclep.ranks_per_nvlink_domain"),
            (ep // domain <= library_limits.NUM_MAX_RDMA_PEERS,
             f"parallelism.expert_parallel_degree = {ep} spans {ep // domain} NVLink domains of {domain} ranks"
             f"{assumed}; NCCL EP reaches at most NUM_MAX_RDMA_PEERS = {library_limits.NUM_MAX_RDMA_PEERS} over RDMA: "
             "lower the EP degree"),
        )
        for holds, message in checks:
            if not holds:
                raise ConfigError(message)

    @staticmethod
    def _check_cuda_build() -> None:
        """This machine runs the library: a CUDA major the wheel ships a build for."""
        major = int((torch.version.cuda or "0").split(".")[0])
        if major not in nccl_ep.CUDA_MAJORS:
            raise ConfigError(
                f"torch is built for CUDA {torch.version.cuda}; nccl-extensions ships NCCL EP for CUDA "
                f"{' and '.join(map(str, nccl_ep.CUDA_MAJORS))} only: install a torch built for one of them, or set "
                "ncclep.implementation = 'reference'")

    @classmethod
    def drop_remedy(cls, job_config) -> str:
        factor = job_config.ncclep.max_recv_capacity_factor
        return (f"raise ncclep.max_recv_capacity_factor (now {factor}; the planner, python -m torchtitan_ext.plan, "
                "shows the slots each value gives), or unset it for eager (dropless) mode")

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        section = job_config.ncclep
        ep = job_config.parallelism.expert_parallel_degree
        pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
        factor = section.max_recv_capacity_factor
        if factor is None:
            mode = "eager (one host sync per MoE layer, dropless)"
        else:
            mode = (f"static receive budget, capacity factor {factor}: {receive_slots(shape, ep, factor, pad):,} slots "
                    "per rank; slots beyond are dropped and counted")
        implementation = {"auto": "auto (NCCL EP on CUDA, its double on CPU)"}.get(section.implementation,
                                                                                 section.implementation)
        return {
            **super().describe(job_config, shape),
            "kernels": implementation,
            "mode": f"high-throughput, expert-major; {mode}",
            "SMs": f"channels {section.num_channels or 'auto'}, max SMs {section.max_num_sms or 'auto'}",
        }

    def __init__(self, *, kernels: SharedKernelBuffer, shape: MoEShape, capacity_factor: float | None,
                 **base_kwargs):
        """``shape``: what the group is created for; ``capacity_factor``: None for eager mode, else the static
        budget's (:func:`receive_slots`). ``base_kwargs``: :class:`RoutedExpertParallel`'s."""
        super().__init__(**base_kwargs)
        self.kernels = kernels
        self.shape = shape
        self.max_tokens_per_rank = shape.max_tokens_per_rank
        self.capacity_factor = capacity_factor

    def dispatch(self, x, scores, expert_ids, num_experts, group, sent_counts=None):
        from torchtitan_ext.ep.ops.ncclep import ncclep_dispatch

        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(
                f"NCCL EP got {x.shape[0]} tokens on this rank, more than the {self.max_tokens_per_rank} its group was "
                "created for (a microbatch's tokens per rank, from training.local_batch_size and seq_len)")
        static_slots = receive_slots(self.shape, group.size(), self.capacity_factor, self.pad_multiple)
        if static_slots and self.stats.counting:  # an evaluation forward counts nothing: no counts to exchange
            self.stats.record_kept(self._kept_pairs(expert_ids, num_experts, group, sent_counts, static_slots))
        kernels = self.kernels.get(group, x, self.pad_multiple)
        if kernels.value.shape.alignment != self.pad_multiple:
            raise ValueError(f"{self.layer_name} pads expert groups to {self.pad_multiple} rows, but the NCCL EP group "
                             f"all MoE layers share zones of {kernels.value.shape.alignment}: every layer must pad alike")
        rows, row_weights, rows_per_expert, handle = ncclep_dispatch(
            x, expert_ids, scores.float(), kernels, static_slots or -1,
        )
        if self.score_before_experts:
            rows = scale_rows(rows, row_weights)
        self._pending = _NcclEPDispatchState(handle, None if self.score_before_experts else row_weights)
        return rows, rows_per_expert

    def _kept_pairs(self, expert_ids, num_experts: int, group, sent_counts, budget: int) -> torch.Tensor:
        """[1]: the pairs this rank's experts keep under a static budget, on the device. The library drops the slots
        at or above the budget in its expert-major order, zones starting at the prefix sums of the padded counts
        (``scan_kernel.cuh``), so local expert e keeps min(c_e, budget - start_e) of its c_e pairs. The counts take
        one all-to-all of the pair counts, none where the routing carries them (expert replication's split)."""
        ep_degree = group.size()
        local_experts = num_experts // ep_degree
        with torch.no_grad():
            if sent_counts is None:
                flat = expert_ids.reshape(-1)
                send = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
                send.scatter_add_(0, flat, torch.ones_like(flat))
                received = all_to_all_single(send, None, None, group=group.group_name).view(ep_degree, local_experts)
            else:
                first = group.rank() * local_experts
                received = sent_counts[:, first:first + local_experts]
            counts = received.sum(0)
            padded = round_up(counts, self.pad_multiple)
            starts = torch.cumsum(padded, 0) - padded
            return torch.minimum(counts, (budget - starts).clamp(min=0)).sum().view(1)

    def combine(self, routed_output, group):
        from torchtitan_ext.ep.ops.ncclep import ncclep_combine

        state = self._take_pending()
        if state.row_weights is not None:
            routed_output = scale_rows(routed_output, state.row_weights)
        return ncclep_combine(routed_output, state.handle)


class NcclEPPlanningProfile(PlanningProfile):
    """NCCL EP as the planner prices it: each token sent once to each rank holding any of its experts (the
    high-throughput kernels' per-rank dispatch). NVIDIA publishes no dispatch/combine bandwidth for NCCL EP 0.1.0
    (NVIDIA/nccl #2222 gives none), so its all-to-all is priced at each link's nominal rate: a bound, shown as a
    range, until a figure is published or measured (``--calibrate-from`` a ``bench ep`` sweep)."""

    sends_each_token_once_per_rank = True

    @classmethod
    def nvlink_domain_ranks(cls, job_config) -> int | None:
        return job_config.ncclep.ranks_per_nvlink_domain

    @classmethod
    def communication_sms(cls, job_config) -> float | None:
        """``max_num_sms`` or 2 per channel where set; None (the library's choice, not priced) otherwise."""
        section = job_config.ncclep
        return float(section.max_num_sms or 2 * section.num_channels) or None

    @classmethod
    def rate_settings(cls, job_config) -> tuple:
        """The mode: eager dispatch waits for its total on the host, a static budget does not."""
        return ("eager" if job_config.ncclep.max_recv_capacity_factor is None else "static",)

    @classmethod
    def published_rates(cls, job_config) -> tuple[PublishedRate, ...]:
        return ()

    @classmethod
    def planned_modes(cls, job_config, shape: MoEShape, pad_multiple: int) -> list[tuple[str, int | None]]:
        factor = job_config.ncclep.max_recv_capacity_factor
        modes = [("eager", None)]
        if factor is not None:
            ep = job_config.parallelism.expert_parallel_degree
            modes.append((f"static (capacity factor {factor})", receive_slots(shape, ep, factor, pad_multiple)))
        return modes

    @classmethod
    def planned_buffer(cls, job_config, shape: MoEShape) -> tuple[int | None, str]:
        """The library's high-throughput staging buffer: one token row per receive slot of its budget, in eager
        mode the worst case R x N x max(K, 1) slots (ncclEpCreateGroup's own sizing, as its allocation error
        states)."""
        ep = job_config.parallelism.expert_parallel_degree
        pad = max(token_group_alignment(job_config), NcclEPExpertParallel.min_pad_multiple)
        factor = job_config.ncclep.max_recv_capacity_factor
        slots = receive_slots(shape, ep, factor, pad) or ep * shape.max_tokens_per_rank * max(shape.top_k, 1)
        element = torch.empty((), dtype=getattr(torch, job_config.training.mixed_precision_param)).element_size()
        budget = "the static budget" if factor is not None else "eager mode's worst case, R x N x K"
        return slots * shape.hidden_dim * element, (f"NCCL EP's staging buffer: {slots:,} receive slots ({budget}) "
                                                    "of one token row; its other buffers are not counted")
