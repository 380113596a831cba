"""A backend's config section and checks register on import; its custom ops only when it builds a layer."""

import importlib
import re
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT, run_job

PROBE = """
import torch
from torchtitan_ext.config import parse
from torchtitan_ext.ep import BACKENDS
import torchtitan_ext.training

def registered():
    return sorted(name for name in ("nccl_dispatch", "deepep_dispatch", "hybridep_dispatch")
                  if hasattr(torch.ops.torchtitan_ext, name))

job = parse(["--job.config_file", "train_configs/debug_model.toml",
             "--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.num_sms_dispatch", "8"])
print(job.hybridep.num_sms_dispatch, registered())
BACKENDS["hybridep"].sac_save_ops()
print(registered())
"""


@pytest.mark.slow
def test_parsing_a_config_registers_its_section_but_no_op():
    result = run_job([sys.executable, "-c", PROBE], cwd=REPO_ROOT, timeout_s=300)
    assert result.output.splitlines()[-2:] == ["8 []", "['hybridep_dispatch']"]


@pytest.mark.parametrize("version, refused", [("2.10.1+cu128", True), ("2.11.0+cu130", False), ("2.12.1", False),
                                              ("2.13.0.dev20261101+cu130", False), ("3.0.0", False)])
def test_a_torch_without_opaque_arguments_is_refused_in_one_line(version, refused):
    from torchtitan_ext.ep.ops import require_opaque_arguments

    if not refused:
        require_opaque_arguments(version)
        return
    with pytest.raises(ImportError, match=rf"torch {re.escape(version)} is installed.*pip install torch==2\.13\.0"):
        require_opaque_arguments(version)


@pytest.mark.parametrize("module, op_name", [("deepep", "deepep_dispatch"), ("deepep", "deepep_combine"),
                                             ("hybridep", "hybridep_dispatch"), ("nccl", "nccl_combine")])
def test_an_op_returning_an_opaque_object_is_registered_as_torch_infers_it(module, op_name):
    """Spelled out for torch 2.11 and 2.12, the schema must be the one torch 2.13 infers."""
    op = getattr(importlib.import_module(f"torchtitan_ext.ep.ops.{module}"), op_name)
    registered = getattr(torch.ops.torchtitan_ext, op_name).default._schema
    try:
        inferred = torch.library.infer_schema(op._init_fn, mutates_args=(), op_name=f"torchtitan_ext::{op_name}")
    except ValueError:  # torch 2.11 and 2.12, where this schema is spelled out: 2.13's inference is the reference
        pytest.skip(f"torch {torch.__version__} infers no opaque return (2.13 does): nothing to compare with")
    assert registered == torch._C.parse_schema(inferred)


def test_no_backend_class_carries_a_planning_hook():
    """What the planners price a backend by lives in its planning profile (the backend table pairs them), never on
    the ExpertParallel class that training applies."""
    from torchtitan_ext.ep.backends import TABLE
    from torchtitan_ext.ep.planning_profile import PlanningProfile

    hooks = {name for name in vars(PlanningProfile) if not name.startswith("_")}
    for backend in TABLE:
        assert not hooks & set(dir(backend.expert_parallel)), (backend.name, hooks & set(dir(backend.expert_parallel)))
