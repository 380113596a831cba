"""What a job config fixes about its model, read without changing torchtitan's flavour registry."""

import copy

from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_ext.config import load_job_config, model_class_and_args
from torchtitan_ext.training import prepare


def test_checking_a_job_leaves_the_flavours_registered_arguments_as_they_were():
    """torchtitan's update_from_config sets max_seq_len to the job's in place: a process that checks a job of 16
    tokens, then one of 256, used to warn the second that it "exceeds original maximum 16"."""
    prepare()
    registered = get_train_spec("deepseek_v3").model_args["debugmodel"]
    before = copy.deepcopy(registered)
    job_config = load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel",
                                  "--training.seq_len", "16"], "cpu", 2)
    _, model_args = model_class_and_args(job_config)
    assert model_args.max_seq_len == 16
    assert repr(vars(registered)) == repr(vars(before))
