"""Every parameter of each model is set by its ``init_weights``, as the trainer builds it (on the meta device, then
materialized uninitialized): none keeps the memory it was materialized in, so runs from one seed are one run.
(torchtitan 0.2.2's GPT-OSS left its router's bias uninitialized: routing, and the loss, differed run to run.)"""

import pytest
import torch

from tests.helpers import DEBUG_FLAVOURS, REPO_ROOT
from torchtitan_ext.training import prepare


@pytest.mark.parametrize("name", DEBUG_FLAVOURS)
def test_init_weights_sets_every_parameter(name):
    from torchtitan_ext.config import load_job_config, meta_model

    prepare()
    job_config = load_job_config(["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml"),
                                  "--model.name", name, "--model.flavor", DEBUG_FLAVOURS[name]], "cpu")
    model = meta_model(job_config)  # as the trainer builds it
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))  # what uninitialized memory may hold
        model.init_weights(buffer_device=None)
    unset = [name for name, parameter in model.named_parameters() if parameter.isnan().any()]
    assert not unset, unset
