"""Train specs for DeepSeek-V3 and Llama4, registered under torchtitan's names."""

import dataclasses

from torchtitan.models.deepseek_v3 import get_train_spec as deepseek_v3_spec
from torchtitan.models.llama4 import get_train_spec as llama4_spec
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from torchtitan_ext.metrics import build_metrics_processor

MODEL_NAMES = ("deepseek_v3", "llama4")


def register_train_specs() -> None:
    """Register our specs as "deepseek_v3" and "llama4" (idempotent).

    A registered spec takes precedence over torchtitan's built-in one of the
    same name, so configs keep ``model.name = "deepseek_v3"`` / ``"llama4"``.
    """
    for name, upstream_spec in (("deepseek_v3", deepseek_v3_spec), ("llama4", llama4_spec)):
        spec = dataclasses.replace(
            upstream_spec(), build_metrics_processor_fn=build_metrics_processor
        )
        try:
            register_train_spec(name, spec)
        except ValueError:
            if get_train_spec(name).build_metrics_processor_fn is not build_metrics_processor:
                raise
