"""The backend table: each ``[parallelism] expert_parallel_comm_backend`` name with its ``ExpertParallel`` class
and its planning profile, and the named sets of variants every test, benchmark and check runs.

Adding a backend is one entry in :data:`TABLE` plus its own module (its class, its variants, its planning
profile). Shared code looks a backend up here and never branches on its name; a test
(``tests/ep/test_backend_table.py``) fails where a list of backend or variant names is written out elsewhere.
"""

from dataclasses import dataclass

from torchtitan_ext.config import comm_backend
from torchtitan_ext.ep.base import RoutedExpertParallel, Variant
from torchtitan_ext.ep.deepep import DeepEPExpertParallel, DeepEPPlanningProfile
from torchtitan_ext.ep.hybridep import HybridEPExpertParallel, HybridEPPlanningProfile
from torchtitan_ext.ep.nccl import NcclExpertParallel, NcclPlanningProfile
from torchtitan_ext.ep.ncclep import NcclEPExpertParallel, NcclEPPlanningProfile
from torchtitan_ext.ep.planning_profile import PlanningProfile


@dataclass(frozen=True)
class Backend:
    name: str
    """The name ``expert_parallel_comm_backend`` takes."""
    expert_parallel: type[RoutedExpertParallel]
    """What training applies to the routed experts."""
    planning_profile: type[PlanningProfile]
    """What the planning tools price it by (never read by a training step)."""


TABLE = (
    Backend("nccl", NcclExpertParallel, NcclPlanningProfile),
    Backend("deepep", DeepEPExpertParallel, DeepEPPlanningProfile),
    Backend("hybridep", HybridEPExpertParallel, HybridEPPlanningProfile),
    Backend("ncclep", NcclEPExpertParallel, NcclEPPlanningProfile),
)

BACKENDS: dict[str, type[RoutedExpertParallel]] = {backend.name: backend.expert_parallel for backend in TABLE}
"""Backend name -> its ``ExpertParallel`` class."""
PLANNING_PROFILES: dict[str, type[PlanningProfile]] = {backend.name: backend.planning_profile for backend in TABLE}
"""Backend name -> its planning profile."""
VARIANTS: dict[str, Variant] = {name: variant for backend in TABLE
                                for name, variant in backend.expert_parallel.variants.items()}
"""Every backend's named variants (:attr:`RoutedExpertParallel.variants`), in table order."""


def backend_class(job_config) -> type[RoutedExpertParallel]:
    """The ``ExpertParallel`` class the job config selects."""
    return BACKENDS[comm_backend(job_config)]


def planning_profile(job_config) -> type[PlanningProfile]:
    """The planning profile of the backend the job config selects."""
    return PLANNING_PROFILES[comm_backend(job_config)]


def variant_backend(variant: str) -> str:
    """The backend name variant ``variant`` selects."""
    return next(backend.name for backend in TABLE if variant in backend.expert_parallel.variants)


def backend_variants() -> dict[str, list[str]]:
    """{variant name: the job-config overrides that select it}, for every variant. Each runs on the kernels its
    ``implementation`` resolves to (the reference kernels on a CPU)."""
    return {name: ["--parallelism.expert_parallel_comm_backend", variant_backend(name), *variant.overrides]
            for name, variant in VARIANTS.items()}


def _named(keep) -> tuple[str, ...]:
    return tuple(name for name, variant in VARIANTS.items() if keep(variant))


DEFAULT_VARIANTS = tuple(BACKENDS)
"""Each backend in its default settings (its variant named as the backend)."""
CPU_VARIANTS = _named(lambda variant: variant.reference_kernels)
"""The variants a CPU runs (on the reference kernels): every one but those only the deep_ep double runs."""
MATRIX_VARIANTS = _named(lambda variant: variant.reference_kernels and variant.in_matrix)
"""One variant per kernel family, for the costliest matrices (the gradient matrix, the benches' defaults)."""
DROPLESS_WHEN_PADDED = _named(lambda variant: variant.reference_kernels and not variant.may_drop_when_padded)
"""The CPU variants that keep every pair with groups padded (an MXFP8 pad multiple of 32)."""
KERNEL_LIBRARY_BACKENDS = tuple(dict.fromkeys(variant_backend(name) for name, variant in VARIANTS.items()
                                              if variant.library_class))
"""The backends whose kernels come from a library (deep_ep), each with an ``implementation`` knob."""
LIBRARY_VARIANTS: dict[str, tuple[str, ...]] = {
    library_class: _named(lambda variant, wanted=library_class: variant.library_class == wanted)
    for library_class in dict.fromkeys(variant.library_class for variant in VARIANTS.values() if variant.library_class)
}
"""deep_ep class -> the variants that call it where the real library runs."""
