"""A backend's config section and checks register on import; its custom ops only when it builds a layer."""

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

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
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["8 []", "['hybridep_dispatch']"]
