"""Which EP backend and EP layout a job should use on a topology, and why.

:func:`advise` prices every backend at every (EP degree, expert-FSDP degree) the job can run at its world
size, and at each replica slot count to price: the MoE communication per step and the part the step waits
for (:mod:`.cost_model`), the backend's local work, the busiest rank's expert compute above the mean and
the replicas' traffic (:mod:`.replica_cost`), and the per-rank memory; it ranks the layouts by predicted
step. A layout the job config's own validation refuses is listed with the reason, never ranked.
:func:`format_advice` prints the table. See docs/planning.md, "Which backend and EP layout: the layout
advisor".
"""

import copy
import re
import textwrap
from dataclasses import dataclass, replace

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import (
    comm_backend, ConfigError, load_job_config, meta_model, model_args_of, MoEShape, validate,
)
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.ep.replication import dispatched_shape
from torchtitan_ext.planning.cost_model import (
    DataParallelSync,
    eq3_a2a_volume,
    eq4_ag_volume,
    layer_costs,
    LayerCosts,
    MeasuredRouting,
    MoEWorkload,
    optimal_p,
    p_of_domain_size,
    pair_counts,
    PaperSetting,
    token_reach,
)
from torchtitan_ext.planning.local_traffic import count_local_traffic, LocalTraffic
from torchtitan_ext.planning.measured_compute import MeasuredCompute
from torchtitan_ext.planning.measured_rates import MeasuredRate
from torchtitan_ext.planning.memory_plan import replica_copies_alive, saved_moe_layers
from torchtitan_ext.planning.replica_cost import check_replayable, replay, replica_traffic, ReplicaReplay
from torchtitan_ext.planning.topology import Topology


@dataclass(frozen=True)
class JobShape:
    """What the cost model needs from a job, for one rank and step."""

    work: MoEWorkload
    moe_layers: int
    """MoE layers in the model (every rank runs each, no pipeline split assumed)."""
    recomputed_layers: int
    """MoE layers whose forward activation checkpointing recomputes in backward, collectives
    included (those whose dispatched rows are not saved)."""
    dispatches: int
    """MoE calls per layer and step: gradient-accumulation steps x pipeline microbatches."""
    pass_flops: float
    """FLOPs of one forward-backward pass of one rank's microbatch: torchtitan's count (6 x active
    parameters + attention)."""
    expert_world: int
    """Ranks the experts are spread over: EP degree x expert-FSDP degree."""
    data_parallel_sync: DataParallelSync
    """FSDP's traffic outside the routed experts and HSDP's across replicas (the same at every EP layout)."""
    parameter_share: float
    """The fraction of the model's parameters one rank holds and steps (FSDP and EP shard them all), in
    (0, 1]."""
    expert_flop_share: float
    """The routed experts' share of a pass's FLOPs, in [0, 1): the part of the compute that an EP rank's
    load scales."""
    replica_copies: tuple[int, int] = (0, 0)
    """Under expert replication, :func:`~torchtitan_ext.planning.memory_plan.replica_copies_alive`."""

    @property
    def recompute_factor(self) -> float:
        """Forward-backward passes' cost with activation checkpointing over without (a recomputed
        forward: a third of a pass, counted for the recomputed share of the MoE layers), in [1, 4/3]."""
        return 1 + self.recomputed_layers / self.moe_layers / 3

    @property
    def step_flops(self) -> float:
        """FLOPs of one rank's step: every MoE call's pass, plus the recomputed forwards' share."""
        return self.pass_flops * self.dispatches * self.recompute_factor


@dataclass(frozen=True)
class Layout:
    backend: str
    ep: int
    efsdp: int
    refused: str | None
    """The job config's validation error for this layout; None when it runs."""
    costs: LayerCosts | None = None
    moe_layers: int = 0
    recomputed_layers: int = 0
    dispatches: int = 1
    compute_s: float = 0.0
    dispatch_work_s: float = 0.0
    """The backend's local work per MoE call (dispatch and combine, forward and backward, without the
    collectives and library kernels): measured on this machine under a measured compute (0 at EP = 1, where the
    measured step holds torchtitan's own sort); else its counted passes over the token rows
    (``local_traffic``, torchtitan's sort at EP = 1) at the topology's memory bandwidth; 0 without either."""
    dispatch_forward_share: float = 0.5
    """The forward's part of ``dispatch_work_s``, which a recomputed layer runs again (a half where only the
    whole call is timed)."""
    local_traffic: LocalTraffic | None = None
    """The bytes one MoE call moves outside the kernels as counted in a group of one (:mod:`.local_traffic`), when
    they price the local work."""
    received_tokens: float = 1.0
    """Token vectors the mean rank holds per token it sends: for a backend that sends each token once per rank,
    the EP ranks one token reaches (uniform routing); 1 otherwise."""
    data_parallel_s: float = 0.0
    """Data parallelism's traffic outside the routed experts' FSDP, per step (:class:`DataParallelSync`)."""
    overlap: bool = True
    gathered_expert_bytes: int = 0
    """Experts one layer's all-gather materialises on this rank (transient)."""
    buffer_bytes: int | None = None
    """The backend's communication buffer on one rank (the planner's count; None: unknown here)."""
    a2a_level: str = ""
    """The outermost topology level the EP group's all-to-all crosses ("" at EP = 1)."""
    gather_level: str = ""
    """The outermost level the expert-FSDP group's all-gather crosses ("" at efsdp = 1)."""
    replica_slots: int = 0
    """This layout's ``expert_replication.slots_per_rank``."""
    settings: tuple[tuple[str, str, object], ...] = ()
    """(section, field, value) of the backend's own section priced in place of the job's
    (:meth:`~torchtitan_ext.ep.base.RoutedExpertParallel.advised_alternatives`); empty: the job's."""
    job_replica_slots: int = 0
    """The job's own ``expert_replication.slots_per_rank`` (the overrides name the slots when they differ)."""
    rows_ratio: float = 1.0
    """The busiest EP rank's expert rows over the mean rank's, >= 1: 1 under uniform routing; under measured
    routing the dump's, after the replicas' split (:mod:`.replica_cost`)."""
    expert_compute_s: float = 0.0
    """The routed experts' part of ``compute_s``, which a rank's load scales: their FLOP share, or their
    measured time under a measured compute."""
    replica_fetch_s: float = 0.0
    """One forward's fetch of the replicas' weights and exchange of the pair counts, per MoE layer and call."""
    replica_return_s: float = 0.0
    """One backward's return of the replicas' gradients, per MoE layer and call."""
    kernel_rates: str = ""
    """Which published figures priced this backend's all-to-all on each link (:func:`describe_kernel_rates`)."""
    model_flops: float = 0.0
    """Model FLOPs of one rank's step as torchtitan counts them for its TFLOPS (6 x active parameters +
    attention, per token; recomputed forwards not counted)."""
    memory_bytes: int = 0
    """What one rank needs at least: its shard of parameters, gradients and AdamW state, two layers'
    gathered experts (the one computing and the one FSDP prefetches), the backend's buffer, the
    dispatched rows kept for backward and, with replica slots, the copy of home and replica experts each
    MoE layer computes from. Activations outside the MoE are not counted: a lower bound."""
    link_busy: tuple[tuple[str, float], ...] = ()
    """(link, seconds per step it carries) for each physical link: the EP all-to-alls, expert FSDP's
    gathers and reduce-scatters, the data-parallel sync and the replicas' traffic, hidden or not: a
    link that carries more than the step can hide bounds the step."""
    nominal_links: tuple[str, ...] = ()
    """Links of a named fabric that this layout's all-to-all crosses, priced at their nominal rate because
    the backend publishes no figure for them: its time there is a lower bound."""
    nominal_fabrics: tuple[str, ...] = ()
    """The fabric of each of ``nominal_links``, in their order."""

    def _per_step(self, per_layer) -> float:
        kept = self.moe_layers - self.recomputed_layers
        return self.dispatches * (per_layer(False) * kept + per_layer(True) * self.recomputed_layers)

    @property
    def communication_s(self) -> float:
        return self._per_step(self.costs.communication)

    @property
    def exposed_s(self) -> float:
        return self._per_step(lambda recomputed: self.costs.exposed(self.overlap, recomputed))

    @property
    def local_work_s(self) -> float:
        """The backend's local work per step; a recomputed layer runs its forward part again."""
        return self._per_step(
            lambda recomputed: self.dispatch_work_s * (1 + self.dispatch_forward_share if recomputed else 1.0)
        )

    @property
    def imbalance_s(self) -> float:
        """The busiest rank's expert compute above the mean rank's, per step."""
        return self.expert_compute_s * (self.rows_ratio - 1)

    @property
    def replica_s(self) -> float:
        """The replicas' traffic per step; a recomputed layer fetches (and counts) again."""
        return self._per_step(lambda recomputed: self.replica_fetch_s * (2 if recomputed else 1) + self.replica_return_s)

    @property
    def moe_s(self) -> float:
        """What the layout adds to the step: exposed MoE communication, the backend's local work, the busiest
        rank's extra expert compute and the replicas' traffic."""
        return self.exposed_s + self.local_work_s + self.imbalance_s + self.replica_s

    @property
    def tflops_per_gpu(self) -> float:
        """Predicted model TFLOP/s per GPU: the step's model FLOPs over its predicted time (as torchtitan reports)."""
        return self.model_flops / self.step_s / 1e12

    @property
    def data_parallel_exposed_s(self) -> float:
        """Data-parallel time the step waits for: with overlap, what compute cannot hide (FSDP prefetches
        the next unit's gather during this one's compute); without, all of it."""
        return max(0.0, self.data_parallel_s - self.compute_s) if self.overlap else self.data_parallel_s

    @property
    def busiest_link(self) -> tuple[str, float]:
        """(link, seconds per step) of the link that carries the most."""
        return max(self.link_busy, key=lambda item: item[1], default=("", 0.0))

    @property
    def step_s(self) -> float:
        """Predicted step time: compute, the backend's local work, and the exposed MoE and data-parallel
        communication (the smaller collectives, the loss's and the gradient norm's all-reduces, are left out);
        at least the busiest link's traffic, which overlap cannot hide from itself."""
        return max(self.compute_s + self.moe_s + self.data_parallel_exposed_s, self.busiest_link[1])

    @property
    def link_bound(self) -> bool:
        """Whether the busiest link's traffic, not compute and exposed communication, sets the step."""
        return self.busiest_link[1] > self.compute_s + self.moe_s + self.data_parallel_exposed_s


    @property
    def label(self) -> str:
        """The backend, and the settings of its section priced in place of the job's ("deepep legacy",
        "hybridep 16/32")."""
        if not self.settings:
            return self.backend
        return f"{self.backend} {BACKENDS[self.backend].settings_label({field: value for _, field, value in self.settings})}"

    def overrides(self) -> list[str]:
        selected = ["--parallelism.expert_parallel_comm_backend", self.backend, "--parallelism.expert_parallel_degree", str(self.ep)]
        for section, field, value in self.settings:
            selected += [f"--{section}.{field}", str(value)]
        if self.replica_slots != self.job_replica_slots:
            selected += ["--expert_replication.slots_per_rank", str(self.replica_slots)]
        return selected


def job_shape(job_config, world_size: int) -> JobShape:
    """The job's MoE dims, dtypes and FLOPs, from its model built on the meta device."""
    model = meta_model(job_config)
    model_args = model.model_args
    expert_parameters, dense_parameters, layers, moe_layers = 0, 0, {}, set()
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            layers[int(parts[1])] = None
        if ".moe.experts." in f".{name}":
            expert_parameters += parameter.numel()
            moe_layers.add(int(parts[1]))
        else:
            dense_parameters += parameter.numel()
    if not moe_layers:
        raise ConfigError(f"model {job_config.model.name} {job_config.model.flavor} has no MoE layers: nothing to advise")
    moe_args = model_args.moe_args
    per_expert = expert_parameters // len(moe_layers) // moe_args.num_experts
    _, flops_per_token = model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    p, training = job_config.parallelism, job_config.training
    saved, _ = saved_moe_layers(job_config, tuple(layers), tuple(sorted(moe_layers)))
    replica_copies = replica_copies_alive(job_config, tuple(layers), tuple(sorted(moe_layers)))
    recomputed = len(moe_layers) - saved
    microbatch = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else training.local_batch_size
    tokens = microbatch * training.seq_len // p.context_parallel_degree
    if p.tensor_parallel_degree > 1 and p.expert_tensor_parallel_degree == 1:
        tokens //= p.tensor_parallel_degree
    data_parallel = world_size // (p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree)
    accumulation = max(1, training.global_batch_size // (training.local_batch_size * data_parallel))
    dispatches = accumulation * (training.local_batch_size // microbatch)
    routed_flops = 6 * len(moe_layers) * moe_args.top_k * per_expert
    forward_outside_experts = (flops_per_token - routed_flops) / 3 / model_args.n_layers

    def element(dtype: str) -> int:
        return torch.empty((), dtype=TORCH_DTYPE_MAP[dtype]).element_size()

    reshard = p.fsdp_reshard_after_forward
    work = MoEWorkload(
        tokens=tokens,
        hidden=model_args.dim,
        top_k=moe_args.top_k,
        experts=moe_args.num_experts,
        expert_parameters=per_expert,
        activation_bytes=element(training.mixed_precision_param),
        gather_bytes=element(training.mixed_precision_param),
        reduce_bytes=element(training.mixed_precision_reduce),
        pre_expert_flops=forward_outside_experts * tokens,
        prefetch_flops=flops_per_token / 3 / model_args.n_layers * tokens,
        regather_in_backward=reshard == "always" or (reshard == "default" and p.pipeline_parallel_degree == 1),
        expert_groups=moe_args.num_expert_groups,
        limited_groups=moe_args.num_limited_groups,
    )
    expert_world = world_size // (
        p.pipeline_parallel_degree * p.data_parallel_replicate_degree * p.expert_tensor_parallel_degree
    )
    # every parameter is split over all ranks but the replicas (FSDP and EP, TP and PP shard it)
    parameter_share = p.data_parallel_replicate_degree / world_size
    fsdp_degree = data_parallel // p.data_parallel_replicate_degree * p.context_parallel_degree
    data_parallel_sync = DataParallelSync(
        # PP and TP split as if evenly (TP leaves norms and routers whole: each rank holds a little more)
        dense_parameters=dense_parameters // (p.pipeline_parallel_degree * p.tensor_parallel_degree),
        # the blocks, the embeddings and the output layer, one unit each (torchtitan's apply_fsdp); every
        # unit counts as re-gathered in backward, though the output layer is not by default, and as on
        # every stage, though only the first and last hold the embeddings and the output
        units=model_args.n_layers // p.pipeline_parallel_degree + 2,
        fsdp_degree=fsdp_degree,
        fsdp_stride=p.tensor_parallel_degree,
        replicas=p.data_parallel_replicate_degree,
        # torchtitan's mesh: pp, dp_replicate, dp_shard, cp, tp (innermost last)
        replica_stride=fsdp_degree * p.tensor_parallel_degree,
        shard_parameters=round((dense_parameters + expert_parameters) * parameter_share),
        gather_bytes=work.gather_bytes,
        reduce_bytes=work.reduce_bytes,
        regather_in_backward=work.regather_in_backward,
        accumulation_steps=accumulation,
    )
    return JobShape(
        work, len(moe_layers), recomputed, dispatches, flops_per_token * tokens, expert_world, data_parallel_sync,
        parameter_share, routed_flops / flops_per_token, replica_copies,
    )


STATE_BYTES_PER_PARAMETER = 16
"""fp32 parameter, fp32 gradient and AdamW's two fp32 moments: what FSDP shards for each parameter."""


def memory_needed(shape: JobShape, ep: int, gathered_expert_bytes: int, buffer_bytes: int | None, rows_ratio: float,
                  replica_slots: int, replica_region_bytes: int = 0) -> int:
    """:attr:`Layout.memory_bytes` of a layout at ``ep``; ``replica_region_bytes``: what the backend reserves beside
    its buffer for its own kernels to carry the replicas (:meth:`~torchtitan_ext.ep.base.RoutedExpertParallel.planned_replica_region`)."""
    work = shape.work
    state = shape.data_parallel_sync.shard_parameters * STATE_BYTES_PER_PARAMETER
    saved_layers = shape.moe_layers - shape.recomputed_layers
    rows = work.tokens * work.top_k * rows_ratio * work.hidden * work.activation_bytes * saved_layers if ep > 1 else 0
    # with replica slots each MoE layer computes from a copy of its home experts beside the replicas, which
    # backward keeps; torchtitan's grouped GEMM saves a bf16 copy of it, so at most 2 bytes count (a bound)
    expert_bytes = work.expert_parameters * min(work.gather_bytes, 2)
    copies, fetched = shape.replica_copies
    replica_copies = ((copies * (work.experts // ep + replica_slots) + fetched * replica_slots) * expert_bytes
                      if replica_slots else 0)
    return round(state + 2 * gathered_expert_bytes + (buffer_bytes or 0) + replica_region_bytes + rows + replica_copies)


def _candidate(job_config, backend_name: str, ep: int):
    """The job at this backend and EP degree, the other backends' sections at their defaults (the
    job's own section for this backend is kept: its knobs are part of the question)."""
    candidate = copy.deepcopy(job_config)
    candidate.parallelism.expert_parallel_comm_backend = backend_name
    candidate.parallelism.expert_parallel_degree = ep
    for other_name, other in BACKENDS.items():
        if other.config_section is not None and other_name != backend_name:
            setattr(candidate, other.config_section, other.Config())
    return candidate


def _crossed_fabrics(backend, backend_name: str, candidate, topology: Topology, world_size: int, ep: int) -> tuple:
    """The link kinds of the links the backend's all-to-all crosses at ``ep``, innermost first (None for a link
    the topology names none for); empty at EP = 1, or where its kernel domains do not fit the job (which pricing
    refuses)."""
    if ep == 1:
        return ()
    try:
        links = _kernel_links(backend, backend_name, candidate, topology, world_size, ep)
    except ConfigError:
        return ()
    crossed = links.level_of(links.group_sizes(world_size), 0, ep - 1) + 1
    return tuple(level.fabric for level in links.levels[:crossed])


def _priced_settings(job_config, ep: int, slot_counts: list[int], topology: Topology, world_size: int,
                     measured_rates: dict[tuple[str, tuple, int], MeasuredRate] | None):
    """(backend name, backend, settings of its section, replica slots) for every layout priced at ``ep``: each
    backend with the job's settings ({}) and with each of its advised alternatives, at each slot count. An
    alternative chosen by published figures that a rate measured on the cluster replaces (the same rate
    settings) would be priced as the job's settings are: it is left out."""
    for backend_name, backend in BACKENDS.items():
        candidate = _candidate(job_config, backend_name, ep)
        fabrics = _crossed_fabrics(backend, backend_name, candidate, topology, world_size, ep)
        measured_settings = {settings for name, settings, _ in (measured_rates or {}) if name == backend_name}
        alternatives = []
        for settings in backend.advised_alternatives(candidate, fabrics):
            alternative = copy.deepcopy(candidate)
            for field, value in settings.items():
                setattr(getattr(alternative, backend.config_section), field, value)
            rate_settings = backend.rate_settings(alternative)
            if rate_settings not in measured_settings or rate_settings != backend.rate_settings(candidate):
                alternatives.append(settings)
        for settings in ({}, *alternatives):
            for slots in slot_counts:
                yield backend_name, backend, settings, slots


def _check_nvlink_domain(backend, candidate, topology: Topology, sizes: list[int]) -> None:
    """ConfigError when the backend is told that more ranks share an NVLink domain than the topology's
    innermost level groups: it would treat ranks over the slower level as NVLink peers."""
    domain = backend.nvlink_domain_ranks(candidate)
    if domain is not None and domain > sizes[0]:
        raise ConfigError(
            f"{backend.config_section}.ranks_per_nvlink_domain = {domain}, but topology '{topology.name}' groups "
            f"{sizes[0]} ranks in its innermost level '{topology.levels[0].name}': set it to at most {sizes[0]} "
            "(a divisor of the EP degree)"
        )


def _kernel_links(backend, backend_name: str, candidate, topology: Topology, world_size: int, ep: int) -> Topology:
    """The links the backend's all-to-all kernels use at this EP degree: the topology, or where they reach
    fewer NVLink peers than its innermost group holds (and the EP group has more), the topology with the
    other peers on the next level's link. ConfigError when that split does not fit the job."""
    kernel_ranks = backend.kernel_nvlink_ranks(candidate)
    if kernel_ranks is None or ep <= kernel_ranks:
        return topology
    links = topology.within_kernel_domain(kernel_ranks, backend_name)
    try:
        links.group_sizes(world_size)
    except ConfigError:
        raise ConfigError(
            f"{backend_name}'s kernels reach {kernel_ranks} ranks over NVLink, which do not tile topology "
            f"'{topology.name}''s level '{topology.levels[0].name}' for {world_size} ranks: use an EP degree of at "
            f"most {kernel_ranks}, or a world size that is a multiple of {kernel_ranks}"
        ) from None
    return links


def physical_level(topology: Topology, links: Topology, index: int) -> int:
    """The level of ``topology`` whose link carries level ``index`` of ``links`` (the topology, or its split into a
    backend's kernel domains, :meth:`Topology.within_kernel_domain`: the link between kernel domains is the next
    level's)."""
    return index if links is topology or index == 0 else max(1, index - 1)


def kernel_rate_fractions(
    backend_name: str, backend, candidate, topology: Topology, links: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None = None,
) -> dict[int, float]:
    """{level of ``links``: the fraction of its rate the backend's all-to-all reaches there}: measured on the
    cluster (``measured``, :mod:`.measured_rates`) where it was, else from the backend's published figures for
    the level's fabric, dispatch's and combine's fractions combined as the step runs them, one of each per
    direction (their harmonic mean). Levels with neither: absent (nominal)."""
    rates = {rate.fabric: rate for rate in backend.published_rates(candidate)}
    settings = backend.rate_settings(candidate)
    fractions = {}
    for index, level in enumerate(links.levels):
        own = (measured or {}).get((backend_name, settings, physical_level(topology, links, index)))
        rate = rates.get(level.fabric)
        if own is not None:
            fractions[index] = own.fraction
        elif rate is not None:
            fractions[index] = 2 / (1 / rate.dispatch_fraction + 1 / rate.combine_fraction)
    return fractions


def describe_kernel_rates(
    label: str, backend_name: str, backend, candidate, topology: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None = None,
) -> str:
    """One backend's rate (as ``label`` configures it) on each of the topology's links, and where it comes from."""
    rates = {rate.fabric: rate for rate in backend.published_rates(candidate)}
    settings = backend.rate_settings(candidate)
    parts = []
    for index, level in enumerate(topology.levels):
        own = (measured or {}).get((backend_name, settings, index))
        rate = rates.get(level.fabric)
        if own is not None:
            parts.append(f"{level.name}: {own.fraction:.2f} of nominal, {'fitted' if own.fitted else 'measured'} "
                         f"({own.source})")
        elif level.fabric is None:
            parts.append(f"{level.name}: nominal (the topology names no fabric)")
        elif rate is None:
            parts.append(f"{level.name}: nominal (no published {level.fabric} figure)")
        else:
            parts.append(
                f"{level.name}: dispatch {rate.dispatch_fraction:.2f}, combine {rate.combine_fraction:.2f} of nominal "
                f"({'/'.join(dict.fromkeys(re.findall(r'docs/published_ep_figures.md ([^:]+):', rate.source)))})"
            )
    return f"{label}: " + "; ".join(parts)


def link_busy(layout: Layout, topology: Topology, links: Topology, world_size: int,
              data_parallel_busy: dict[int, float]) -> tuple[tuple[str, float], ...]:
    """:attr:`Layout.link_busy`: each collective's time per step on the physical link of its group's outermost
    level (an all-to-all's on its outermost level, whose bytes set its time; over a backend's kernel-domain
    split, the next level's link)."""
    sizes = topology.group_sizes(world_size)
    busy = dict(data_parallel_busy)
    costs = layout.costs
    if layout.ep > 1:
        physical = physical_level(topology, links, links.level_of(links.group_sizes(world_size), 0, layout.ep - 1))
        a2a = layout._per_step(lambda recomputed: costs.all_to_alls(recomputed) * costs.a2a)
        busy[physical] = busy.get(physical, 0.0) + a2a
        ep_level = topology.level_of(sizes, 0, layout.ep - 1)
        busy[ep_level] = busy.get(ep_level, 0.0) + layout.replica_s
    if layout.efsdp > 1:
        gather_level = topology.level_of(sizes, 0, (layout.efsdp - 1) * layout.ep)
        fsdp = layout.dispatches * layout.moe_layers * (costs.all_gathers * costs.all_gather + costs.reduce_scatter)
        busy[gather_level] = busy.get(gather_level, 0.0) + fsdp
    return tuple((topology.levels[level].name, seconds) for level, seconds in sorted(busy.items()) if seconds > 0)


def advise(
    train_args: list[str], world_size: int, topology: Topology, routing_stats: dict | None = None, routing_source: str = "",
    measured_compute: MeasuredCompute | None = None, replica_slots: list[int] | None = None, progress: bool = False,
    measured_rates: dict[tuple[str, tuple, int], MeasuredRate] | None = None, job_config=None,
) -> tuple[list[Layout], MeasuredRouting | None]:
    """Every backend x EP degree (x replica slot count): runnable ones ranked by what each adds to the step
    (:attr:`Layout.moe_s`), then the refused; and the measured routing used for token bytes and rank loads
    (from ``routing_stats``, a loaded dump), if any.

    Compute per step is ``measured_compute`` (this machine's, :mod:`.measured_compute`)
    when given, else the job's FLOPs at the topology's ``compute_tflops``. A measured compute makes the job
    the one this machine runs: its dtypes are the ones a CPU job here trains in (the bytes every
    collective moves). ``replica_slots``: the ``expert_replication.slots_per_rank`` values to price (default:
    the job's own); replicas need EP > 1, so with 0 among them EP = 1 is priced without replicas only.
    ``progress``: a progress bar while the dump is replayed under replicas. ``measured_rates``: backends' all-to-all
    rates measured on the cluster (:mod:`.measured_rates`), in place of their published figures. ``job_config``: the
    job as ``load_job_config`` reads ``train_args`` (without a measured compute), when the caller has it already (a
    fit prices one job many times; reading a config is most of a small job's pricing)."""
    device_type = None if measured_compute is None else "cpu"
    if job_config is None or measured_compute is not None:
        job_config = load_job_config(train_args, device_type=device_type, world_size=world_size)
    shape = job_shape(job_config, world_size)
    work = shape.work
    replication = job_config.expert_replication
    slot_counts = sorted(set(replica_slots)) if replica_slots is not None else [replication.slots_per_rank]
    prices_replicas = any(slot_counts)
    routing = None
    if routing_stats is not None:
        routing = MeasuredRouting.from_dump(routing_stats, routing_source, work.experts, work.top_k)
        if prices_replicas:
            check_replayable(routing, replication.adapt_every)
    if measured_compute is None:
        compute_s = shape.step_flops / (topology.compute_tflops * 1e12)
        expert_compute_s = compute_s * shape.expert_flop_share
    else:
        passes = shape.dispatches * shape.recompute_factor
        compute_s = measured_compute.step_seconds(passes, shape.parameter_share)
        expert_compute_s = measured_compute.routed_experts_seconds(passes)
    data_parallel_busy = shape.data_parallel_sync.per_level(topology, world_size)
    data_parallel_s = sum(data_parallel_busy.values())
    moe_shape = MoEShape(work.hidden, work.experts, work.top_k, work.tokens)
    sizes = topology.group_sizes(world_size)
    score_before_experts = model_args_of(job_config).moe_args.score_before_experts

    def local_work(
        backend_name: str, candidate, ep: int, received_tokens: float
    ) -> tuple[float, float, LocalTraffic | None]:
        """(seconds per MoE call, the forward's share, the bytes counted in a group of one) of the backend's local
        work, where the mean rank holds ``received_tokens`` token vectors per token it sends."""
        if measured_compute is not None:
            return (0.0 if ep == 1 else measured_compute.dispatch_work_s[backend_name]), 0.5, None
        if topology.memory_bandwidth_GBps is None:
            return 0.0, 0.5, None
        backend = BACKENDS[backend_name]
        settings = backend.rate_settings(candidate)
        if ep > 1 and any(rate.includes_local_work for (name, rated, _), rate in (measured_rates or {}).items()
                          if (name, rated) == (backend_name, settings)):
            return 0.0, 0.5, None  # the cluster's measured rate (bench_ep's rows) holds it
        # the job's experts: a group of one has no replica slots
        counted = copy.deepcopy(candidate)
        for field, value in backend.counted_settings(candidate, moe_shape, ep).items():
            setattr(getattr(counted, backend.config_section), field, value)
        traffic = count_local_traffic(
            backend_name if ep > 1 else None, counted, moe_shape, work.tokens,
            TORCH_DTYPE_MAP[candidate.training.mixed_precision_param], score_before_experts,
        )
        received = traffic.receiving(received_tokens)
        return received.bytes / (topology.memory_bandwidth_GBps * 1e9), received.forward_share, traffic

    def level_name(links: Topology, last_peer: int) -> str:
        if not last_peer:
            return ""
        return links.levels[links.level_of(links.group_sizes(world_size), 0, last_peer)].name

    replays: dict[tuple[int, int], ReplicaReplay] = {}

    def replayed(ep: int, slots: int) -> ReplicaReplay | None:
        """The dump replayed under replicas (the same for every backend); None without a dump or slots to price."""
        if routing is None or not prices_replicas:
            return None
        if (ep, slots) not in replays:
            replays[ep, slots] = replay(routing, ep, slots, replication.adapt_every, progress)
        return replays[ep, slots]

    runnable, refused = [], []
    for ep in range(1, shape.expert_world + 1):
        if shape.expert_world % ep or work.experts % ep:
            continue
        efsdp = shape.expert_world // ep
        for backend_name, backend, settings, slots in _priced_settings(job_config, ep, slot_counts, topology, world_size, measured_rates):
            if ep == 1 and slots and 0 in slot_counts:
                continue  # replicas need EP > 1: this EP = 1 layout is priced without them
            layout = Layout(backend_name, ep, efsdp, refused=None, replica_slots=slots,
                            job_replica_slots=replication.slots_per_rank,
                            settings=tuple((backend.config_section, field, value) for field, value in settings.items()))
            candidate = _candidate(job_config, backend_name, ep)
            for field, value in settings.items():
                setattr(getattr(candidate, backend.config_section), field, value)
            candidate.expert_replication.slots_per_rank = slots
            try:
                validate(candidate, device_type=device_type, world_size=world_size)
                _check_nvlink_domain(backend, candidate, topology, sizes)
                links = _kernel_links(backend, backend_name, candidate, topology, world_size, ep)
            except ConfigError as e:
                refused.append(replace(layout, refused=str(e)))
                continue
            replayed_here = replayed(ep, slots)
            if replayed_here is None:
                ratio, moved, pair_share = (routing.pair_share(ep) * ep if routing else 1.0), slots, None
            else:
                ratio, moved = replayed_here.rows_ratio, replayed_here.experts_moved
                pair_share = ratio / ep
            gathered = work.experts // ep * work.expert_parameters * work.gather_bytes
            buffer_bytes = backend.planned_buffer(candidate, dispatched_shape(candidate, moe_shape))[0]
            # a backend's kernels carry replicas within one NVLink domain only (elsewhere they move by all-to-all)
            region = backend.planned_replica_region(candidate) if ep > 1 and topology.level_of(sizes, 0, ep - 1) == 0 else 0
            memory = memory_needed(shape, ep, gathered, buffer_bytes, ratio, slots, region)
            if topology.memory_GB is not None and memory > topology.memory_GB * 1e9:
                refused.append(replace(layout, refused=(
                    f"one rank needs at least {memory / 1e9:,.1f} GB (sharded state, two layers' gathered experts, "
                    f"the buffer{', its region for the replicas' if region else ''}, the saved dispatched rows"
                    f"{', the replica copies' if slots else ''}), more than "
                    f"topology '{topology.name}''s memory_GB = "
                    f"{topology.memory_GB:g}: use a higher EP degree, more ranks or activation checkpointing (or "
                    "raise memory_GB if the device has more)"
                )))
                continue
            fetch_s, return_s = replica_traffic(work, topology, world_size, ep, moved)
            fractions = kernel_rate_fractions(backend_name, backend, candidate, topology, links, measured_rates)
            crossed = links.level_of(links.group_sizes(world_size), 0, ep - 1) + 1 if ep > 1 else 0
            nominal_levels = [level for index, level in enumerate(links.levels[:crossed])
                              if level.fabric is not None and index not in fractions]
            copies_per_rank = backend.sends_each_token_once_per_rank and not slots
            costs = layer_costs(work, topology, world_size, ep, efsdp, copies_per_rank, routing, pair_share, links,
                                fractions)
            # the mean rank's token vectors per token it sends: the EP ranks one token reaches, its own among them
            received = ep * token_reach(work, ep, None) if backend.sends_each_token_once_per_rank and ep > 1 else 1.0
            work_s, forward_share, traffic = local_work(backend_name, candidate, ep, received)
            priced = replace(
                layout,
                costs=costs,
                moe_layers=shape.moe_layers,
                recomputed_layers=shape.recomputed_layers,
                dispatches=shape.dispatches,
                compute_s=compute_s,
                dispatch_work_s=work_s,
                dispatch_forward_share=forward_share,
                local_traffic=traffic,
                received_tokens=received,
                data_parallel_s=data_parallel_s,
                overlap=topology.overlap,
                gathered_expert_bytes=gathered,
                buffer_bytes=buffer_bytes,
                model_flops=shape.pass_flops * shape.dispatches,
                memory_bytes=memory,
                a2a_level=level_name(links, ep - 1),
                gather_level=level_name(topology, (efsdp - 1) * ep),
                rows_ratio=ratio,
                expert_compute_s=expert_compute_s,
                replica_fetch_s=fetch_s,
                replica_return_s=return_s,
                kernel_rates=describe_kernel_rates(layout.label, backend_name, backend, candidate, topology, measured_rates),
                nominal_links=tuple(level.name for level in nominal_levels),
                nominal_fabrics=tuple(level.fabric for level in nominal_levels),
            )
            runnable.append(replace(priced, link_busy=link_busy(priced, topology, links, world_size, data_parallel_busy)))
    # a layout priced at a nominal rate (no published figure) ranks below every priced one, whatever its step: its
    # step is a bound it may not reach; equal predictions keep the job's own backend (and slot count) first
    configured = comm_backend(job_config)
    runnable.sort(key=lambda layout: (
        bool(layout.nominal_links), layout.step_s, layout.moe_s, layout.backend != configured, bool(layout.settings),
        layout.replica_slots != replication.slots_per_rank, layout.ep,
    ))
    return runnable + refused, routing


def advised_config(train_args: list[str], world_size: int, layout: Layout):
    """The job config the advisor priced for ``layout``: the job's, at its backend, EP degree and replica slots,
    the other backends' sections at their defaults; validated for ``world_size`` ranks."""
    candidate = _candidate(load_job_config(train_args, device_type=None, world_size=world_size), layout.backend, layout.ep)
    for section, field, value in layout.settings:
        setattr(getattr(candidate, section), field, value)
    candidate.expert_replication.slots_per_rank = layout.replica_slots
    validate(candidate, device_type=None, world_size=world_size)
    return candidate


def overrides_problem(train_args: list[str], world_size: int, layout: Layout) -> str | None:
    """What the job config itself still needs changed for ``layout.overrides()`` to run; None if nothing."""
    try:
        load_job_config([*train_args, *layout.overrides()], device_type=None, world_size=world_size)
    except ConfigError as e:
        return str(e)
    return None


RESOLUTION = 0.10
"""Relative step-time margin under which the advisor cannot tell layouts apart: it prices every backend at
the topology's nominal link rates, without each library's achieved bandwidth, fixed costs or SM use."""


def _ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _tflops(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


WIDTH = 118
"""The advice's lines stay within this many columns."""


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns, the first at ``indent``, the rest two further in."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False)


def _command(prefix: str, arguments: list[str]) -> list[str]:
    """``prefix`` and the (flag, value) pairs of ``arguments``, continued with backslashes past :data:`WIDTH`."""
    pairs = [" ".join(arguments[i:i + 2]) for i in range(0, len(arguments), 2)]
    lines, current = [], prefix + pairs[0]
    for pair in pairs[1:]:
        if len(current) + len(pair) + 3 > WIDTH:
            lines.append(current + " \\")
            current = " " * len(prefix) + pair
        else:
            current += " " + pair
    return [*lines, current]


def _reason(best: Layout, others: list[Layout]) -> str:
    """Why ``best`` wins: against the best layout of another backend, and the best layout at another EP degree."""
    layouts = (best, *others)
    # (what the ranking adds up, its short name in a breakdown, its value): the terms some layout has
    terms = [
        (name, short, value) for name, short, value in (
            ("the backend's local work", "local work", lambda layout: layout.local_work_s),
            ("the busiest rank's expert compute above the mean", "busiest-rank compute", lambda layout: layout.imbalance_s),
            ("the replicas' traffic", "replica traffic", lambda layout: layout.replica_s),
        ) if any(value(layout) for layout in layouts)
    ]

    def moe_time(layout: Layout) -> str:
        if not terms:
            return f"{_ms(layout.exposed_s)} ms"
        added = " + ".join(f"{_ms(value(layout))} {short}" for _, short, value in terms)
        return f"{_ms(layout.moe_s)} ms: {_ms(layout.exposed_s)} exposed communication + {added}"

    if terms:
        names = " plus ".join(name for name, _, _ in terms)
        parts = [f"least exposed MoE communication plus {names} per step, {moe_time(best)}"]
    else:
        parts = [f"least exposed MoE communication, {_ms(best.exposed_s)} ms per step"]
    rival = next((o for o in others if o.backend != best.backend), None)
    copies = "" if rival is None else (
        f"{best.label} sends {best.costs.token_copies:.2f} copies of each token per dispatch, "
        f"{rival.label} {rival.costs.token_copies:.2f}"
    )
    if best.link_bound:
        parts.insert(0, f"the least predicted step, set by its busiest link ({best.busiest_link[0]} carries "
                        f"{_ms(best.busiest_link[1])} ms per step)")
    if rival is not None and rival.step_s == best.step_s:
        parts.append(
            f"{rival.label} at EP={rival.ep} ties (the same predicted step: the model does not separate them, and "
            f"keeps the job's own backend first)"
        )
    elif rival is not None and terms:
        parts.append(f"{rival.label} (best at EP={rival.ep}) takes {moe_time(rival)} ({copies})")
    elif rival is not None:
        parts.append(f"{rival.label} (best at EP={rival.ep}) exposes {_ms(rival.exposed_s)} ms: {copies}")
    without = next((o for o in others if (o.label, o.ep, o.replica_slots) == (best.label, best.ep, 0)), None)
    if best.replica_slots and without is not None:
        parts.append(
            f"with {best.replica_slots} replica slot(s) the busiest rank computes {best.rows_ratio:.3f}x the mean rank's "
            f"expert rows ({without.rows_ratio:.3f}x without), {_ms(best.imbalance_s)} ms above the mean per step "
            f"({_ms(without.imbalance_s)} without), for {_ms(best.replica_s)} ms of replica traffic"
        )
    elif best.rows_ratio > 1:
        parts.append(
            f"the busiest rank computes {best.rows_ratio:.3f}x the mean rank's expert rows, "
            f"{_ms(best.imbalance_s)} ms above the mean per step"
        )
    neighbour = next((o for o in others if o.ep != best.ep), None)
    if neighbour is not None:
        def describe(layout: Layout) -> str:
            a2a = f"all-to-all {_ms(layout.costs.a2a)} ms" + (f" over {layout.a2a_level}" if layout.a2a_level else "")
            exposed_gather = layout.costs.exposed(layout.overlap) - layout.costs.all_to_alls(False) * layout.costs.a2a
            gather = f"expert gather/scatter {_ms(exposed_gather)} ms exposed" + (
                f" over {layout.gather_level}" if layout.gather_level else ""
            )
            return f"{a2a}, {gather}"

        parts.append(
            f"per layer, EP={best.ep} has {describe(best)}; the best other EP degree, {neighbour.label} at "
            f"EP={neighbour.ep} ({moe_time(neighbour)}), has {describe(neighbour)}"
        )
    return "; ".join(parts)


def format_advice(
    layouts: list[Layout], topology: Topology, world_size: int, model: str, overrides_problem: str | None,
    routing: MeasuredRouting | None = None, measured_compute: MeasuredCompute | None = None,
) -> list[str]:
    runnable = [layout for layout in layouts if layout.refused is None]
    lines = [
        f"Layout advice: {model} on {world_size} ranks, topology '{topology.name}' "
        f"(communication {'overlaps' if topology.overlap else 'does not overlap'} compute)",
    ]
    if routing is not None:
        lines.append(
            f"  token bytes and rank loads from measured routing ({routing.source}: {routing.dispatches} step x layer "
            "dispatches), the busiest receiving rank's share, experts in logical order"
        )
    else:
        lines.append("  token bytes assume uniform routing (--routing-stats DUMP uses a run's measured routing)")
    priced_slots = sorted({layout.replica_slots for layout in layouts})
    prices_replicas = any(priced_slots)
    if prices_replicas and routing is None:
        lines.append(
            "  replica slots priced under uniform routing, where every rank computes the mean: they only add "
            "their traffic (--routing-stats DUMP prices the imbalance they remove)"
        )
    elif prices_replicas:
        lines.append(
            f"  replica slots {', '.join(map(str, priced_slots))} priced by replaying the dump's counts through "
            "training's choice and split of replicas, from the steps after the first choice (every slot count on "
            "the same dispatches)"
        )
    if runnable:
        first = runnable[0]
        if measured_compute is None:
            compute = f"at {topology.compute_tflops:g} TFLOP/s"
        else:
            compute = (
                f"measured on this machine ({measured_compute.processes} processes: forward + backward "
                f"{measured_compute.forward_backward_s:.3f} s, the routed experts {measured_compute.routed_experts_s:.3f} "
                f"s of it; optimizer {measured_compute.optimizer_s:.3f} s for all parameters)"
            )
        lines.append(
            f"  {first.moe_layers} MoE layers ({first.recomputed_layers} recomputed by activation checkpointing), "
            f"{first.dispatches} MoE call(s) per layer and step; compute {_ms(first.compute_s)} ms per step "
            f"{compute}; data-parallel sync {_ms(first.data_parallel_s)} ms per step "
            f"({_ms(first.data_parallel_exposed_s)} exposed); "
            "times per rank"
        )
        lines.append("  all-to-all at the fraction of each link's nominal rate its kernels reach, as published "
                     "(docs/published_ep_figures.md) or measured (--calibrate-from):")
        for rates in dict.fromkeys(layout.kernel_rates for layout in runnable):
            lines += _wrapped(rates, "    ")
        shows_local = any(layout.dispatch_work_s for layout in runnable)
        counted = {("torchtitan's own sort (EP=1)" if layout.ep == 1 else layout.label): layout.local_traffic
                   for layout in runnable if layout.local_traffic is not None}
        if counted:
            held = sorted({layout.label for layout in runnable if layout.ep > 1 and layout.local_traffic is None})
            growing = sorted({
                layout.label for layout in runnable if layout.received_tokens != 1.0 and layout.local_traffic
                and (layout.local_traffic.forward_token_bytes or layout.local_traffic.backward_token_bytes)
            })
            lines += _wrapped(
                "local: each backend's passes over the token rows outside its kernels, counted at the job's shape "
                "in a group of one (docs/planning.md), per MoE call forward and backward: "
                + ", ".join(f"{label} {traffic.bytes / 1e9:.1f} GB" for label, traffic in counted.items())
                + (f"; {', '.join(growing)} hold a received token vector for each EP rank a token reaches"
                   if growing else "")
                + (f"; not counted for {', '.join(held)}: the rate measured on the cluster (--calibrate-from, "
                   "bench_ep) holds it" if held else "")
                + f"; at the {topology.memory_bandwidth_GBps:,.0f} GB/s memory bandwidth, eager mode", "  ")
        links = {name: f"L{index}" for index, name in enumerate(dict.fromkeys(
            layout.a2a_level for layout in runnable if layout.a2a_level), start=1)}
        lines.append(
            f"  {'#':>3} {'backend':<14} {'EP':>4} {'efsdp':>5} {'slots ' if prices_replicas else ''}{'copy':>5} "
            f"{'A2A ms':>6} {'AG ms':>6} {'exposed':>7} {'local ' if shows_local else ''}"
            f"{'rows x ' if routing is not None else ''}{' repl ' if prices_replicas else ''}"
            f"{'step ms':>7} {'TFLOPS':>6} {'mem GB':>5} {'link%':>5} over"
        )
        for index, layout in enumerate(runnable, start=1):
            c = layout.costs
            lines.append(
                f"  {index:>3} {layout.label:<14} {layout.ep:>4} {layout.efsdp:>5} "
                f"{f'{layout.replica_slots:>5} ' if prices_replicas else ''}{c.token_copies:>5.2f} "
                f"{_ms(c.a2a):>6} {_ms(c.all_gather):>6} {_ms(layout.exposed_s):>7} "
                f"{f'{_ms(layout.local_work_s):>5} ' if shows_local else ''}"
                f"{f'{layout.rows_ratio:>6.3f} ' if routing is not None else ''}"
                f"{f'{_ms(layout.replica_s):>5} ' if prices_replicas else ''}{_ms(layout.step_s):>7} "
                f"{_tflops(layout.tflops_per_gpu):>6} {layout.memory_bytes / 1e9:>5.3g} "
                f"{layout.busiest_link[1] / layout.step_s:>5.0%} {links.get(layout.a2a_level, '-')}"
            )
        lines += _wrapped(
            "columns: copy: copies of each token that leave the rank per dispatch; A2A ms and AG ms per layer and call; exposed, local, repl (the replicas' traffic) and step ms per step; rows x: the "
            "busiest rank's expert rows over the mean rank's; TFLOPS: model TFLOP/s per GPU at the predicted step; "
            "mem GB: what a rank needs at least; link%: the busiest link's traffic per step (hidden or not) over the "
            "step (100%: the link sets the step); over: the outermost link the all-to-all crosses, "
            + ", ".join(f"{short} = {name}" for name, short in links.items())
            + "".join(f"; {legend}" for legend in dict.fromkeys(
                BACKENDS[layout.backend].settings_legend for layout in runnable if layout.settings) if legend), "  ")
        with_slots = f", {first.replica_slots} replica slot(s) per rank" if prices_replicas else ""
        lines.append(
            f"  recommended: {first.label} at EP={first.ep}, efsdp={first.efsdp}{with_slots}: "
            f"{_ms(first.step_s)} ms per step, {_tflops(first.tflops_per_gpu)} TFLOPS/GPU"
        )
        # compared with the layouts priced as it is (a nominal rate's bound is no price)
        alike = [layout for layout in runnable[1:] if bool(layout.nominal_links) == bool(first.nominal_links)]
        lines += _wrapped(f"why: {_reason(first, alike)}", "    ")
        link, busy = first.busiest_link
        if busy:
            lines += _wrapped(
                f"busiest link: {link} carries {_ms(busy)} ms per step ({busy / first.step_s:.0%} of the step"
                + ("; it sets the step: its traffic cannot all hide)" if first.link_bound else ")"), "    ")
        close = [layout for layout in alike if layout.step_s <= first.step_s * (1 + RESOLUTION)]
        if close:
            named = ", ".join(f"{layout.label} EP={layout.ep}" + (f" {layout.replica_slots} slots" if prices_replicas else "")
                              for layout in close[:3])
            lines += _wrapped(
                f"within the model's resolution: {len(close)} other layout(s) predict a step within "
                f"{RESOLUTION:.0%} of this one ({named}{', ...' if len(close) > 3 else ''}): measure them before choosing",
                "  ")
        faster = [layout for layout in runnable if layout.nominal_links and layout.step_s < first.step_s]
        if faster and not first.nominal_links:
            named = ", ".join(dict.fromkeys(
                f"{layout.label} EP={layout.ep}{f' {layout.replica_slots} slots' if prices_replicas else ''} "
                f"({_ms(layout.step_s)} ms over {' and '.join(layout.nominal_links)})" for layout in faster[:3]))
            lines += _wrapped(
                f"ranked below every priced layout: {named}{', ...' if len(faster) > 3 else ''} predicted faster, "
                "but priced at the link's nominal rate (no published figure), a bound it may not reach: time it and "
                "give --calibrate-from the measurement (python -m torchtitan_ext.bench ep --json, or an nccl-tests "
                "alltoall_perf log) before choosing it", "  ")
        elif first.nominal_links:
            lines += _wrapped(
                f"priced at the nominal rate of {' and '.join(first.nominal_links)} (no published figure), a bound "
                "it may not reach, as every runnable layout here is: time it (--calibrate-from) before choosing it",
                "  ")
        lines += _command("  overrides: ", first.overrides())
        if overrides_problem is not None:
            lines += _wrapped(f"with those, this job config still fails its checks: {overrides_problem}", "  ")
    as_configured = {(layout.backend, layout.ep, layout.replica_slots): layout.refused
                     for layout in layouts if layout.refused is not None and not layout.settings}
    # an alternative refused for the reason its backend as configured is, is listed once
    refused = [layout for layout in layouts if layout.refused is not None and not (
        layout.settings and as_configured.get((layout.backend, layout.ep, layout.replica_slots)) == layout.refused)]
    if refused:
        lines.append("  not runnable (the job's config checks; other backends' sections at their defaults):")
        for layout in refused:
            lines += _wrapped(
                f"{layout.label} EP={layout.ep}{f' slots={layout.replica_slots}' if prices_replicas else ''}: "
                f"{layout.refused}", "    ")
    return [wrapped for line in lines for wrapped in (_wrapped(line.lstrip(), line[:len(line) - len(line.lstrip())])
                                                      if len(line) > WIDTH else [line])]


def layouts_record(layouts: list[Layout]) -> list[dict]:
    """Every layout considered, ranked ones first, as JSON-ready objects (times in seconds per step and rank)."""
    records = []
    for rank, layout in enumerate(layouts, start=1):
        record = {
            "backend": layout.backend, "ep_degree": layout.ep, "efsdp_degree": layout.efsdp,
            "settings": {f"{section}.{field}": value for section, field, value in layout.settings},
            "replica_slots": layout.replica_slots, "runnable": layout.refused is None, "refused": layout.refused,
        }
        if layout.refused is None:
            record.update(
                rank=rank, step_s=layout.step_s, moe_s=layout.moe_s, compute_s=layout.compute_s,
                exposed_communication_s=layout.exposed_s, communication_s=layout.communication_s,
                local_work_s=layout.local_work_s, busiest_rank_compute_s=layout.imbalance_s,
                replica_traffic_s=layout.replica_s, data_parallel_exposed_s=layout.data_parallel_exposed_s,
                token_copies=layout.costs.token_copies, all_to_all_s=layout.costs.a2a, rows_max_over_mean=layout.rows_ratio,
                all_to_all_over=layout.a2a_level, gathered_expert_bytes=layout.gathered_expert_bytes,
                buffer_bytes=layout.buffer_bytes, overrides=layout.overrides(), kernel_rates=layout.kernel_rates,
                tflops_per_gpu=layout.tflops_per_gpu, memory_bytes=layout.memory_bytes,
                nominal_links=list(layout.nominal_links), link_busy_s=dict(layout.link_busy),
                pricing="nominal" if layout.nominal_links else "priced",
                assumption=(f"all-to-all over {' and '.join(layout.nominal_links)} at the link's nominal rate (no "
                            "published figure): a lower bound of its time" if layout.nominal_links else None),
                link_bound=layout.link_bound,
            )
        records.append(record)
    return records


def format_paper(setting: PaperSetting, link: str) -> list[str]:
    """The seed paper's one-level setting at every feasible expert-domain size, in its notation."""
    G, D, P_E, B = setting.G, setting.D, setting.P_E, setting.B
    case = "2.2: 2D >= G P_E, all-gather only" if 2 * D >= G * P_E else "2.1: 2D < G P_E, both transfers"
    lines = [
        f"Paper setting (one worker per entry, bandwidth only): G={G}, D={D / 1e6:g} MB, P_E={P_E / 1e6:g} MB, "
        f"B={B / 1e9:g} GB/s ({link}), Lat^PE={setting.pre_expert * 1e3:g} ms",
        f"  {'S':>4} {'p':>6} {'A2A pairs':>9} {'AG pairs':>8} {'Lat^A2A ms':>10} {'Lat^AG ms':>9} {'Lat ms':>9}",
    ]
    for S in setting.domain_sizes():
        pairs = pair_counts([G], [S])
        lines.append(
            f"  {S:>4} {p_of_domain_size(G, S):>6.3f} {pairs['A2A']:>9} {pairs['AG']:>8} "
            f"{_ms(eq3_a2a_volume(D, G // S) / B):>10} {_ms(eq4_ag_volume(P_E, S) / B):>9} {_ms(setting.latency(S)):>9}"
        )
    best = setting.best_domain_size()
    p_star = optimal_p(G, D, P_E, B, setting.pre_expert)
    lines.append(
        f"  best feasible: S={best} (p={p_of_domain_size(G, best):.3f}, {_ms(setting.latency(best))} ms); "
        f"closed form (case {case}): p*={p_star:.3f}"
    )
    return lines
