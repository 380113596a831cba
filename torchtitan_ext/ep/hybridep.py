"""The ``hybridep`` backend: DeepEP's HybridEP kernels, permute fused into dispatch.

:class:`HybridEPExpertParallel` calls ``dispatch_with_permute`` and ``combine_with_unpermute`` on one
buffer that serves every MoE layer (the real ``deep_ep.HybridEPBuffer`` or the reference,
``[hybridep] implementation``), sized once from the config and created at the first dispatch. Blocking
mode is dropless and syncs with the host once per layer; non-blocking mode sizes its output from the
config (:func:`non_blocking_rows`), never syncs, and drops the pairs that do not fit, each rank counting
the pairs its experts kept on the device (``stats.kept_pairs``).
See docs/backends.md, "`[hybridep]`" and "Blocking and non-blocking HybridEP".
"""

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError, MoEShape, overlaps_expert_parallel, Range
from torchtitan_ext.ep.base import (
    check_kernels,
    RoutedExpertParallel,
    scale_rows,
    SharedKernelBuffer,
    token_group_alignment,
    Variant,
)
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.handle import DispatchHandle
from torchtitan_ext.ep.kernels import implementation_description as _implementation_description
from torchtitan_ext.ep.kernels import resolve_implementation, uses_library
from torchtitan_ext.ep.kernels.prerequisites import check_hybridep_jit, PrerequisiteMissing
from torchtitan_ext.ep.layout import round_up
from torchtitan_ext.ep.planning_profile import PlanningProfile
from torchtitan_ext.ep.published_rates import nearest_sms, PublishedRate


LIBRARY_TOKEN_CHUNK = 64
"""Tokens per chunk of HybridEP's dispatch (its NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API default)."""


def non_blocking_rows(
    num_tokens: int, ep_degree: int, local_experts: int, top_k: int,
    capacity_factor: float, pad_multiple: int,
) -> int:
    """Rows of a non-blocking dispatch: roundup(int(N * R * min(L, K) * factor), P)."""
    return round_up(int(num_tokens * ep_degree * min(local_experts, top_k) * capacity_factor), pad_multiple)


def library_environment(section) -> dict[str, str]:
    """The environment variables ``[hybridep]`` sets for the library."""
    environment = {}
    if section.ranks_per_nvlink_domain is not None:
        environment["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] = str(section.ranks_per_nvlink_domain)
    if section.use_mnnvl is not None:
        environment["USE_MNNVL"] = "1" if section.use_mnnvl else "0"
    return environment


def _create_buffer(shape: MoEShape, section, group, example: torch.Tensor):
    implementation = resolve_implementation("hybridep", section.implementation, example.device.type, "HybridEPBuffer")
    if implementation == "deep_ep" and example.dtype != torch.bfloat16:
        # without FP8 the library reads tokens as 16-bit words: fp32 would be misread, not refused
        raise TypeError(
            f"HybridEP's kernels take bf16 tokens only, not {example.dtype}: "
            "set training.mixed_precision_param = 'bfloat16' (or hybridep.implementation = 'reference')"
        )
    environment = library_environment(section)
    local_experts = shape.num_experts // group.size()
    logger.info(
        f"HybridEP buffer ({implementation}): hidden {shape.hidden_dim}, "
        f"{shape.max_tokens_per_rank} tokens/rank, {local_experts} local experts, "
        f"environment {environment or 'unchanged'}"
    )
    if implementation == "deep_ep":
        from torchtitan_ext.ep.kernels.deep_ep import LibraryHybridEPBuffer

        return LibraryHybridEPBuffer(
            group, shape.hidden_dim, shape.max_tokens_per_rank, local_experts,
            section.num_sms_dispatch, section.num_sms_combine, environment,
        )
    from torchtitan_ext.ep.kernels.reference import ReferenceHybridEPBuffer

    os.environ.update(environment)
    return ReferenceHybridEPBuffer(
        group, shape.hidden_dim, shape.max_tokens_per_rank, local_experts,
        dtype=example.dtype, device=example.device,
    )


@dataclass(frozen=True)
class _HybridEPDispatchState:
    handle: DispatchHandle
    row_probs: torch.Tensor | None
    """Probs of the rows, when they multiply the expert outputs."""
    num_tokens: int


PUBLISHED_RATES = (
    *(PublishedRate("mnnvl", dispatch, combine, 900.0, 32, sms,
                    f"docs/published_ep_figures.md 4c: HybridEP on GB200 NVL72, 32 ranks, {sms} SMs, BF16, Torch API "
                    "(DeepEP hybrid-ep branch docs/README_Hybrid-EP.md)")
      for sms, dispatch, combine in ((16, 485.50, 423.19), (32, 484.22, 464.54))),
    *(PublishedRate("nvlink", dispatch, combine, 450.0, 8, sms,
                    f"docs/published_ep_figures.md {row}: HybridEP on DGX H100 (8 GPUs), {sms} CUDA blocks "
                    "(Megatron-LM's DeepSeek-V3 GB200 guide, figure 6)")
      for row, sms, dispatch, combine in (("4d.5", 4, 177.76, 191.24), ("4d.6", 8, 344.06, 358.93),
                                          ("4d.7", 12, 349.29, 363.05), ("4d.8", 16, 368.9, 368.87))),
    # the NIC's bus bandwidth, as the same figure prints it beside the algorithm bandwidth
    *(PublishedRate("rdma", dispatch, combine, 50.0, None, sms,
                    f"docs/published_ep_figures.md {row}: HybridEP on 4 x DGX H100, NIC bus bandwidth, {sms} CUDA "
                    "blocks (Megatron-LM's DeepSeek-V3 GB200 guide, figure 6; 400 Gbit/s NICs assumed)")
      for row, sms, dispatch, combine in (("4d.9", 2, 24.4, 20.8), ("4d.10", 4, 43.4, 42.7), ("4d.11", 8, 44.2, 45.0))),
)
"""The figures HybridEP's authors publish for its kernels, per link and SM count."""


class HybridEPExpertParallel(RoutedExpertParallel):
    """EP over HybridEP kernels (blocking or non-blocking)."""

    @dataclass
    class Config:
        """``[hybridep]``: knobs of the hybridep backend."""

        implementation: Literal["auto", "deep_ep", "reference"] = "auto"
        """Which kernels run the HybridEP calls; same meaning as in [deepep]."""

        non_blocking_capacity_factor: float | None = None
        """
        Unset: blocking mode. Dispatch waits for the device once per MoE layer to
        learn how many rows each expert receives and sizes its output exactly:
        no token is ever dropped.

        A float in (0, 1]: non-blocking mode. No host sync; dispatch writes into
        M = roundup(int(N * R * min(L, K) * factor), P) rows, with N tokens per rank
        before dispatch, R = EP degree, L = experts per rank, K = top_k and P the pad
        multiple. 1.0 is the worst case when P = 1 (every token to every local expert);
        smaller factors save memory. When the padded layout needs more than M rows,
        the (token, expert) pairs whose row would be >= M are dropped, from the tail
        (highest local expert first, latest source rank and token first); they add
        nothing to the output, the overflow flag is set and they are counted and reported.
        With P > 1 even 1.0 can drop: padding adds up to L * (P - 1) rows. A factor
        that leaves M = 0 rows is refused.
        """

        num_sms_dispatch: int = 16
        """SMs given to the dispatch kernels (library constructor argument). Integer >= 1."""

        num_sms_combine: int = 16
        """SMs given to the combine kernels (library constructor argument). Integer >= 1."""

        ranks_per_nvlink_domain: int | None = None
        """
        Ranks that share one NVLink domain; exported as
        NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN before the buffer is created. Must
        divide expert_parallel_degree. Unset lets the library count the
        peer-accessible GPUs (8 on an HGX node). GB200 NVL72: 64 (or the EP degree
        when smaller), so that all-to-all stays on NVLink.
        """

        use_mnnvl: bool | None = None
        """
        Multi-node NVLink (the NVL72 fabric). false exports USE_MNNVL=0, which
        disables cross-node NVLink memory; true exports USE_MNNVL=1 (the library
        then uses the fabric where the driver offers it). Unset leaves the
        environment untouched.
        """

        multinode_build: bool = False
        """
        Whether deep_ep was built with HYBRID_EP_MULTINODE=1. An EP group larger than
        one NVLink domain needs that build (without it the library aborts the process
        when the buffer is created), so such a job is refused unless this says so.
        """

    config_section = "hybridep"
    sized_by_dispatch = True
    config_ranges = {
        "hybridep.non_blocking_capacity_factor": Range(0, 1, exclusive_minimum=True, meaning="non-blocking mode; unset: blocking"),
        "hybridep.num_sms_dispatch": Range(1, meaning="SMs"),
        "hybridep.num_sms_combine": Range(1, meaning="SMs"),
        "hybridep.ranks_per_nvlink_domain": Range(1, meaning="ranks"),
    }

    shared_experts_overlap = "no: HybridEP's combine_with_unpermute has no asynchronous mode"
    # a capacity factor of 1.0 without padding cannot drop (every token to every local expert fits); with padding it can
    variants = {
        "hybridep": Variant((), "HybridEPBuffer"),
        "hybridep_non_blocking": Variant(("--hybridep.non_blocking_capacity_factor", "1.0"), "HybridEPBuffer",
                                         may_drop_when_padded=True),
    }
    library_implementation = "deep_ep"
    ops_module = "torchtitan_ext.ep.ops.hybridep"
    saved_ops = ("torchtitan_ext::hybridep_dispatch", "torchtitan_ext::hybridep_combine")

    @classmethod
    def layer_factory(cls, job_config, shape: MoEShape):
        section = job_config.hybridep
        buffer = SharedKernelBuffer(partial(_create_buffer, shape, section))
        return partial(
            cls,
            buffer=buffer,
            max_tokens_per_rank=shape.max_tokens_per_rank,
            capacity_factor=section.non_blocking_capacity_factor,
            pad_multiple=token_group_alignment(job_config),
        )

    @classmethod
    def device_budget(cls, job_config) -> DeviceBudget:
        if job_config.hybridep.non_blocking_capacity_factor is not None:
            return DeviceBudget(
                forward=Budget(collectives=2), backward=Budget(collectives=2),
                why="the library's dispatch and combine each pass (a cached dispatch in backward), no host sync",
            )
        return DeviceBudget(
            forward=Budget(host_syncs=1, collectives=2, h2d_copies=1), backward=Budget(collectives=2),
            why="the library's dispatch and combine each pass; blocking dispatch syncs to size its output and "
                "returns the rows per expert in pinned host memory, copied to the device",
        )

    @classmethod
    def validate_config(cls, job_config, device_type: str | None, shape: MoEShape) -> None:
        section, parallelism = job_config.hybridep, job_config.parallelism
        factor = section.non_blocking_capacity_factor
        domain, ep = section.ranks_per_nvlink_domain, parallelism.expert_parallel_degree
        if domain is not None and ep % domain:
            raise ConfigError(
                f"hybridep.ranks_per_nvlink_domain = {domain} does not divide "
                f"parallelism.expert_parallel_degree = {ep}: use a divisor of {ep}"
            )
        if factor is not None:
            pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
            rows = non_blocking_rows(shape.max_tokens_per_rank, ep, shape.num_experts // ep, shape.top_k, factor, pad)
            if rows == 0:
                raise ConfigError(
                    f"hybridep.non_blocking_capacity_factor = {factor} leaves 0 rows per dispatch "
                    f"(N={shape.max_tokens_per_rank} x R={ep} x min(L={shape.num_experts // ep}, K={shape.top_k}) "
                    f"x {factor} < 1): every token would be dropped; raise it (the planner, "
                    "python -m torchtitan_ext.plan, shows the rows each value gives)"
                )
        if factor is not None and overlaps_expert_parallel(parallelism):
            raise ConfigError(
                "non-blocking HybridEP cannot serve pipeline_parallel_schedule = 'DualPipeV' with "
                "pipeline_parallel_expert_parallel_overlap: the overlapped microbatch would launch its "
                "dispatch or combine while the other's is still running in HybridEP's one shared buffer "
                "(blocking mode waits for each). Set pipeline_parallel_expert_parallel_overlap = false, "
                "unset hybridep.non_blocking_capacity_factor, or use another schedule"
            )
        check_kernels("hybridep", section.implementation, device_type, "HybridEPBuffer")
        if uses_library(section.implementation, device_type):
            cls._check_library_limits(job_config, shape)
            if device_type is not None:  # this machine runs the job: its compiler is the one used
                try:
                    check_hybridep_jit()
                except PrerequisiteMissing as e:
                    raise ConfigError(str(e)) from None

    @classmethod
    def kernels_take_bf16_tokens_only(cls, job_config, device_type: str | None) -> bool:
        return uses_library(job_config.hybridep.implementation, device_type)

    @staticmethod
    def _check_library_limits(job_config, shape: MoEShape) -> None:
        """What the library asserts when it builds its buffer or dispatches, checked from the config."""
        section = job_config.hybridep
        dtype = job_config.training.mixed_precision_param
        if dtype != "bfloat16":
            raise ConfigError(
                f"training.mixed_precision_param = '{dtype}', but HybridEP reads tokens as bf16 (fp32 would be "
                "misread; hybridep.implementation resolves to deep_ep): set it to 'bfloat16', "
                "or hybridep.implementation = 'reference'"
            )
        if shape.hidden_dim % 16:
            raise ConfigError(f"the model's hidden size {shape.hidden_dim}: HybridEP needs a multiple of 16")
        ep = job_config.parallelism.expert_parallel_degree
        domain = section.ranks_per_nvlink_domain or min(ep, 8)
        assumed = "" if section.ranks_per_nvlink_domain else " (assumed: set hybridep.ranks_per_nvlink_domain)"
        local_experts = shape.num_experts // ep
        if (local_experts * domain) % 4:
            raise ConfigError(
                f"{local_experts} local experts x {domain} ranks per NVLink domain{assumed} = "
                f"{local_experts * domain}: HybridEP needs a multiple of 4; change expert_parallel_degree "
                "or ranks_per_nvlink_domain"
            )
        chunk = LIBRARY_TOKEN_CHUNK
        remainder = shape.max_tokens_per_rank % chunk
        if remainder and (remainder * domain) % 4:
            raise ConfigError(
                f"{shape.max_tokens_per_rank} tokens per rank per dispatch leave {remainder} in the last chunk of "
                f"{chunk}; with {domain} ranks per NVLink domain{assumed} HybridEP's TMA copies need "
                f"(that remainder x ranks) % 4 == 0: make local_batch_size x seq_len a multiple of {chunk}"
            )
        if ep > domain and not section.multinode_build:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} spans {ep // domain} NVLink domains of {domain} ranks"
                f"{assumed}: that needs deep_ep built with HYBRID_EP_MULTINODE=1 (docs/backends.md); "
                "with such a build set hybridep.multinode_build = true"
            )

    @classmethod
    def library_environment(cls, job_config) -> dict[str, str]:
        return library_environment(job_config.hybridep)

    @classmethod
    def drop_remedy(cls, job_config) -> str:
        factor = job_config.hybridep.non_blocking_capacity_factor
        return (
            f"raise hybridep.non_blocking_capacity_factor (now {factor}; the planner, "
            "python -m torchtitan_ext.plan, shows the rows each value gives), "
            "or unset it for blocking (dropless) mode"
        )

    @classmethod
    def describe(cls, job_config, shape: MoEShape) -> dict[str, str]:
        section = job_config.hybridep
        ep = job_config.parallelism.expert_parallel_degree
        pad = max(token_group_alignment(job_config), cls.min_pad_multiple)
        factor = section.non_blocking_capacity_factor
        if factor is None:
            mode = "blocking (one host sync per MoE layer, dropless)"
        else:
            rows = non_blocking_rows(
                shape.max_tokens_per_rank, ep, shape.num_experts // ep, shape.top_k, factor, pad
            )
            mode = (
                f"non-blocking, capacity factor {factor}: {rows:,} rows per dispatch "
                f"(N={shape.max_tokens_per_rank} x R={ep} x min(L={shape.num_experts // ep}, "
                f"K={shape.top_k}) x {factor}, padded to {pad}); pairs beyond are dropped and counted"
            )
        return {
            **super().describe(job_config, shape),
            "kernels": _implementation_description(section.implementation),
            "mode": mode,
            "SMs": f"dispatch {section.num_sms_dispatch}, combine {section.num_sms_combine}",
            "environment": " ".join(f"{k}={v}" for k, v in library_environment(section).items()) or "unchanged",
        }

    def __init__(
        self, *, buffer: SharedKernelBuffer, max_tokens_per_rank: int,
        capacity_factor: float | None = None, **base_kwargs,
    ):
        """``max_tokens_per_rank``: the tokens every rank passes to the library (fewer are
        padded with unrouted rows); ``capacity_factor``: None for blocking mode, else
        non-blocking with :func:`non_blocking_rows` rows. ``base_kwargs``: :class:`RoutedExpertParallel`'s."""
        super().__init__(**base_kwargs)
        self.buffer = buffer
        self.max_tokens_per_rank = max_tokens_per_rank
        self.capacity_factor = capacity_factor

    def dispatch(self, x, scores, expert_ids, num_experts, group, sent_counts=None):
        from torchtitan_ext.ep.ops.hybridep import hybridep_dispatch

        num_tokens, top_k = expert_ids.shape
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"HybridEP got {num_tokens} tokens on this rank, more than the {self.max_tokens_per_rank} "
                "its buffer was sized for (a microbatch's tokens per rank, from training.local_batch_size and "
                "seq_len): every rank must pass the same count to the library"
            )
        ep_degree = group.size()
        num_rows = -1
        if self.capacity_factor is not None:
            num_rows = non_blocking_rows(
                self.max_tokens_per_rank, ep_degree, num_experts // ep_degree, top_k,
                self.capacity_factor, self.pad_multiple,
            )
        rows, row_probs, tokens_per_expert, kept_per_expert, handle = hybridep_dispatch(
            x, expert_ids, scores.float(), self.buffer.get(group, x),
            num_experts, num_experts // ep_degree, num_rows, self.pad_multiple, self.max_tokens_per_rank,
        )
        self.stats.record_kept(kept_per_expert)
        if self.score_before_experts:
            rows = scale_rows(rows, row_probs)
        self._pending = _HybridEPDispatchState(
            handle=handle, row_probs=None if self.score_before_experts else row_probs, num_tokens=num_tokens
        )
        return rows, tokens_per_expert

    def combine(self, routed_output, group):
        from torchtitan_ext.ep.ops.hybridep import hybridep_combine

        state = self._take_pending()
        if state.row_probs is not None:
            routed_output = scale_rows(routed_output, state.row_probs)
        return hybridep_combine(routed_output, state.handle, state.num_tokens)


class HybridEPPlanningProfile(PlanningProfile):
    """HybridEP as the planner prices it: each token sent once to each rank holding any of its experts, at the figures NVIDIA publishes for its SM counts."""

    settings_legend = "hybridep D/C: its dispatch/combine SMs"
    sends_each_token_once_per_rank = True
    test_log_settings = (("blocking",), ("non-blocking",))
    """tests/test_hybrid_ep.py times the kernels both modes run."""

    @classmethod
    def counted_settings(cls, job_config, shape: MoEShape, ep: int) -> dict[str, object]:
        factor = job_config.hybridep.non_blocking_capacity_factor
        if factor is None:
            return {}
        # non_blocking_rows: N x R x min(L, K) x factor rows at EP = R, N x K x factor in a group of one
        local_experts = shape.num_experts // ep
        return {"non_blocking_capacity_factor": factor * ep * min(local_experts, shape.top_k) / shape.top_k}

    @classmethod
    def traffic_settings(cls, section) -> object:
        """The implementation and the mode (with its capacity factor): the SM counts, the NVLink domain and the
        build's options reach only the library's kernels."""
        return section.implementation, section.non_blocking_capacity_factor

    @classmethod
    def nvlink_domain_ranks(cls, job_config) -> int | None:
        return job_config.hybridep.ranks_per_nvlink_domain

    @classmethod
    def advised_alternatives(cls, job_config, fabrics: tuple[str | None, ...]) -> tuple[dict[str, object], ...]:
        """Where the all-to-all crosses one kind of link: the published SM counts whose figures there are the
        fastest, dispatch's and combine's each, where the job's counts are priced at slower ones (a count
        whose figure is already the fastest stays). More SMs cost compute only where something runs beside
        HybridEP's kernels (its combine has no asynchronous mode, so the shared experts wait for it): the other
        microbatch under DualPipeV's overlapped EP, where the SMs are priced and no alternative is offered. Over two kinds of link, which one bounds the all-to-all depends on its bytes per link, so
        none is offered either. Not blocking against non-blocking: no published figure separates their speed
        (the planner gives a capacity factor's drops from recorded routing)."""
        if len(set(fabrics)) != 1 or overlaps_expert_parallel(job_config.parallelism):
            return ()
        (fabric,) = set(fabrics)
        figures = [rate for rate in PUBLISHED_RATES if rate.fabric == fabric and rate.sms is not None]
        if not figures:
            return ()
        fastest_dispatch = max(figures, key=lambda rate: (rate.dispatch_GBps, -rate.sms))
        fastest_combine = max(figures, key=lambda rate: (rate.combine_GBps, -rate.sms))
        priced = next(rate for rate in cls.published_rates(job_config) if rate.fabric == fabric)
        section = job_config.hybridep
        dispatch_sms = section.num_sms_dispatch if priced.dispatch_GBps == fastest_dispatch.dispatch_GBps else fastest_dispatch.sms
        combine_sms = section.num_sms_combine if priced.combine_GBps == fastest_combine.combine_GBps else fastest_combine.sms
        if (dispatch_sms, combine_sms) == (section.num_sms_dispatch, section.num_sms_combine):
            return ()
        return ({"num_sms_dispatch": dispatch_sms, "num_sms_combine": combine_sms},)

    @classmethod
    def communication_sms(cls, job_config) -> float | None:
        """The mean of dispatch's and combine's SMs (each runs in half the all-to-alls)."""
        section = job_config.hybridep
        return (section.num_sms_dispatch + section.num_sms_combine) / 2

    @classmethod
    def settings_label(cls, settings: dict[str, object]) -> str:
        """Dispatch/combine SMs: "16/32"."""
        return f"{settings['num_sms_dispatch']}/{settings['num_sms_combine']}"

    @classmethod
    def rate_settings(cls, job_config) -> tuple:
        """The mode: non-blocking dispatch skips the host sync blocking dispatch waits for."""
        return ("blocking" if job_config.hybridep.non_blocking_capacity_factor is None else "non-blocking",)

    @classmethod
    def published_rates(cls, job_config) -> tuple[PublishedRate, ...]:
        """Dispatch's figure at the dispatch SMs, combine's at the combine SMs."""
        section = job_config.hybridep
        combine = {rate.fabric: rate for rate in nearest_sms(PUBLISHED_RATES, section.num_sms_combine)}
        rates = []
        for rate in nearest_sms(PUBLISHED_RATES, section.num_sms_dispatch):
            other = combine[rate.fabric]
            if other is not rate:
                rate = replace(rate, combine_GBps=other.combine_GBps, source=f"dispatch: {rate.source}; combine: {other.source}")
            rates.append(rate)
        return tuple(rates)

    @classmethod
    def planned_modes(cls, job_config, shape: MoEShape, pad_multiple: int) -> list[tuple[str, int | None]]:
        factor = job_config.hybridep.non_blocking_capacity_factor
        modes = [("blocking", None)]
        if factor is not None:
            ep = job_config.parallelism.expert_parallel_degree
            rows = non_blocking_rows(shape.max_tokens_per_rank, ep, shape.num_experts // ep, shape.top_k, factor, pad_multiple)
            modes.append((f"non-blocking (capacity factor {factor})", rows))
        return modes

    @classmethod
    def planned_buffer(cls, job_config, shape: MoEShape) -> tuple[int | None, str]:
        from torchtitan_ext.ep.kernels.reference import ReferenceHybridEPBuffer

        ep = job_config.parallelism.expert_parallel_degree
        size = ReferenceHybridEPBuffer.buffer_bytes(
            ep, shape.hidden_dim, shape.max_tokens_per_rank, shape.num_experts // ep,
            TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
        )
        return size, "reference kernels' allocation (R*N token rows + routing map + probs); deep_ep's is internal"
