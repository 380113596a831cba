"""What each EP backend's kernels achieve on a link, as their authors publish it.

A :class:`PublishedRate` is one published dispatch/combine figure (quoted, with its source, in
docs/published_ep_figures.md at the row it names), read as the fraction of its link's nominal rate that
the bytes leaving a rank reach. Each backend's planning profile lists its figures
(:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.published_rates`); the layout advisor prices that
backend's all-to-all bytes at a link's nominal rate times that fraction. See docs/planning.md, "How each backend's all-to-all is priced".
"""

from dataclasses import dataclass

FABRICS = {
    "nvlink": "NVLink through one node's NVSwitch (HGX/DGX, up to 8 GPUs)",
    "mnnvl": "multi-node NVLink (GB200 NVL72: one NVLink domain across the rack's trays)",
    "rdma": "an RDMA NIC per GPU (InfiniBand or RoCE) between nodes",
}
"""The link kinds a topology level may name (its ``fabric``), for which figures are published."""


@dataclass(frozen=True)
class PublishedRate:
    """One published dispatch/combine figure of a backend's kernels on one kind of link."""

    fabric: str
    """Which link the figure was measured on: a key of :data:`FABRICS`."""
    dispatch_GBps: float
    """Dispatch bandwidth as published, GB/s per GPU and direction (BF16 where both are published). > 0."""
    combine_GBps: float
    """Combine bandwidth as published, GB/s per GPU and direction. > 0."""
    nominal_GBps: float
    """The nominal per-direction rate of the link it was measured on, GB/s per GPU. > 0."""
    units: int | None
    """Ranks (NVLink) or nodes (RDMA) the figure's bytes spread over, its own among them; None when the
    figure already counts only bytes that leave (a bus bandwidth)."""
    sms: int | None
    """Streaming multiprocessors the kernels used, as published (None: not stated)."""
    source: str
    """Where it is quoted: docs/published_ep_figures.md's section and row, and the publication."""

    def fraction(self, figure_GBps: float) -> float:
        """``figure_GBps`` as the fraction of the nominal rate that bytes leaving the rank reach."""
        leaving = 1.0 if self.units is None else (self.units - 1) / self.units
        return figure_GBps * leaving / self.nominal_GBps

    @property
    def dispatch_fraction(self) -> float:
        return self.fraction(self.dispatch_GBps)

    @property
    def combine_fraction(self) -> float:
        return self.fraction(self.combine_GBps)


def nearest_sms(rates: tuple[PublishedRate, ...], sms: int | None) -> tuple[PublishedRate, ...]:
    """One figure per fabric: the one measured with the SM count nearest ``sms`` (ties: the fewer SMs;
    ``sms`` None: the fewest, as a library's own minimum)."""
    chosen: dict[str, PublishedRate] = {}
    for rate in rates:
        current = chosen.get(rate.fabric)
        if current is None or _sms_key(rate, sms) < _sms_key(current, sms):
            chosen[rate.fabric] = rate
    return tuple(chosen.values())


def _sms_key(rate: PublishedRate, sms: int | None) -> tuple[int, int]:
    published = rate.sms or 0
    return (published, 0) if sms is None else (abs(published - sms), published)
