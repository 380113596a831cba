"""Train specs for DeepSeek-V3, Llama4, Qwen3 (Qwen3-MoE) and GPT-OSS, registered under torchtitan's names.

Each is torchtitan's own spec with our model args and flavours, our
parallelize plan (:mod:`torchtitan_ext.models`), our metrics processor,
pipeline-normalized loss and validator (:mod:`.validator`; torchtitan's
DeepSeek-V3 and GPT-OSS specs build none). A spec registered with ``register_train_spec``
takes precedence over torchtitan's built-in one of the same name, so configs
keep ``model.name = "deepseek_v3"``, ``"llama4"``, ``"qwen3"``, ``"gpt_oss"``.
"""

import dataclasses

from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.models.deepseek_v3 import get_train_spec as deepseek_v3_spec
from torchtitan.models.gpt_oss import get_train_spec as gpt_oss_spec
from torchtitan.models.llama4 import get_train_spec as llama4_spec
from torchtitan.models.qwen3 import get_train_spec as qwen3_spec
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec, TrainSpec

from torchtitan_ext.config import hf_flavor_args, HF_FLAVOR_PREFIX
from torchtitan_ext.models import deepseek_v3, gpt_oss, llama4, qwen3
from torchtitan_ext.models.args import as_our_args
from torchtitan_ext.models.gpt_oss_checkpoint import GptOssStateDictAdapter
from torchtitan_ext.training.loss import build_loss_fn
from torchtitan_ext.training.metrics import build_metrics_processor
from torchtitan_ext.training.validator import build_validator

MODELS = {
    "deepseek_v3": (deepseek_v3_spec, deepseek_v3.flavors, deepseek_v3.parallelize_deepseekv3, {}),
    "llama4": (llama4_spec, llama4.flavors, llama4.parallelize_llama4, {}),
    # torchtitan's Qwen3 spec never updates its MoE layers' expert_bias (load_balance_coeff is set): balanced as the
    # other three models are
    "qwen3": (qwen3_spec, qwen3.flavors, qwen3.parallelize_qwen3,
              {"build_optimizers_fn": build_optimizers_with_moe_load_balancing}),
    # torch 2.13's reader of MXFP4 checkpoints loads a wrong slice of the experts' weights (gpt_oss_checkpoint says how)
    "gpt_oss": (gpt_oss_spec, gpt_oss.flavors, gpt_oss.parallelize_gptoss,
                {"model_cls": gpt_oss.GptOssModel, "state_dict_adapter": GptOssStateDictAdapter}),
}
"""Model name -> (torchtitan's spec, our flavours, our parallelize function, other fields of the spec we replace)."""


class Flavours(dict):
    """A model's flavours: its named ones, and any ``hf:<path>`` flavour (the Hugging Face config.json at
    ``<path>``, read at first use, as our model args), so that a config ``plan --emit-config`` writes for a
    ``--hf-config`` model trains as written."""

    def __init__(self, name: str, named: dict):
        super().__init__(named)
        self.name = name

    def __missing__(self, flavor: str):
        if not flavor.startswith(HF_FLAVOR_PREFIX):
            raise KeyError(flavor)
        read = hf_flavor_args(self.name, flavor)
        ours = type(next(iter(self.values())))
        self[flavor] = as_our_args(ours, read)
        return self[flavor]


def train_spec(name: str) -> TrainSpec:
    """Our spec of model ``name`` (a key of :data:`MODELS`)."""
    upstream_spec, flavors, parallelize, replaced = MODELS[name]
    upstream = upstream_spec()
    return dataclasses.replace(
        upstream,
        model_args=Flavours(name, flavors()),
        parallelize_fn=parallelize,
        build_metrics_processor_fn=build_metrics_processor,
        build_loss_fn=build_loss_fn(upstream.build_loss_fn),
        build_validator_fn=build_validator,
        **replaced,
    )


def register_train_specs() -> None:
    """Register our specs under torchtitan's names (idempotent)."""
    for name in MODELS:
        try:
            register_train_spec(name, train_spec(name))
        except ValueError:
            if get_train_spec(name).parallelize_fn is not MODELS[name][2]:
                raise
