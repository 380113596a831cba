"""Train specs for DeepSeek-V3 and Llama4, registered under torchtitan's names.

A spec registered with ``register_train_spec`` takes precedence over
torchtitan's built-in one of the same name, so configs keep
``model.name = "deepseek_v3"`` / ``"llama4"``.
"""

from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

from torchtitan_ext.models import deepseek_v3, llama4

MODEL_NAMES = ("deepseek_v3", "llama4")
_SPECS = {"deepseek_v3": deepseek_v3.train_spec, "llama4": llama4.train_spec}
_PARALLELIZE = {
    "deepseek_v3": deepseek_v3.parallelize_deepseekv3,
    "llama4": llama4.parallelize_llama4,
}


def register_train_specs() -> None:
    """Register our specs as "deepseek_v3" and "llama4" (idempotent)."""
    for name, build_spec in _SPECS.items():
        try:
            register_train_spec(name, build_spec())
        except ValueError:
            if get_train_spec(name).parallelize_fn is not _PARALLELIZE[name]:
                raise
