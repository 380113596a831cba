"""Train specs for DeepSeek-V3 and Llama4, registered under torchtitan's names.

Each is torchtitan's own spec with our model args and flavours, our
parallelize plan (:mod:`torchtitan_ext.models`), our metrics processor and
pipeline-normalized loss. A spec registered with ``register_train_spec``
takes precedence over torchtitan's built-in one of the same name, so configs
keep ``model.name = "deepseek_v3"`` / ``"llama4"``.
"""

import dataclasses

from torchtitan.models.deepseek_v3 import get_train_spec as deepseek_v3_spec
from torchtitan.models.llama4 import get_train_spec as llama4_spec
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec, TrainSpec

from torchtitan_ext.models import deepseek_v3, llama4
from torchtitan_ext.training.loss import build_loss_fn
from torchtitan_ext.training.metrics import build_metrics_processor

MODELS = {
    "deepseek_v3": (deepseek_v3_spec, deepseek_v3.flavors, deepseek_v3.parallelize_deepseekv3),
    "llama4": (llama4_spec, llama4.flavors, llama4.parallelize_llama4),
}
"""Model name -> (torchtitan's spec, our flavours, our parallelize function)."""


def train_spec(name: str) -> TrainSpec:
    """Our spec of model ``name`` ("deepseek_v3" or "llama4")."""
    upstream_spec, flavors, parallelize = MODELS[name]
    upstream = upstream_spec()
    return dataclasses.replace(
        upstream,
        model_args=flavors(),
        parallelize_fn=parallelize,
        build_metrics_processor_fn=build_metrics_processor,
        build_loss_fn=build_loss_fn(upstream.build_loss_fn),
    )


def register_train_specs() -> None:
    """Register our specs as "deepseek_v3" and "llama4" (idempotent)."""
    for name in MODELS:
        try:
            register_train_spec(name, train_spec(name))
        except ValueError:
            if get_train_spec(name).parallelize_fn is not MODELS[name][2]:
                raise
