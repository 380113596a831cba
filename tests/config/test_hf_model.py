"""A Hugging Face config.json as torchtitan model arguments (torchtitan_ext.config.hf_model): the public configs in
docs/hf_configs/ give torchtitan's own flavours of the same models, and a config this module cannot price is
refused in one line naming the field."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_ext import plan
from torchtitan_ext.config import ConfigError
from torchtitan_ext.config.hf_model import hf_model_args

GPT_OSS_120B = Path("docs/hf_configs/gpt-oss-120b.json")
DEEPSEEK_R1 = Path("docs/hf_configs/deepseek-r1.json")
QWEN3_30B = Path("docs/hf_configs/qwen3-30b-a3b.json")
MIXTRAL_8X7B = Path("docs/hf_configs/mixtral-8x7b.json")
LLAMA4_SCOUT = Path("docs/hf_configs/llama-4-scout-17b-16e.json")
# what the job's sequence length and torchtitan's choices of kernels set in a flavour, and the norms' epsilon
# (torchtitan's 671B keeps its default 1e-5 where the config says 1e-6): none changes a FLOP or a byte
NOT_SHAPE = {"max_seq_len", "attn_type", "attn_mask_type", "use_grouped_mm", "expert_parallel_comm_backend", "norm_eps"}


def _shape(model_args) -> dict:
    def without(fields: dict) -> dict:
        return {key: without(value) if isinstance(value, dict) else value
                for key, value in fields.items() if key not in NOT_SHAPE}
    return without(asdict(model_args))


@pytest.mark.parametrize("path, flavor", [(GPT_OSS_120B, "120b"), (DEEPSEEK_R1, "671B"), (QWEN3_30B, "30B-A3B")])
def test_a_public_config_gives_torchtitans_flavour_of_the_same_model(path, flavor):
    name, model_args = hf_model_args(path)
    assert _shape(model_args) == _shape(get_train_spec(name).model_args[flavor])


@pytest.mark.parametrize("path", [GPT_OSS_120B, DEEPSEEK_R1, QWEN3_30B, MIXTRAL_8X7B, LLAMA4_SCOUT])
def test_the_models_context_is_the_one_its_config_states(path):
    """torchtitan warns a job whose seq_len exceeds ``max_seq_len``: it must be the model's own context, not the
    model arguments' default (Qwen3's 4096 against Qwen3-30B-A3B's config, which states 40960)."""
    config = json.loads(path.read_text())
    stated = config.get("text_config", config)["max_position_embeddings"]
    assert hf_model_args(path)[1].max_seq_len == stated


def _edited(tmp_path: Path, base: Path = GPT_OSS_120B, text: dict | None = None, **changes) -> Path:
    """``base`` with ``changes`` (None deletes a field), and ``text``'s in its text_config."""
    config = json.loads(base.read_text())
    for fields, edits in ((config, changes), (config.get("text_config"), text or {})):
        for field, value in edits.items():
            if value is None:
                del fields[field]
            else:
                fields[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"num_local_experts": None}, "missing field(s) num_local_experts: a gpt_oss config.json states them"),
    ({"attention_sink_size": 4}, "field(s) attention_sink_size are not known to price a gpt_oss model: they may "
                                 "change its shape; remove them if they do not"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings = true: the torchtitan gpt_oss model builds an output layer "
                                    "apart from the embeddings; a model that differs there is not priced"),
    ({"layer_types": ["full_attention"] * 36}, 'layer_types = ["full_attention", "full_attention", '),
    ({"model_type": "llama5"}, "model_type 'llama5' is not priced: use a config of deepseek_v3, gpt_oss, qwen3_moe, "
                               "mixtral, llama4, llama4_text"),
    ({"base": MIXTRAL_8X7B, "sliding_window": 4096}, "sliding_window = 4096: the torchtitan qwen3 model builds full "
                                                     "causal attention in every layer"),
    ({"base": QWEN3_30B, "mlp_only_layers": [0, 1]}, "mlp_only_layers = [0, 1]: the torchtitan qwen3 model builds every "
                                                     "layer MoE"),
    ({"experts_per_token": 2}, "num_experts_per_tok 4 and experts_per_token 2 differ: make them one top-k"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "is not YaRN scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, "rope_scaling has no original_max_position_embeddings, "
                                                              "beta_fast, beta_slow: a YaRN config states them"),
    ({"base": DEEPSEEK_R1, "moe_layer_freq": 2}, "moe_layer_freq = 2: the torchtitan deepseek_v3 model builds every "
                                                 "layer after the first dense ones is MoE"),
    ({"base": DEEPSEEK_R1, "num_key_value_heads": 8}, "num_key_value_heads = 8: the torchtitan deepseek_v3 model "
                                                      "builds multi-head latent attention"),
    ({"base": LLAMA4_SCOUT, "text": {"moe_layers": list(range(1, 48, 2))}}, "text_config: moe_layers = [1, 3, 5, "),
    ({"base": LLAMA4_SCOUT, "text": {"intermediate_size": 4096, "interleave_moe_layer_step": 2,
                                     "moe_layers": list(range(1, 48, 2))}},
     "text_config: intermediate_size 4096 with intermediate_size_mlp 16384: torchtitan's Llama4"),
    ({"base": LLAMA4_SCOUT, "text": {"num_local_experts": None}}, "text_config: missing field(s) num_local_experts: a "
                                                                  "llama4_text config.json states them"),
    ({"base": LLAMA4_SCOUT, "text": {"interleave_moe_layer_step": 0}}, "text_config: interleave_moe_layer_step = 0: "),
    ({"base": LLAMA4_SCOUT, "text": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}},
     "text_config: rope_scaling has no low_freq_factor, high_freq_factor, original_max_position_embeddings: a Llama 3 "
     "config states them"),
])
def test_a_config_it_cannot_price_is_refused_naming_the_field(tmp_path, changes, message):
    path = _edited(tmp_path, **changes)
    with pytest.raises(ConfigError) as refused:
        hf_model_args(path)
    assert str(refused.value).startswith(f"--hf-config {path}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_file_that_is_not_a_config_is_refused(tmp_path):
    missing, text = tmp_path / "missing.json", tmp_path / "config.json"
    text.write_text("model_type = gpt_oss")
    for path, message in ((missing, "cannot read it (No such file or directory): give the path of a model's "
                                    "config.json"), (text, "not JSON (line 1: Expecting value): give a model's config.json")):
        with pytest.raises(ConfigError, match=f"^--hf-config {path}: " + message.replace("(", r"\(").replace(")", r"\)")):
            hf_model_args(path)


@pytest.mark.parametrize("flags, needed", [([], "--topology"), (["--topology", "gb200_nvl72", "--measure-compute"],
                                                                 "no --measure-compute")])
def test_the_cli_prices_it_by_flops_and_bytes(capsys, flags, needed):
    with pytest.raises(SystemExit):
        plan.main(["--hf-config", str(GPT_OSS_120B), *flags, "--job.config_file", "train_configs/debug_model.toml"])
    assert capsys.readouterr().err == ("error: --hf-config prices a model by its FLOPs and bytes in the layout "
                                       f"advice: use it with {needed}\n")


def test_a_flavour_naming_another_models_config_is_refused():
    """A job config's model.flavor 'hf:<path>' is read by the job itself: a config of another family is named."""
    from torchtitan_ext.config import load_job_config

    with pytest.raises(ConfigError, match=f"^model.flavor = 'hf:{GPT_OSS_120B}': that config.json is a gpt_oss model, "
                                          "not qwen3: set model.name = 'gpt_oss'$"):
        load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--model.name", "qwen3",
                         "--model.flavor", f"hf:{GPT_OSS_120B}"], "cpu")


def test_a_registered_config_is_the_jobs_model_wherever_a_job_config_is_read():
    """The flavour hf:<path> through load_job_config and the meta model: one GPT-OSS 120B expert's elements are its
    fused gate-up and down projections and their biases."""
    from torchtitan_ext.config import load_job_config, register_hf_model, routed_expert_elements

    overrides = register_hf_model(GPT_OSS_120B)
    assert overrides == ["--model.name", "gpt_oss", "--model.flavor", f"hf:{GPT_OSS_120B}"]
    job_config = load_job_config(["--job.config_file", "train_configs/debug_model.toml", *overrides],
                                 device_type=None, world_size=2)
    assert routed_expert_elements(job_config) == 2 * 2880 * 2880 + 2 * 2880 + 2880 * 2880 + 2880


def test_mixtral_is_priced_as_its_published_parameter_count():
    """torchtitan has no Mixtral: its Qwen3 with MoE layers, without the query and key norms, is the same model.
    Mixtral 8x7B's 46.7B parameters, to the parameter: embeddings and output 2 x 32,000 x 4,096, and per layer
    grouped-query attention (2 x 4,096^2 + 2 x 4,096 x 1,024), 8 experts of 3 x 4,096 x 14,336, the router and
    two norms; the final norm."""
    from torchtitan_ext.config import load_job_config, meta_model, register_hf_model

    overrides = register_hf_model(MIXTRAL_8X7B)
    job_config = load_job_config(["--job.config_file", "train_configs/debug_model.toml", *overrides],
                                 device_type=None, world_size=2)
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    expected = 2 * 32000 * 4096 + 32 * layer + 4096
    assert expected == 46_702_792_704
    assert sum(parameter.numel() for parameter in meta_model(job_config).parameters()) == expected


@pytest.mark.parametrize("text, flavor", [
    ({}, "17bx16e"),
    ({"intermediate_size_mlp": 12288}, "17bx16e"),  # every layer MoE: no dense MLP for it to size
    ({"num_local_experts": 128, "interleave_moe_layer_step": 2, "moe_layers": list(range(1, 48, 2))}, "17bx128e"),
])
def test_llama4s_text_model_builds_as_torchtitans_flavour(tmp_path, text, flavor):
    """torchtitan sizes Llama4's MLPs from its own knobs, so the meta models are compared parameter for parameter:
    Scout's config gives torchtitan's 17bx16e, and with Maverick's experts and layer pattern its 17bx128e. Scout's
    text model has 107,769,861,120 parameters: embeddings and output 2 x 202,048 x 5,120, and per layer attention
    (2 x 5,120^2 + 2 x 5,120 x 1,024), 16 experts and the shared one of 3 x 5,120 x 8,192, the router and two
    norms; the final norm."""
    import torch

    spec = get_train_spec("llama4")

    def shapes(model_args) -> dict:
        with torch.device("meta"):
            return {name: parameter.shape for name, parameter in spec.model_cls(model_args).named_parameters()}

    name, model_args = hf_model_args(_edited(tmp_path, LLAMA4_SCOUT, text))
    assert name == "llama4" and shapes(model_args) == shapes(spec.model_args[flavor])
    if not text:
        layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 17 * 3 * 5120 * 8192 + 16 * 5120 + 2 * 5120
        assert sum(shape.numel() for shape in shapes(model_args).values()) == 2 * 202048 * 5120 + 48 * layer + 5120


@pytest.mark.parametrize("family", ["mixtral", "llama4_text", "qwen3_moe"])
def test_an_hf_checkpoint_the_adapter_cannot_name_is_refused(tmp_path, family):
    """Mixtral and a text-only Llama 4 train as torchtitan's Qwen3 and Llama4, whose HF adapters name another
    family's tensors: loading or saving their HF checkpoints is refused in one line. Qwen3-MoE's own passes."""
    from torchtitan_ext.config import load_job_config, register_hf_model

    path = {"mixtral": MIXTRAL_8X7B, "qwen3_moe": QWEN3_30B}.get(family, tmp_path / "config.json")
    if family == "llama4_text":
        path.write_text(json.dumps(json.loads(LLAMA4_SCOUT.read_text())["text_config"]))
    args = ["--job.config_file", "train_configs/debug_model.toml", *register_hf_model(path), "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"]
    if family == "qwen3_moe":
        load_job_config(args, device_type=None, world_size=2)
        return
    with pytest.raises(ConfigError) as error:
        load_job_config(args, device_type=None, world_size=2)
    fields = "checkpoint.initial_load_in_hf and checkpoint.last_save_in_hf"
    assert str(error.value).startswith(f"{fields} with model.flavor = 'hf:{path}': ")
    assert str(error.value).endswith(f": start from and save DCP checkpoints (unset {fields})")
    assert "\n" not in str(error.value)
