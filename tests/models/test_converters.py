"""The low-precision converters' refusals: one line each, at config time, naming the field and the fix."""

import pytest

import torchtitan_ext.training  # noqa: F401  (every section and check, the converters' among them)
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.models.converters import RECIPES, recipe_problem

DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]


@pytest.mark.parametrize("converter, capability, accepted", [
    ("quantize.grouped_mm.mx", (10, 0), True),
    ("quantize.grouped_mm.mx", (10, 3), True),
    ("quantize.grouped_mm.mx", (9, 0), False),
    ("quantize.grouped_mm.mx", (12, 0), False),
    ("quantize.grouped_mm.float8", (9, 0), True),
    ("quantize.grouped_mm.float8", (8, 9), False),
])
def test_a_gpu_outside_the_recipes_compute_capabilities_is_refused(converter, capability, accepted, monkeypatch):
    # a torchao built with the sm100 kernels (this CPU machine's is not: the next test)
    monkeypatch.setattr("torchao.prototype.moe_training.mxfp8_grouped_mm._SM100_KERNELS_AVAILABLE", True)
    problem = recipe_problem(RECIPES[converter], "cuda", capability)
    assert (problem is None) == accepted
    if not accepted:
        assert problem.startswith(f"{converter} needs a GPU of sm") and f"this one is sm{capability[0]}{capability[1]}" \
            in problem


def test_an_sm100_gpu_with_a_torchao_built_without_its_kernels_is_refused(monkeypatch):
    monkeypatch.setattr("torchao.prototype.moe_training.mxfp8_grouped_mm._SM100_KERNELS_AVAILABLE", False)
    assert recipe_problem(RECIPES["quantize.grouped_mm.mx"], "cuda", (10, 0)) == (
        "quantize.grouped_mm.mx runs torchao's sm100 kernels, which this torchao build lacks: install the torchao 0.18 "
        "wheel built for CUDA 12.8 or newer")


@pytest.mark.parametrize("capability, accepted", [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_float8_linears_need_an_sm89_gpu_unless_emulated(capability, accepted, monkeypatch):
    from torchtitan_ext.config import parse
    from torchtitan_ext.models import converters

    monkeypatch.setattr(converters, "_cuda_capability", lambda: capability)
    job = parse(DEBUG_JOB + ["--model.converters", "quantize.linear.float8"])
    problem = converters._float8_linear_problem(job, "cuda")
    assert (problem is None) == accepted
    if not accepted:
        assert f"this machine has an sm{capability[0]}{capability[1]} GPU" in problem
        job.quantize.linear.float8.emulate = True
        assert converters._float8_linear_problem(job, "cuda") is None
        # a recipe past torchtitan's gate is torchao's unemulated one, which this GPU cannot run (a CPU can)
        job.quantize.linear.float8.recipe_name = "rowwise"
        assert "emulate with no quantize.linear.float8.recipe_name" in converters._float8_linear_problem(job, "cuda")
        assert converters._float8_linear_problem(job, "cpu") is None


@pytest.mark.parametrize("overrides, message", [
    (["--model.converters", "quantize.grouped_mm.mx"],
     r"^quantize.grouped_mm.mx is in model.converters but quantize.grouped_mm.mx.fqns is empty: set "
     r"--quantize.grouped_mm.mx.fqns experts \(the routed experts' modules\)$"),
    (["--model.converters", "quantize.grouped_mm.mx,quantize.linear.float8", "--quantize.grouped_mm.mx.fqns",
      "experts"],
     r"^model.converters = .* mixes float8 and mx: torchtitan quantizes dense and MoE layers in one type; keep the "
     r"converters of one$"),
    (["--model.converters", "quantize.linear.float8"],
     r"^model.converters has quantize.linear.float8, whose float8 linears need an sm89 GPU or newer, and this machine "
     r"has a CPU: set quantize.linear.float8.emulate to emulate them, or remove it$"),
    (["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "--compile.enable",
      "--compile.components", "model"],
     r"^model.converters has quantize.linear.float8, .* set quantize.linear.float8.emulate with the model "
     r"uncompiled \(compile.components without model\) to emulate them, or remove it$"),
])
def test_a_converter_that_cannot_run_here_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(DEBUG_JOB + overrides, device_type="cpu", world_size=2)


def test_grouped_converters_refuse_experts_whose_forward_would_not_run_them(monkeypatch):
    from torchtitan_ext.models import converters

    monkeypatch.setattr(converters, "ROUTED_EXPERTS", {})  # as for a model whose experts are none of torchtitan's
    with pytest.raises(ConfigError, match=r"^model.converters has quantize.grouped_mm.mx, whose grouped GEMMs serve "
                                          r", not deepseek_v3's GroupedExperts: remove quantize.grouped_mm.mx$"):
        load_job_config(DEBUG_JOB + ["--model.converters", "quantize.grouped_mm.mx", "--quantize.grouped_mm.mx.fqns",
                                     "experts"], device_type="cpu", world_size=2)


def test_grouped_converters_refuse_a_tensor_parallel_split_their_blocks_cannot_tile():
    """GPT-OSS's debug experts have hidden size 128: TP 4 leaves 32 per rank, a block; TP 8 leaves 16."""
    torchtitan_ext.training.prepare()  # our train specs: the debug config's flavour, debugmodel_small, is ours
    mxfp8 = ["--job.config_file", "train_configs/gpt_oss_debug_model.toml", "--parallelism.expert_parallel_degree", "1",
             "--model.converters", "quantize.grouped_mm.mx", "--quantize.grouped_mm.mx.fqns", "experts"]
    load_job_config(mxfp8 + ["--parallelism.tensor_parallel_degree", "4"], device_type="cpu", world_size=4)
    with pytest.raises(ConfigError, match=r"^quantize.grouped_mm.mx quantizes the routed experts' GEMMs in blocks of "
                                          r"32: their hidden size 128 over parallelism.tensor_parallel_degree = 8 "
                                          r"leaves 16 per rank: choose a degree that leaves a multiple of 32$"):
        load_job_config(mxfp8 + ["--parallelism.tensor_parallel_degree", "8"], device_type=None, world_size=8)


@pytest.mark.parametrize("converter, rows", [("quantize.grouped_mm.mx", 32), ("quantize.grouped_mm.float8", 16)])
def test_every_backend_pads_expert_groups_to_the_recipes_block(converter, rows):
    """The backends' dispatch derives its pad multiple from the job's converters, as training builds the layers."""
    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.ep.backends import backend_variants
    from torchtitan_ext.ep import backend_class

    shape = MoEShape(hidden_dim=256, num_experts=8, top_k=2, max_tokens_per_rank=512)
    for variant, overrides in backend_variants().items():
        job_config = parse(DEBUG_JOB + overrides + ["--model.converters", converter,
                                                    f"--{converter}.fqns", "experts"])
        style = backend_class(job_config).layer_factory(job_config, shape)(score_before_experts=False)
        assert style.pad_multiple == rows, variant
