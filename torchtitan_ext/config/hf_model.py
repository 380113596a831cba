"""A model given by a Hugging Face ``config.json``, as torchtitan's own model arguments, for the planner to price.

:func:`register_hf_model` reads the file, maps its fields onto the torchtitan model family that builds the same
architecture (``model_type`` ``deepseek_v3`` onto torchtitan's DeepSeek-V3, ``gpt_oss`` onto its GPT-OSS,
``qwen3_moe`` onto its Qwen3 with MoE layers, ``mixtral`` onto the same without query and key norms, ``llama4``'s
text model (or a ``llama4_text`` config) onto its Llama4) and
registers the arguments under the flavour ``hf:<path>``, so that ``--model.name <family> --model.flavor hf:<path>``
names the model everywhere a job config is read (a job config naming such a flavour reads the file itself: a
config ``plan --hf-config --emit-config`` writes trains as it is). Every field is either read (it fixes a shape, or
the context, ``max_position_embeddings``, that torchtitan warns a longer sequence exceeds), held to the value
the torchtitan model assumes (``hidden_act``, tied embeddings, the layer pattern), or known not to change the FLOPs
or bytes of a step (token ids, dropout, the checkpoint's storage format); any other field, and any missing one,
is refused in one line naming it: a field this module does not know may change the model it prices.

What is priced is torchtitan's model of the architecture, with torchtitan's FLOP count: DeepSeek-V3 without its
multi-token-prediction layers (``num_nextn_predict_layers``: torchtitan builds none), GPT-OSS's sliding-window
layers and Llama4's chunked-attention layers counted as full causal attention, and Llama4 without its vision encoder
(torchtitan's Llama4 is the text model).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.gpt_oss import GptOssModelArgs
from torchtitan.models.llama4 import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs

from torchtitan_ext.config.errors import ConfigError

HF_FLAVOR_PREFIX = "hf:"
"""The flavour name of a registered config.json: this prefix and the file's path."""

_registered: dict[tuple[str, str], object] = {}


@dataclass(frozen=True)
class _Family:
    """How one ``model_type`` maps onto a torchtitan model."""

    model_name: str
    """The torchtitan model (train-spec name) that builds this architecture."""
    required: tuple[str, ...]
    """Fields read: each must be present."""
    fixed: dict
    """Fields whose value the torchtitan model assumes: field -> (the value, or a test of it, what it means)."""
    ignored: tuple[str, ...]
    """Fields that change neither a step's FLOPs nor its bytes."""
    build: Callable[[dict], object]
    optional: tuple[str, ...] = ()
    """Fields read, or held as ``fixed`` says, when present (each has a default the architecture defines)."""
    unread_checkpoint_names: str = ""
    """Where torchtitan's HF state-dict adapter of ``model_name`` does not read this family's checkpoints: how their
    tensor names differ (a job then loads and saves no HF checkpoint); empty where it reads them."""


def _rope_scaling(config: dict, where: str, kind: str, name: str, fields: tuple[str, ...]) -> dict:
    """``rope_scaling``, checked to be of type ``kind`` (``name`` in messages) with ``fields``."""
    scaling = config["rope_scaling"]
    found = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if found != kind:
        raise ConfigError(f"{where}: rope_scaling {scaling!r} is not {name} scaling, which the torchtitan model "
                          f"builds: price a config whose rope_scaling has type '{kind}'")
    missing = [field for field in fields if field not in scaling]
    if missing:
        raise ConfigError(f"{where}: rope_scaling has no {', '.join(missing)}: a {name} config states them")
    return scaling


def _context(config: dict) -> dict:
    """``max_seq_len`` from ``max_position_embeddings`` where the config states it: the context the model was
    trained for, which torchtitan's ``update_from_config`` warns a longer ``training.seq_len`` exceeds."""
    return {"max_seq_len": config["max_position_embeddings"]} if "max_position_embeddings" in config else {}


def _yarn(config: dict, where: str, fields: tuple[str, ...]) -> dict:
    return _rope_scaling(config, where, "yarn", "YaRN", fields)


def _deepseek_v3(config: dict) -> DeepSeekV3ModelArgs:
    scaling = _yarn(config, config["_where"], ("original_max_position_embeddings", "factor", "beta_fast", "beta_slow",
                                               "mscale_all_dim"))
    return DeepSeekV3ModelArgs(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], inter_dim=config["intermediate_size"],
        moe_inter_dim=config["moe_intermediate_size"], n_layers=config["num_hidden_layers"],
        n_dense_layers=config["first_k_dense_replace"], n_heads=config["num_attention_heads"],
        norm_eps=config["rms_norm_eps"],
        moe_args=MoEArgs(
            num_experts=config["n_routed_experts"], num_shared_experts=config["n_shared_experts"],
            top_k=config["num_experts_per_tok"], num_expert_groups=config["n_group"],
            num_limited_groups=config["topk_group"], score_func=config["scoring_func"],
            route_norm=config["norm_topk_prob"], route_scale=config["routed_scaling_factor"],
            score_before_experts=False,
        ),
        q_lora_rank=config["q_lora_rank"] or 0, kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], original_seq_len=scaling["original_max_position_embeddings"],
        rope_theta=config["rope_theta"], rope_factor=scaling["factor"], beta_fast=scaling["beta_fast"],
        # torchtitan's mscale scales the softmax, as the config's mscale_all_dim does
        beta_slow=scaling["beta_slow"], mscale=scaling["mscale_all_dim"], **_context(config),
    )


def _gpt_oss(config: dict) -> GptOssModelArgs:
    scaling = _yarn(config, config["_where"], ("original_max_position_embeddings", "factor", "beta_fast", "beta_slow"))
    if config["num_experts_per_tok"] != config["experts_per_token"]:
        raise ConfigError(f"{config['_where']}: num_experts_per_tok {config['num_experts_per_tok']} and "
                          f"experts_per_token {config['experts_per_token']} differ: make them one top-k")
    return GptOssModelArgs(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], moe_inter_dim=config["intermediate_size"],
        n_layers=config["num_hidden_layers"], norm_eps=config["rms_norm_eps"],
        moe_args=MoEArgs(
            num_experts=config["num_local_experts"], num_shared_experts=0, score_func="softmax", route_norm=True,
            route_scale=1.0, gate_bias=True, score_before_experts=False, top_k=config["num_experts_per_tok"],
        ),
        swiglu_limit=config["swiglu_limit"], head_dim=config["head_dim"], n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"], sliding_window_size=config["sliding_window"],
        original_seq_len=scaling["original_max_position_embeddings"], rope_theta=config["rope_theta"],
        rope_factor=scaling["factor"], ntk_alpha=scaling["beta_slow"], ntk_beta=scaling["beta_fast"],
        **_context(config),
    )


def _qwen3_moe(config: dict, qk_norm: bool = True) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"], vocab_size=config["vocab_size"], head_dim=config["head_dim"],
        hidden_dim=config["intermediate_size"], norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        qk_norm=qk_norm, enable_weight_tying=config["tie_word_embeddings"], moe_enabled=True,
        moe_inter_dim=config["moe_intermediate_size"],
        moe_args=MoEArgs(
            num_experts=config["num_experts"], num_shared_experts=0, top_k=config["num_experts_per_tok"],
            score_func="softmax", route_norm=config["norm_topk_prob"], route_scale=1.0, score_before_experts=False,
        ),
        **_context(config),
    )


def _mixtral(config: dict) -> Qwen3ModelArgs:
    """Mixtral is Qwen3-MoE's layer without the query and key norms: softmax routing renormalised over the chosen
    experts, grouped-query attention without bias; its experts are its only MLPs."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return _qwen3_moe({**config, "head_dim": head_dim, "moe_intermediate_size": config["intermediate_size"],
                       "num_experts": config["num_local_experts"], "norm_topk_prob": True}, qk_norm=False)


def _llama4_text(config: dict) -> TransformerModelArgs:
    """torchtitan sizes Llama4's MLPs from ``dim`` (``multiple_of``, ``ffn_dim_multiplier``; an expert's hidden size
    is the dense MLP's over top-k plus the shared expert): the two are chosen here to give the config's sizes."""
    where, dim, top_k = config["_where"], config["hidden_size"], config["num_experts_per_tok"]
    expert = config["intermediate_size"]
    # with every layer MoE (a step of 1) no dense MLP is built: intermediate_size_mlp sizes nothing
    dense = config["intermediate_size_mlp"] if config["interleave_moe_layer_step"] > 1 else expert * (top_k + 1)
    base = int(2 * 4 * dim / 3)
    multiplier, multiple = dense / base, math.gcd(dense, expert)
    hidden = int(multiplier * base)
    built = (-(-hidden // multiple) * multiple, -(-int(hidden / (top_k + 1)) // multiple) * multiple)
    if built != (dense, expert):
        raise ConfigError(f"{where}: intermediate_size {expert} with intermediate_size_mlp {dense}: torchtitan's Llama4 "
                          f"sizes an expert as its dense MLP over top-k + 1 shared expert ({dense} / {top_k + 1}); "
                          "a model that differs there is not priced")
    scaling = config["rope_scaling"] and _rope_scaling(config, where, "llama3", "Llama 3", (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    return TransformerModelArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"], vocab_size=config["vocab_size"], multiple_of=multiple,
        ffn_dim_multiplier=multiplier, norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        rope_scaling_args=None if scaling is None else RoPEScalingArgs(
            scaling_factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        ),
        moe_args=MoEArgs(num_experts=config["num_local_experts"], num_shared_experts=1, top_k=top_k,
                         score_func="sigmoid", route_norm=False, score_before_experts=True),
        interleave_moe_layer_step=config["interleave_moe_layer_step"], auto_scale_hidden_dim=True,
        **_context(config),
    )


def _llama4(config: dict) -> TransformerModelArgs:
    """The text model of a Llama 4 config (its ``text_config``), held to its own family's fields."""
    text = config["text_config"]
    where = f"{config['_where']}: text_config"
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: not an object: a llama4 config.json holds its text model's fields there")
    _check_fields(text, _FAMILIES["llama4_text"], where)
    return _llama4_text({**text, "_where": where})


def _llama4_moe_layers(config: dict) -> bool:
    step = config["interleave_moe_layer_step"]
    return config["moe_layers"] == [layer for layer in range(config["num_hidden_layers"]) if (layer + 1) % step == 0]


def _alternating_sliding_then_full(config: dict) -> bool:
    pattern = ["sliding_attention", "full_attention"] * (config["num_hidden_layers"] // 2 + 1)
    return config["layer_types"] == pattern[:config["num_hidden_layers"]]


_COMMON_IGNORED = (
    "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "quantization_config",  # the checkpoint's storage format: a job's precision is its own config's
)

_FAMILIES = {
    "deepseek_v3": _Family(
        "deepseek_v3",
        required=("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "first_k_dense_replace", "num_attention_heads", "rms_norm_eps", "n_routed_experts",
                  "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "scoring_func", "norm_topk_prob",
                  "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "rope_theta", "rope_scaling"),
        fixed={
            "hidden_act": ("silu", "SwiGLU experts and MLPs"),
            "tie_word_embeddings": (False, "an output layer apart from the embeddings"),
            "attention_bias": (False, "attention projections without bias"),
            "moe_layer_freq": (1, "every layer after the first dense ones is MoE"),
            "topk_method": ("noaux_tc", "group-limited routing with a selection bias"),
            "num_key_value_heads": (lambda config: config["num_key_value_heads"] == config["num_attention_heads"],
                                    "multi-head latent attention: as many key-value heads as heads"),
        },
        ignored=(*_COMMON_IGNORED, "auto_map", "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp",
                 # multi-token prediction layers: torchtitan's DeepSeek-V3 builds none, so the job priced has none
                 "num_nextn_predict_layers"),
        build=_deepseek_v3,
        optional=("max_position_embeddings",),
    ),
    "gpt_oss": _Family(
        "gpt_oss",
        required=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps",
                  "num_local_experts", "num_experts_per_tok", "experts_per_token", "swiglu_limit", "head_dim",
                  "num_attention_heads", "num_key_value_heads", "sliding_window", "rope_theta", "rope_scaling"),
        fixed={
            "hidden_act": ("silu", "SwiGLU experts"),
            "tie_word_embeddings": (False, "an output layer apart from the embeddings"),
            "attention_bias": (True, "attention projections with bias"),
            "layer_types": (_alternating_sliding_then_full,
                            "sliding-window attention on even layers and full attention on odd ones"),
        },
        ignored=(*_COMMON_IGNORED, "initial_context_length", "output_router_logits", "router_aux_loss_coef"),
        build=_gpt_oss,
        optional=("max_position_embeddings",),
    ),
    "qwen3_moe": _Family(
        "qwen3",
        required=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                  "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob"),
        fixed={
            "hidden_act": ("silu", "SwiGLU experts"),
            "attention_bias": (False, "attention projections without bias"),
            "decoder_sparse_step": (1, "every layer MoE"),
            "mlp_only_layers": ([], "every layer MoE"),
            "use_sliding_window": (False, "full causal attention in every layer"),
            "rope_scaling": (None, "RoPE without scaling"),
        },
        # sliding_window and max_window_layers mean nothing while use_sliding_window is false
        ignored=(*_COMMON_IGNORED, "output_router_logits", "router_aux_loss_coef", "sliding_window",
                 "max_window_layers"),
        build=_qwen3_moe,
        optional=("max_position_embeddings",),
    ),
    "mixtral": _Family(
        "qwen3",
        required=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "num_local_experts",
                  "num_experts_per_tok"),
        fixed={
            "hidden_act": ("silu", "SwiGLU experts"),
            "sliding_window": (None, "full causal attention in every layer"),
        },
        ignored=(*_COMMON_IGNORED, "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"),
        build=_mixtral,
        unread_checkpoint_names=("Mixtral's checkpoints name their experts block_sparse_moe.experts.<e>.w1, w2, w3 "
                                 "and their router block_sparse_moe.gate, where torchtitan's Qwen3 adapter reads "
                                 "mlp.experts.<e>.gate_proj, down_proj, up_proj and mlp.gate"),
        optional=("head_dim", "max_position_embeddings"),
    ),
    "llama4": _Family(
        "llama4",
        required=("text_config",),
        fixed={"tie_word_embeddings": (False, "an output layer apart from the embeddings")},
        # the vision encoder and its projector: torchtitan's Llama4 is the text model, so a job trains none
        ignored=(*_COMMON_IGNORED, "vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
                 "max_position_embeddings"),  # the text model's, in text_config, is the one read
        build=_llama4,
    ),
    "llama4_text": _Family(
        "llama4",
        required=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "intermediate_size", "intermediate_size_mlp", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "num_local_experts", "num_experts_per_tok"),
        fixed={
            "hidden_act": ("silu", "SwiGLU experts and MLPs"),
            "attention_bias": (False, "attention projections without bias"),
            "head_dim": (lambda config: config["head_dim"] * config["num_attention_heads"] == config["hidden_size"],
                         "heads of hidden_size / num_attention_heads"),
            "interleave_moe_layer_step": (lambda config: type(config["interleave_moe_layer_step"]) is int
                                          and config["interleave_moe_layer_step"] >= 1,
                                          "an MoE layer every interleave_moe_layer_step >= 1 layers"),
            "moe_layers": (_llama4_moe_layers, "an MoE layer every interleave_moe_layer_step layers, the last of each"),
            "tie_word_embeddings": (False, "an output layer apart from the embeddings"),
        },
        ignored=(*_COMMON_IGNORED, "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
                 "cache_implementation", "for_llm_compressor",
                 # attention's temperature, and query and key norms without weights: no parameter, and torchtitan's
                 # FLOP count counts neither
                 "attn_scale", "attn_temperature_tuning", "floor_scale", "use_qk_norm",
                 # iRoPE's layers without RoPE and its chunked attention: priced as full causal attention, as
                 # torchtitan counts the FLOPs of its Llama4
                 "no_rope_layers", "attention_chunk_size"),
        build=_llama4_text,
        unread_checkpoint_names=("a text-only Llama 4 checkpoint names its tensors model.layers.<n>..., where "
                                 "torchtitan's Llama4 adapter reads a multimodal one's language_model.model.layers.<n>..."),
        optional=("moe_layers", "tie_word_embeddings", "max_position_embeddings"),
    ),
}


def _check_fields(config: dict, family: _Family, where: str) -> None:
    kind = config.get("model_type", family.model_name)
    known = {*family.required, *family.fixed, *family.ignored, *family.optional}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"{where}: field(s) {', '.join(unknown)} are not known to price a {kind} model: they may "
                          "change its shape; remove them if they do not")
    missing = [field for field in (*family.required, *family.fixed) if field not in config and field not in family.optional]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}: a {kind} config.json states them")
    for field, (expected, meaning) in family.fixed.items():
        if field not in config:
            continue
        value = config[field]
        if not (expected(config) if callable(expected) else value == expected and type(value) is type(expected)):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
            raise ConfigError(f"{where}: {field} = {shown}: the torchtitan {family.model_name} model builds "
                              f"{meaning}; a model that differs there is not priced")


def hf_model_args(path: Path, where: str = ""):
    """(torchtitan model name, its model arguments) of the config.json at ``path``; ConfigError naming the field
    and the fix for a file that is not one, an unknown ``model_type``, and an unknown, missing or unsupported field.
    ``where``: how the message names the file (default: the ``--hf-config`` flag)."""
    family, config = _family_and_config(path, where or f"--hf-config {path}")
    return family.model_name, family.build(config)


def _family_and_config(path: Path, where: str) -> tuple[_Family, dict]:
    """The family of the config.json at ``path`` and its fields, checked as :func:`hf_model_args` says."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}): give the path of a model's config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON (line {e.lineno}: {e.msg}): give a model's config.json") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"{where}: no model_type field: give a Hugging Face model's config.json")
    family = _FAMILIES.get(config["model_type"])
    if family is None:
        raise ConfigError(f"{where}: model_type '{config['model_type']}' is not priced: use a config of "
                          f"{', '.join(_FAMILIES)}")
    _check_fields(config, family, where)
    return family, {**config, "_where": where}


def register_hf_model(path: Path, where: str = "") -> list[str]:
    """Register the config.json at ``path`` as a flavour; the overrides that select it
    (``--model.name <family> --model.flavor hf:<path>``). ``where``: as :func:`hf_model_args`'s."""
    name, model_args = hf_model_args(path, where)
    flavor = f"{HF_FLAVOR_PREFIX}{path}"
    _registered[name, flavor] = model_args
    return ["--model.name", name, "--model.flavor", flavor]


def hf_flavor_args(name: str, flavor: str):
    """The model arguments of flavour ``hf:<path>`` of model ``name``: registered already, or read from the
    config.json at ``<path>`` now. ConfigError, naming ``model.flavor``, for a file :func:`hf_model_args` refuses
    and for a config of another model."""
    if (name, flavor) not in _registered:
        where = f"model.flavor = '{flavor}'"
        family, model_args = hf_model_args(Path(flavor.removeprefix(HF_FLAVOR_PREFIX)), where)
        if family != name:
            raise ConfigError(f"{where}: that config.json is a {family} model, not {name}: set model.name = "
                              f"'{family}'")
        _registered[name, flavor] = model_args
    return _registered[name, flavor]


def unread_checkpoint_names(flavor: str) -> str:
    """For flavour ``hf:<path>``, how its family's HF checkpoints name their tensors otherwise than torchtitan's
    state-dict adapter of its model reads and writes them; empty where they do not, and for a named flavour."""
    if not flavor.startswith(HF_FLAVOR_PREFIX):
        return ""
    family, _ = _family_and_config(Path(flavor.removeprefix(HF_FLAVOR_PREFIX)), f"model.flavor = '{flavor}'")
    return family.unread_checkpoint_names
