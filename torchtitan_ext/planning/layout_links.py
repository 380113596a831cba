"""The links a backend's all-to-all crosses at a layout, and the rates it reaches there: the job at one backend
and EP degree, the settings to price it at, its kernel domains on the topology, its published rate fractions,
and how busy each link is."""

import copy
import re
from itertools import islice

from torchtitan_ext.config import ConfigError
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.planning.layout import Layout
from torchtitan_ext.planning.measured_rates import MeasuredRate
from torchtitan_ext.planning.topology import Topology


def candidate_config(job_config, backend_name: str, ep: int):
    """The job at this backend and EP degree, the other backends' sections at their defaults (the
    job's own section for this backend is kept: its knobs are part of the question, except those that follow
    from the EP degree, :func:`settings_at_ep`)."""
    candidate = copy.deepcopy(job_config)
    candidate.parallelism.expert_parallel_comm_backend = backend_name
    candidate.parallelism.expert_parallel_degree = ep
    for other_name, other in BACKENDS.items():
        if other.config_section is not None and other_name != backend_name:
            setattr(candidate, other.config_section, other.Config())
    for section, field, value in settings_at_ep(job_config, backend_name, ep):
        setattr(getattr(candidate, section), field, value)
    return candidate


def settings_at_ep(job_config, backend_name: str, ep: int) -> tuple[tuple[str, str, object], ...]:
    """(section, field, value) of the backend's own section that a layout at ``ep`` sets in place of the job's,
    because they follow from the EP degree (HybridEP's EP ranks per NVLink domain at a smaller EP group)."""
    section = BACKENDS[backend_name].config_section
    return tuple((section, field, value)
                 for field, value in PLANNING_PROFILES[backend_name].settings_at_ep(job_config, ep).items())


def crossed_fabrics(backend_name: str, candidate, topology: Topology, world_size: int, ep: int) -> tuple:
    """The link kinds of the links the backend's all-to-all crosses at ``ep``, innermost first (None for a link
    the topology names none for); empty at EP = 1, or where its kernel domains do not fit the job (which pricing
    refuses)."""
    if ep == 1:
        return ()
    try:
        links = kernel_links(backend_name, candidate, topology, world_size, ep)
    except ConfigError:
        return ()
    crossed = links.rank_levels(world_size)[ep - 1] + 1
    return tuple(level.fabric for level in links.levels[:crossed])


def priced_settings(job_config, ep: int, slot_counts: list[int], topology: Topology, world_size: int,
                     measured_rates: dict[tuple[str, tuple, int], MeasuredRate] | None):
    """(backend name, backend, settings of its section, replica slots) for every layout priced at ``ep``: each
    backend with the job's settings ({}) and with each of its advised alternatives, at each slot count. An
    alternative chosen by published figures that a rate measured on the cluster replaces (the same rate
    settings) would be priced as the job's settings are: it is left out. A backend that needs expert parallelism
    has no layout at EP = 1."""
    for backend_name, backend in BACKENDS.items():
        if ep == 1 and backend.needs_expert_parallelism:
            continue
        profile = PLANNING_PROFILES[backend_name]
        candidate = candidate_config(job_config, backend_name, ep)
        fabrics = crossed_fabrics(backend_name, candidate, topology, world_size, ep)
        measured_settings = {settings for name, settings, _ in (measured_rates or {}) if name == backend_name}
        alternatives = []
        for settings in profile.advised_alternatives(candidate, fabrics):
            alternative = copy.deepcopy(candidate)
            for field, value in settings.items():
                setattr(getattr(alternative, backend.config_section), field, value)
            rate_settings = profile.rate_settings(alternative)
            if rate_settings not in measured_settings or rate_settings != profile.rate_settings(candidate):
                alternatives.append(settings)
        for settings in ({}, *alternatives):
            for slots in slot_counts:
                yield backend_name, backend, settings, slots


def check_nvlink_domain(backend_name: str, candidate, topology: Topology, sizes: list[int]) -> None:
    """ConfigError when the backend is told that more ranks share an NVLink domain than the topology's
    innermost level groups: it would treat ranks over the slower level as NVLink peers."""
    domain = PLANNING_PROFILES[backend_name].nvlink_domain_ranks(candidate)
    if domain is not None and domain > sizes[0]:
        raise ConfigError(
            f"{BACKENDS[backend_name].config_section}.ranks_per_nvlink_domain = {domain}, but topology '{topology.name}' groups "
            f"{sizes[0]} ranks in its innermost level '{topology.levels[0].name}': set it to at most {sizes[0]} "
            "(a divisor of the EP degree)"
        )


def kernel_links(backend_name: str, candidate, topology: Topology, world_size: int, ep: int) -> Topology:
    """The links the backend's all-to-all kernels use at this EP degree: the topology, or where they reach
    fewer NVLink peers than its innermost group holds (and the EP group has more), the topology with the
    other peers on the next level's link. ConfigError when that split does not fit the job."""
    kernel_ranks = PLANNING_PROFILES[backend_name].kernel_nvlink_ranks(candidate)
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
    backend_name: str, candidate, topology: Topology, links: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None = None,
) -> dict[int, float]:
    """{level of ``links``: the fraction of its rate the backend's all-to-all reaches there}: measured on the
    cluster (``measured``, :mod:`.measured_rates`) where it was, else from the backend's published figures for
    the level's fabric, dispatch's and combine's fractions combined as the step runs them, one of each per
    direction (their harmonic mean). Levels with neither: absent (nominal)."""
    fractions = {}
    for index, (_, own, rate) in enumerate(_rated_levels(backend_name, candidate, topology, links, measured)):
        if own is not None:
            fractions[index] = own.fraction
        elif rate is not None:
            fractions[index] = 2 / (1 / rate.dispatch_fraction + 1 / rate.combine_fraction)
    return fractions


def kernel_call_floors(
    backend_name: str, candidate, topology: Topology, links: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None = None,
) -> dict[int, float]:
    """{level of ``links``: the fixed cost of one all-to-all call the cluster's size sweep measured there}: where
    :mod:`.measured_rates` fitted one; elsewhere the level's latency stands."""
    return {index: own.floor_s for index, (_, own, _) in enumerate(
        _rated_levels(backend_name, candidate, topology, links, measured)) if own is not None and own.floor_s is not None}


def _rated_levels(backend_name: str, candidate, topology: Topology, links: Topology,
                  measured: dict[tuple[str, tuple, int], MeasuredRate] | None):
    """(level, the rate measured or fitted on its physical link or None, the backend's published rate for its fabric
    or None) for each level of ``links``, innermost first."""
    profile = PLANNING_PROFILES[backend_name]
    rates = {rate.fabric: rate for rate in profile.published_rates(candidate)}
    settings = profile.rate_settings(candidate)
    for index, level in enumerate(links.levels):
        own = (measured or {}).get((backend_name, settings, physical_level(topology, links, index)))
        yield level, own, rates.get(level.fabric)


def _published_rows(rate) -> str:
    """The rows of docs/published_ep_figures.md a published rate cites ("4c", "4d.11")."""
    return "/".join(dict.fromkeys(re.findall(r"docs/published_ep_figures.md ([^:]+):", rate.source)))


def describe_kernel_rates(
    label: str, backend_name: str, candidate, topology: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None = None,
) -> str:
    """One backend's rate (as ``label`` configures it) on each of the topology's links, and where it comes from."""
    parts = []
    for level, own, rate in _rated_levels(backend_name, candidate, topology, topology, measured):
        if own is not None:
            floor = "" if own.floor_s is None else f" and {own.floor_s * 1e6:.3g} us per call"
            parts.append(f"{level.name}: {own.fraction:.2f} of nominal{floor}, {'fitted' if own.fitted else 'measured'} "
                         f"({own.source})")
        elif level.fabric is None:
            parts.append(f"{level.name}: nominal (the topology names no fabric)")
        elif rate is None:
            parts.append(f"{level.name}: nominal (no published {level.fabric} figure)")
        else:
            parts.append(f"{level.name}: dispatch {rate.dispatch_fraction:.2f}, combine {rate.combine_fraction:.2f} "
                         f"of nominal ({_published_rows(rate)})")
    return f"{label}: " + "; ".join(parts)


def rate_evidence(
    backend_name: str, candidate, topology: Topology, links: Topology,
    measured: dict[tuple[str, tuple, int], MeasuredRate] | None, crossed: int,
) -> tuple[str, ...]:
    """Where the rate of each link the backend's all-to-all crosses (the first ``crossed`` levels of ``links``)
    comes from, for the advice's evidence line: a published figure's row, a measurement's or a fit's source, the
    topology's own rate where it names no fabric, or the nominal rate (a bound) where nothing is published."""
    sources = []
    for level, own, rate in islice(_rated_levels(backend_name, candidate, topology, links, measured), crossed):
        if own is not None:
            sources.append(f"{level.name} {'fitted' if own.fitted else 'measured'} ({own.source})")
        elif level.fabric is None:
            sources.append(f"{level.name} at the topology's stated rate")
        elif rate is None:
            sources.append(f"{level.name} at the nominal rate, a bound (no published {level.fabric} figure)")
        else:
            sources.append(f"{level.name} docs/published_ep_figures.md {_published_rows(rate)}")
    return tuple(sources)


def link_busy(layout: Layout, topology: Topology, links: Topology, world_size: int,
              data_parallel_busy: dict[int, float]) -> tuple[tuple[str, float], ...]:
    """:attr:`Layout.link_busy`: each collective's time per step on the physical link of its group's outermost
    level (an all-to-all's on its outermost level, whose bytes set its time; over a backend's kernel-domain
    split, the next level's link)."""
    levels = topology.rank_levels(world_size)
    busy = dict(data_parallel_busy)
    costs = layout.costs
    if layout.ep > 1:
        physical = physical_level(topology, links, links.rank_levels(world_size)[layout.ep - 1])
        a2a = layout._per_step(lambda recomputed: costs.all_to_alls(recomputed) * costs.a2a)
        busy[physical] = busy.get(physical, 0.0) + a2a
        ep_level = levels[layout.ep - 1]
        busy[ep_level] = busy.get(ep_level, 0.0) + layout.replica_s
    if layout.efsdp > 1:
        gather_level = levels[(layout.efsdp - 1) * layout.ep]
        fsdp = layout.dispatches * layout.moe_layers * (costs.all_gathers * costs.all_gather + costs.reduce_scatter)
        busy[gather_level] = busy.get(gather_level, 0.0) + fsdp
    return tuple((topology.levels[level].name, seconds) for level, seconds in sorted(busy.items()) if seconds > 0)
