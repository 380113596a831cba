"""The map from ``[parallelism] expert_parallel_comm_backend`` to its ``ExpertParallel`` class.

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
