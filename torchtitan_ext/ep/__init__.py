"""Expert-parallel backends: one ``ExpertParallel`` subclass per backend.

``BACKENDS`` is the single map from ``[parallelism] expert_parallel_comm_backend``
to its class; shared code looks the class up here and never branches on the name.
"""

from torchtitan_ext.config import comm_backend
from torchtitan_ext.ep.base import MoEShape, RoutedExpertParallel
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


__all__ = [
    "BACKENDS",
    "backend_class",
    "DeepEPExpertParallel",
    "HybridEPExpertParallel",
    "MoEShape",
    "NcclExpertParallel",
    "RoutedExpertParallel",
]
