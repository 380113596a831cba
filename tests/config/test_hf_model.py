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


def _edited(tmp_path: Path, base: Path = GPT_OSS_120B, **changes) -> Path:
    config = json.loads(base.read_text())
    for field, value in changes.items():
        if value is None:
            del config[field]
        else:
            config[field] = value
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
    ({"model_type": "llama4"}, "model_type 'llama4' is not priced: use a config of deepseek_v3, gpt_oss, qwen3_moe, "
                               "mixtral"),
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


@pytest.mark.parametrize("flags, needed", [([], "--topology"), (["--topology", "gb200_nvl72", "--emit-config", "x.toml"],
                                                                 "no --emit-config")])
def test_the_cli_gives_only_the_layout_advice_for_it(capsys, flags, needed):
    with pytest.raises(SystemExit):
        plan.main(["--hf-config", str(GPT_OSS_120B), *flags, "--job.config_file", "train_configs/debug_model.toml"])
    assert capsys.readouterr().err == ("error: --hf-config prices a model by its FLOPs and bytes in the layout "
                                       f"advice: use it with {needed}\n")


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
