"""Which EP backend and EP layout a job should use on a topology, and why.

:func:`advise` prices every backend at every (EP degree, expert-FSDP degree) the job can run at its world size
(a backend that needs expert parallelism from EP = 2), and at each replica slot count to price: the MoE
communication per step and the part the step waits for (:mod:`.cost_model`), the backend's local work, the
busiest rank's expert compute above the mean and the replicas' traffic (:mod:`.replica_cost`), and the
per-rank memory; it ranks the layouts by predicted step. A layout the job config's own validation refuses is
listed with the reason, never ranked.
:func:`~torchtitan_ext.planning.advice_report.format_advice` prints the table. See docs/planning.md, "Which
backend and EP layout"
"""

import copy
from dataclasses import replace

from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import (
    comm_backend, ConfigError, job_summary, load_job_config, model_args_of, MoEShape, overlaps_expert_parallel,
    validate,
)
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.ep.replication.plan import dispatched_shape
from torchtitan_ext.planning.cost_model import layer_costs, MeasuredRouting, token_reach
from torchtitan_ext.planning.job_shape import job_shape, memory_needed
from torchtitan_ext.planning.layout import Layout
from torchtitan_ext.planning.layout_links import (
    candidate_config, check_nvlink_domain, describe_kernel_rates, kernel_call_floors, kernel_links,
    kernel_rate_fractions, link_busy, priced_settings, rate_evidence, settings_at_ep,
)
from torchtitan_ext.planning.local_traffic import count_local_traffic, LocalTraffic
from torchtitan_ext.planning.measured_compute import MeasuredCompute
from torchtitan_ext.planning.measured_rates import MeasuredRate
from torchtitan_ext.planning.replica_cost import replay, replica_traffic, ReplicaReplay
from torchtitan_ext.planning.topology import Topology


def advise(
    train_args: list[str], world_size: int, topology: Topology, routing_stats: dict | None = None, routing_source: str = "",
    measured_compute: MeasuredCompute | None = None, replica_slots: list[int] | None = None, progress: bool = False,
    measured_rates: dict[tuple[str, tuple, int], MeasuredRate] | None = None, job_config=None,
    fitted_fractions: dict[tuple[str, tuple, str], float] | None = None, ep_degrees: set[int] | None = None,
    device_type: str | None = None, a2a_overlap: bool | None = None,
) -> tuple[list[Layout], MeasuredRouting | None]:
    """Every backend x EP degree (x replica slot count; EP = 1 only for a backend that runs without expert
    parallelism, :func:`~torchtitan_ext.planning.layout_links.priced_settings`): runnable ones ranked by what each adds to the step
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
    fit prices one job many times; reading a config is most of a small job's pricing). ``fitted_fractions``:
    {(backend, rate settings, fabric): share of the nominal rate} a fit gives (docs/advisor_fit.toml), which a
    layout priced at a nominal rate is also priced at, the other end of its range (:attr:`Layout.fitted_step_s`).
    ``ep_degrees``: the EP degrees to price (default: every one the job can run at its world size).
    ``device_type``: where the job runs, for its config checks (None: a GPU job; a measured compute is a CPU's).
    ``a2a_overlap``: whether the all-to-alls run beside another microbatch's compute (None: as the job runs them,
    :func:`~torchtitan_ext.config.overlaps_expert_parallel`; a published run states its own)."""
    device_type = "cpu" if measured_compute is not None else device_type
    if job_config is None or measured_compute is not None:
        job_config = load_job_config(train_args, device_type=device_type, world_size=world_size)
    shape = job_shape(job_config, world_size)
    work = shape.work
    replication = job_config.expert_replication
    slot_counts = sorted(set(replica_slots)) if replica_slots is not None else [replication.slots_per_rank]
    prices_replicas = any(slot_counts)
    routing = None
    if routing_stats is not None:
        # a dump that cannot be replayed under replicas is refused at its first replay (replica_cost.replay)
        routing = MeasuredRouting.from_dump(routing_stats, routing_source, work.experts, work.top_k)
    if measured_compute is None:
        compute_s = topology.compute_seconds(shape.step_flops, shape.mxfp8_flop_share)
        expert_compute_s = topology.compute_seconds(shape.step_flops * shape.expert_flop_share,
                                                    float(shape.experts_in_mxfp8))
    else:
        passes = shape.dispatches * shape.recompute_factor
        compute_s = measured_compute.step_seconds(passes, shape.parameter_share)
        expert_compute_s = measured_compute.routed_experts_seconds(passes)
    data_parallel_busy = shape.data_parallel_sync.per_level(topology, world_size)
    data_parallel_s = sum(data_parallel_busy.values())
    moe_shape = MoEShape(work.hidden, work.experts, work.top_k, work.tokens)
    sizes = topology.group_sizes(world_size)
    score_before_experts = model_args_of(job_config).moe_args.score_before_experts
    if a2a_overlap is None:
        a2a_overlap = overlaps_expert_parallel(job_config.parallelism)

    def sm_share(backend_name: str, candidate) -> tuple[float, str]:
        """(the share of the SMs the backend's kernels hold, why it is 0 where it is not priced) under overlap."""
        if not (a2a_overlap and topology.overlap):
            return 0.0, ""
        sms = PLANNING_PROFILES[backend_name].communication_sms(candidate)
        if sms is None:
            return 0.0, f"{backend_name} picks its SMs at run time"
        if topology.sms is None:
            return 0.0, f"topology '{topology.name}' gives no sms"
        if sms >= topology.sms:
            raise ConfigError(f"{backend_name}'s kernels are set to {sms:g} SMs, and topology '{topology.name}' gives "
                              f"its GPUs {topology.sms}: set the backend's SMs below that, or the topology's sms")
        return sms / topology.sms, ""

    def local_work(
        backend_name: str, candidate, ep: int, received_tokens: float, counted_settings: dict
    ) -> tuple[float, float, LocalTraffic | None]:
        """(seconds per MoE call, the forward's share, the bytes counted in a group of one) of the backend's local
        work, where the mean rank holds ``received_tokens`` token vectors per token it sends; counted in a group
        of one at ``counted_settings`` (:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.counted_settings`)."""
        if measured_compute is not None:
            return (0.0 if ep == 1 else measured_compute.dispatch_work_s[backend_name]), 0.5, None
        if topology.memory_bandwidth_GBps is None:
            return 0.0, 0.5, None
        backend, profile = BACKENDS[backend_name], PLANNING_PROFILES[backend_name]
        settings = profile.rate_settings(candidate)
        if ep > 1 and any(rate.includes_local_work for (name, rated, _), rate in (measured_rates or {}).items()
                          if (name, rated) == (backend_name, settings)):
            return 0.0, 0.5, None  # the cluster's measured rate (bench_ep's rows) holds it
        # the job's experts: a group of one has no replica slots
        counted = copy.deepcopy(candidate)
        for field, value in counted_settings.items():
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
        return links.levels[links.rank_levels(world_size)[last_peer]].name

    replays: dict[tuple[int, int], ReplicaReplay] = {}

    def replayed(ep: int, slots: int) -> ReplicaReplay | None:
        """The dump replayed under replicas (the same for every backend); None without a dump or slots to price."""
        if routing is None or not prices_replicas:
            return None
        if (ep, slots) not in replays:
            replays[ep, slots] = replay(routing, ep, slots, replication.adapt_every, progress)
        return replays[ep, slots]

    runnable, refused = [], []
    replicated: tuple[int, int] | None = None
    """The first (EP, slots) with replicas considered: replayed at the end if no layout with replicas was priced."""
    for ep in range(1, shape.expert_world + 1):
        if shape.expert_world % ep or work.experts % ep or (ep_degrees is not None and ep not in ep_degrees):
            continue
        efsdp = shape.expert_world // ep
        for backend_name, backend, settings, slots in priced_settings(job_config, ep, slot_counts, topology, world_size, measured_rates):
            profile = PLANNING_PROFILES[backend_name]
            if ep == 1 and slots and 0 in slot_counts:
                continue  # replicas need EP > 1: this EP = 1 layout is priced without them
            if replicated is None and ep > 1 and slots:
                replicated = (ep, slots)
            layout = Layout(backend_name, ep, efsdp, refused=None, replica_slots=slots,
                            job_replica_slots=replication.slots_per_rank,
                            ep_settings=settings_at_ep(job_config, backend_name, ep),
                            settings=tuple((backend.config_section, field, value) for field, value in settings.items()))
            candidate = candidate_config(job_config, backend_name, ep)
            for field, value in settings.items():
                setattr(getattr(candidate, backend.config_section), field, value)
            candidate.expert_replication.slots_per_rank = slots
            try:
                validate(candidate, device_type=device_type, world_size=world_size)
                check_nvlink_domain(backend_name, candidate, topology, sizes)
                links = kernel_links(backend_name, candidate, topology, world_size, ep)
            except ConfigError as e:
                reason = str(e)
                for section, field, value in layout.ep_settings:
                    if f"{section}.{field} = {value}" in reason:  # a value the user never wrote: say where it is from
                        reason += (f" (the job sets {getattr(getattr(job_config, section), field)}; this layout "
                                   f"sets {value}, its EP degree)")
                refused.append(replace(layout, refused=reason))
                continue
            replayed_here = replayed(ep, slots)
            if replayed_here is None:
                ratio, moved, pair_share = (routing.pair_share(ep) * ep if routing else 1.0), slots, None
            else:
                ratio, moved = replayed_here.rows_ratio, replayed_here.experts_moved
                pair_share = ratio / ep
            gathered = work.experts // ep * work.expert_parameters * work.gather_bytes
            buffer_bytes = profile.planned_buffer(candidate, dispatched_shape(candidate, moe_shape))[0]
            # a backend's kernels carry replicas within one NVLink domain only (elsewhere they move by all-to-all)
            region = profile.planned_replica_region(candidate) if ep > 1 and topology.rank_levels(world_size)[ep - 1] == 0 else 0
            counted_settings = profile.counted_settings(candidate, moe_shape, ep)
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
            fractions = kernel_rate_fractions(backend_name, candidate, topology, links, measured_rates)
            floors = kernel_call_floors(backend_name, candidate, topology, links, measured_rates)
            crossed = links.rank_levels(world_size)[ep - 1] + 1 if ep > 1 else 0
            nominal = [index for index, level in enumerate(links.levels[:crossed])
                       if level.fabric is not None and index not in fractions]
            nominal_levels = [links.levels[index] for index in nominal]
            copies_per_rank = profile.sends_each_token_once_per_rank and not slots
            costs = layer_costs(work, topology, world_size, ep, efsdp, copies_per_rank, routing, pair_share, links,
                                fractions, floors)
            rated = profile.rate_settings(candidate)
            fitted = {index: (fitted_fractions or {}).get((backend_name, rated, links.levels[index].fabric))
                      for index in nominal}
            fitted_costs = None if not fitted or None in fitted.values() else layer_costs(
                work, topology, world_size, ep, efsdp, copies_per_rank, routing, pair_share, links,
                {**fractions, **fitted}, floors)
            # the mean rank's token vectors per token it sends: the EP ranks one token reaches, its own among them
            received = ep * token_reach(work, ep, None) if profile.sends_each_token_once_per_rank and ep > 1 else 1.0
            work_s, forward_share, traffic = local_work(backend_name, candidate, ep, received, counted_settings)
            try:
                share, sm_note = sm_share(backend_name, candidate)
            except ConfigError as e:
                refused.append(replace(layout, refused=str(e)))
                continue
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
                model_flops=shape.model_pass_flops * shape.dispatches,
                pipeline_bubble=shape.pipeline_bubble,
                mxfp8_flop_share=0.0 if measured_compute is not None else shape.mxfp8_flop_share,
                memory_bytes=memory,
                a2a_level=level_name(links, ep - 1),
                gather_level=level_name(topology, (efsdp - 1) * ep),
                rows_ratio=ratio,
                expert_compute_s=expert_compute_s,
                replica_fetch_s=fetch_s,
                replica_return_s=return_s,
                kernel_rates=describe_kernel_rates(layout.label, backend_name, candidate, topology, measured_rates),
                rate_evidence=rate_evidence(backend_name, candidate, topology, links, measured_rates, crossed),
                nominal_links=tuple(level.name for level in nominal_levels),
                nominal_fabrics=tuple(level.fabric for level in nominal_levels),
                a2a_overlap=a2a_overlap and topology.overlap,
                communication_sm_share=share,
                sm_note=sm_note,
            )
            if fitted_costs is not None:
                priced = replace(priced, fitted_step_s=replace(priced, costs=fitted_costs).step_s)
            runnable.append(replace(priced, link_busy=link_busy(priced, topology, links, world_size, data_parallel_busy)))
    if replicated is not None and not replays:
        replayed(*replicated)  # a dump the replicas cannot be priced on is refused even where every such layout was
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
    the other backends' sections at their defaults, its description (the file's label: a job's banner replaces
    it) saying what it holds where the job's named the layout it had; validated for ``world_size`` ranks."""
    candidate = candidate_config(load_job_config(train_args, device_type=None, world_size=world_size), layout.backend, layout.ep)
    for section, field, value in layout.settings:
        setattr(getattr(candidate, section), field, value)
    candidate.expert_replication.slots_per_rank = layout.replica_slots
    candidate.job.description = f"{job_summary(candidate, world_size)}, as planned"
    validate(candidate, device_type=None, world_size=world_size)
    return candidate


def overrides_problem(train_args: list[str], world_size: int, layout: Layout) -> str | None:
    """What the job config itself still needs changed for ``layout.overrides()`` to run; None if nothing."""
    try:
        load_job_config([*train_args, *layout.overrides()], device_type=None, world_size=world_size)
    except ConfigError as e:
        return str(e)
    return None
