"""Contract: the layout advisor prices a pipeline-parallel job as torchtitan 0.2.2 splits it, by its busiest
rank, stretched by its schedule's bubble; a split torchtitan would refuse is refused in one line."""

import pytest

from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.planning.job_shape import job_shape
from torchtitan_ext.planning.layout_advisor import advise
from torchtitan_ext.planning.pipeline_split import pipeline_split
from torchtitan_ext.planning.topology import load_topology

# torchtitan's DeepSeek-V3 debug model: 6 layers, layer 0 dense, 1-5 MoE; 4 sequences per rank, 1 per microbatch
DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]
PIPELINED = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]


def _job(*overrides: str):
    return load_job_config([*DEBUG_JOB, *overrides], device_type=None, world_size=4)


def test_a_looped_schedule_gives_each_rank_every_pp_th_stage():
    # 6 layers + embeddings + output = 8 units in 4 stages of 2; rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    split = pipeline_split(_job(*PIPELINED, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), 6)
    assert split.rank_modules == (
        ("tok_embeddings", "layers.0", "layers.3", "layers.4"),
        ("layers.1", "layers.2", "layers.5", "norm", "output"),
    )
    assert split.bubble == pytest.approx(1 / (2 * 4))  # (PP - 1) / (V x microbatches)


def test_a_v_schedule_gives_rank_r_stages_r_and_its_mirror():
    split = pipeline_split(_job(*PIPELINED, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"), 6)
    assert split.rank_modules == (
        ("tok_embeddings", "layers.0", "layers.5", "norm", "output"),
        ("layers.1", "layers.2", "layers.3", "layers.4"),
    )


def test_a_split_torchtitan_refuses_is_refused_in_one_line():
    job = _job(*PIPELINED, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
               "--parallelism.pipeline_parallel_layers_per_stage", "3")
    with pytest.raises(ConfigError, match=r"^3 pipeline stages do not divide .*pipeline_parallel_layers_per_stage") as e:
        pipeline_split(job, 6)
    assert "\n" not in str(e.value)


def test_a_pipelined_job_is_priced_by_its_busiest_rank_and_its_bubble():
    whole = job_shape(_job(), 4)
    piped = job_shape(_job(*PIPELINED, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), 4)
    # rank 1 runs MoE layers 1, 2 and 5 and the output layer: more than the mean rank's half of the model
    assert piped.moe_layers == 3
    assert piped.model_pass_flops / piped.work.tokens * 2 == pytest.approx(whole.pass_flops / whole.work.tokens)
    assert piped.pass_flops > piped.model_pass_flops
    assert piped.pipeline_bubble == pytest.approx(1 / 8)
    layouts, _ = advise([*DEBUG_JOB, *PIPELINED, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 4,
                        load_topology("hgx_h100_ib"))
    best = layouts[0]
    assert best.step_s >= (best.compute_s + best.moe_s) * (1 + 1 / 8)
    assert best.tflops_per_gpu == pytest.approx(piped.model_pass_flops * piped.dispatches / best.step_s / 1e12)


def test_fewer_microbatches_than_ranks_leave_an_interleaved_rank_waiting_between_its_chunks():
    # one microbatch, PP=2, V=2: (PP - 1 + (V - 1)(PP - m)) / (V m) = (1 + 1) / 2
    job = _job(*PIPELINED, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
               "--parallelism.pipeline_parallel_microbatch_size", "4")
    assert pipeline_split(job, 6).bubble == pytest.approx(1.0)
