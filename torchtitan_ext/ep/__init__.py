"""Expert-parallel backends: one ``ExpertParallel`` subclass per backend, each owning its config section.

Owns: the backend contract (:mod:`.base`), one module per backend
(:mod:`.nccl`, :mod:`.deepep`, :mod:`.hybridep`, :mod:`.ncclep`: its ``ExpertParallel`` class and, beside it, its
:class:`~.planning_profile.PlanningProfile` for the planning tools) with its custom ops in
:mod:`.ops` (registered at first use), the kernels behind DeepEP, HybridEP and NCCL EP
(:mod:`.kernels`: deep_ep and nccl.ep adapters, the reference implementation and NCCL EP's double), the routed experts' compute
(:mod:`.experts`), expert replication (:mod:`.replication`: replica slots that copy hot experts), and the
backend checks of a job config (:mod:`.validation`). Importing it registers
each backend's section and the checks with :mod:`torchtitan_ext.config`.

May import: :mod:`torchtitan_ext.config`, :mod:`torchtitan_ext.runtime`
(see the tiers in :mod:`torchtitan_ext`).
"""

from torchtitan_ext.config import MoEShape, register_check, register_section
from torchtitan_ext.ep.backends import backend_class, BACKENDS, PLANNING_PROFILES, planning_profile
from torchtitan_ext.ep.base import RoutedExpertParallel
from torchtitan_ext.ep.deepep import DeepEPExpertParallel
from torchtitan_ext.ep.hybridep import HybridEPExpertParallel
from torchtitan_ext.ep.nccl import NcclExpertParallel
from torchtitan_ext.ep.ncclep import NcclEPExpertParallel
from torchtitan_ext.ep.replication.experts import check_replica_experts
from torchtitan_ext.ep.replication.plan import check_replication, ExpertReplication, REPLICATION_RANGES
from torchtitan_ext.ep.validation import check_backend



def _register_config() -> None:
    for backend in BACKENDS.values():
        if backend.config_section is not None:
            register_section(backend.config_section, backend.Config, backend.config_ranges)
    register_section("expert_replication", ExpertReplication, REPLICATION_RANGES)
    register_check(check_replication)
    register_check(check_replica_experts)
    register_check(check_backend)


_register_config()

__all__ = [
    "BACKENDS",
    "backend_class",
    "DeepEPExpertParallel",
    "HybridEPExpertParallel",
    "MoEShape",
    "NcclEPExpertParallel",
    "NcclExpertParallel",
    "PLANNING_PROFILES",
    "planning_profile",
    "RoutedExpertParallel",
]
