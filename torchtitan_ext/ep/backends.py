"""The map from ``[parallelism] expert_parallel_comm_backend`` to its ``ExpertParallel`` class, and the named
variants every test, benchmark and check runs (:func:`backend_variants`).

Shared code looks the class up here and never branches on the backend's name.
"""

from torchtitan_ext.config import comm_backend
from torchtitan_ext.ep.base import RoutedExpertParallel
from torchtitan_ext.ep.deepep import DeepEPExpertParallel
from torchtitan_ext.ep.hybridep import HybridEPExpertParallel
from torchtitan_ext.ep.nccl import NcclExpertParallel

BACKENDS: dict[str, type[RoutedExpertParallel]] = {
    "nccl": NcclExpertParallel,
    "deepep": DeepEPExpertParallel,
    "hybridep": HybridEPExpertParallel,
}


def backend_class(job_config) -> type[RoutedExpertParallel]:
    """The ``ExpertParallel`` class the job config selects."""
    return BACKENDS[comm_backend(job_config)]


def backend_variants() -> dict[str, list[str]]:
    """{variant name: the job-config overrides that select it}: every backend's
    :attr:`~torchtitan_ext.ep.base.RoutedExpertParallel.variants`, in the order of :data:`BACKENDS`. Each runs on
    the kernels its ``implementation`` resolves to (the reference kernels on a CPU)."""
    return {
        variant: ["--parallelism.expert_parallel_comm_backend", name, *overrides]
        for name, backend in BACKENDS.items()
        for variant, overrides in backend.variants.items()
    }
