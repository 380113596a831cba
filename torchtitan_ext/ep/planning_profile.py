"""What the planner needs to price an EP backend, apart from what runs.

Each backend module declares its :class:`PlanningProfile` beside its ``ExpertParallel`` class, so that one backend
keeps one home; :data:`torchtitan_ext.ep.backends.PLANNING_PROFILES` maps the backend's config name to it. Only
the planning tools read a profile (:mod:`torchtitan_ext.planning`, the placement search in
:mod:`torchtitan_ext.balancing`): a training step never does.
"""

from typing import ClassVar

from torchtitan_ext.config import MoEShape
from torchtitan_ext.ep.published_rates import PublishedRate


def nvlink_domain_at_ep(domain: int | None, ep: int) -> dict[str, object]:
    """A section's ``ranks_per_nvlink_domain`` at EP degree ``ep``, where the job's (``domain``) cannot stand: an EP
    group smaller than the job's domain, and dividing it, lies within one NVLink domain, so all ``ep`` of its ranks
    share NVLink. Any other degree keeps the job's value (and the config checks refuse it where it does not fit)."""
    if domain is not None and ep < domain and domain % ep == 0:
        return {"ranks_per_nvlink_domain": ep}
    return {}


class PlanningProfile:
    """A backend as the layout advisor, the memory plan and the calibration price it. Every hook is a classmethod
    of the job config (or a ClassVar); the defaults describe a backend with no kernels of its own."""

    sends_each_token_once_per_rank: ClassVar[bool] = False
    """How dispatch moves tokens, for the layout advisor's cost model: True when a token goes
    once to each rank holding any of its experts (and over RDMA once per node or NVLink
    domain, forwarded inside it); False when each (token, expert) pair travels on its own."""

    moves_tokens_with_collective_all_to_all: ClassVar[bool] = False
    """Whether dispatch and combine are the collective library's own all-to-all (torch.distributed's
    all_to_all_single, NCCL on GPUs), whose transport nccl-tests' alltoall_perf times: such a log
    calibrates this backend (:mod:`torchtitan_ext.planning.measured_rates`)."""

    test_log_settings: ClassVar[tuple[tuple, ...]] = ()
    """The :meth:`rate_settings` whose kernels the library's own test script times (its log calibrates them:
    :mod:`torchtitan_ext.planning.kernel_test_log`); empty: the backend has no such script."""

    settings_legend: ClassVar[str] = ""
    """What :meth:`settings_label` names, for the advisor's column legend ("" where it prices no alternative)."""

    @classmethod
    def nvlink_domain_ranks(cls, job_config) -> int | None:
        """EP ranks per NVLink domain the backend is configured for (its section's ``ranks_per_nvlink_domain``), or
        None if it has no such notion."""
        return None

    @classmethod
    def settings_at_ep(cls, job_config, ep: int) -> dict[str, object]:
        """Settings of the backend's own section that follow from the EP degree: what a layout at ``ep`` sets in
        place of the job's values, {field: value} (empty: the job's hold at any degree). By default, the section's
        ``ranks_per_nvlink_domain`` where :meth:`nvlink_domain_ranks` reads one (:func:`nvlink_domain_at_ep`)."""
        return nvlink_domain_at_ep(cls.nvlink_domain_ranks(job_config), ep)

    @classmethod
    def kernel_nvlink_ranks(cls, job_config) -> int | None:
        """At most how many consecutive EP ranks the backend's kernels reach over NVLink (the others over the
        network, even inside one NVLink domain), or None when they use every NVLink peer the machine has. The
        layout advisor prices the all-to-all's links by it."""
        return cls.nvlink_domain_ranks(job_config)

    @classmethod
    def advised_alternatives(cls, job_config, fabrics: tuple[str | None, ...]) -> tuple[dict[str, object], ...]:
        """Settings of the backend's own section that the layout advisor prices beside the job's, each
        {field: value}: the choices its published figures can tell apart. ``fabrics``: the link kinds
        (:data:`~torchtitan_ext.ep.published_rates.FABRICS`) of the links the layout's all-to-all crosses,
        innermost first (None for a link the topology names no fabric for; empty without an all-to-all).
        Empty: the job's settings only."""
        return ()

    @classmethod
    def settings_label(cls, settings: dict[str, object]) -> str:
        """How the advisor's table names an alternative of :meth:`advised_alternatives` after the backend."""
        return " ".join(str(value) for value in settings.values())

    @classmethod
    def rate_settings(cls, job_config) -> tuple:
        """The settings of the backend that change how fast its kernels move bytes (beyond SMs): a measured rate
        applies to the layouts whose settings are these. Empty: one rate for the backend."""
        return ()

    @classmethod
    def communication_sms(cls, job_config) -> float | None:
        """SMs the backend's dispatch and combine kernels hold while they run, as configured (the mean of the two
        where they differ), which GEMMs running beside them lose; None where the library picks them at run time."""
        return None

    @classmethod
    def published_rates(cls, job_config) -> tuple[PublishedRate, ...]:
        """What the backend's kernels achieve per kind of link as configured (API, SMs), one figure per
        fabric, from the library's own publications; a link without one is priced at its nominal rate."""
        return ()

    @classmethod
    def planned_modes(cls, job_config, shape: MoEShape, pad_multiple: int) -> list[tuple[str, int | None]]:
        """The memory plan's rows for the backend: (mode label, rows per dispatch when the mode fixes them,
        dropping the pairs beyond; None when the rows follow the routing and nothing is dropped).
        ``pad_multiple``: the row multiple of each expert group."""
        return [("", None)]

    @classmethod
    def planned_buffer(cls, job_config, shape: MoEShape) -> tuple[int | None, str]:
        """(bytes or None if unknown here, how they are counted) of the communication buffer one rank holds."""
        return 0, "no persistent buffer: each all-to-all allocates its rows"

    @classmethod
    def counted_settings(cls, job_config, shape: MoEShape, ep: int) -> dict[str, object]:
        """Settings of the backend's section under which its layer, run in a group of one, allocates as many rows
        as one rank of an EP group of ``ep`` does: the layout advisor counts its local traffic so
        (:mod:`torchtitan_ext.planning.local_traffic`). Empty where a group of one allocates the same."""
        return {}

    @classmethod
    def traffic_settings(cls, section) -> object:
        """What of the backend's config ``section`` shapes the bytes its layer moves outside the kernels in a group of
        one: the layout advisor counts that traffic once per distinct value
        (:mod:`torchtitan_ext.planning.local_traffic`; each count runs the layer, seconds at DeepSeek-V3's shape). By
        default the whole section; a backend whose section also holds what only its kernels read (their SMs, the
        NVLink domain) names the rest."""
        return repr(section)

    @classmethod
    def planned_replica_region(cls, job_config) -> int:
        """Bytes one rank reserves beside its buffer for the backend's own kernels to carry
        ``expert_replication``'s replicas, where they can (within one NVLink domain); 0 where replicas move by
        all-to-all."""
        return 0
