"""The map from ``[parallelism] expert_parallel_comm_backend`` to its ``ExpertParallel`` class and to its
planning profile, and the named variants every test, benchmark and check runs (:func:`backend_variants`).

Shared code looks the class up here and never branches on the backend's name.
"""

from torchtitan_ext.config import comm_backend
from torchtitan_ext.ep.base import RoutedExpertParallel
from torchtitan_ext.ep.deepep import DeepEPExpertParallel, DeepEPPlanningProfile
from torchtitan_ext.ep.hybridep import HybridEPExpertParallel, HybridEPPlanningProfile
from torchtitan_ext.ep.nccl import NcclExpertParallel, NcclPlanningProfile
from torchtitan_ext.ep.planning_profile import PlanningProfile

BACKENDS: dict[str, type[RoutedExpertParallel]] = {
    "nccl": NcclExpertParallel,
    "deepep": DeepEPExpertParallel,
    "hybridep": HybridEPExpertParallel,
}

PLANNING_PROFILES: dict[str, type[PlanningProfile]] = {
    "nccl": NcclPlanningProfile,
    "deepep": DeepEPPlanningProfile,
    "hybridep": HybridEPPlanningProfile,
}
"""What the planning tools price each backend of :data:`BACKENDS` by (never read by a training step)."""


def backend_class(job_config) -> type[RoutedExpertParallel]:
    """The ``ExpertParallel`` class the job config selects."""
    return BACKENDS[comm_backend(job_config)]


def planning_profile(job_config) -> type[PlanningProfile]:
    """The planning profile of the backend the job config selects."""
    return PLANNING_PROFILES[comm_backend(job_config)]


def backend_variants() -> dict[str, list[str]]:
    """{variant name: the job-config overrides that select it}: every backend's
    :attr:`~torchtitan_ext.ep.base.RoutedExpertParallel.variants`, in the order of :data:`BACKENDS`. Each runs on
    the kernels its ``implementation`` resolves to (the reference kernels on a CPU)."""
    return {
        variant: ["--parallelism.expert_parallel_comm_backend", name, *overrides]
        for name, backend in BACKENDS.items()
        for variant, overrides in backend.variants.items()
    }
