"""Job configs: torchtitan's sections, ours, their ranges and checks; loading TOML + CLI into a JobConfig.

Owns: the error of a bad job (:class:`ConfigError`), TOML + command-line
parsing, the valid range of numeric fields, the shared ``[parallelism]``
widening, the registry through which each feature adds its section and checks
(:mod:`.registry`; the merged class, :mod:`.merged`), what a config fixes about the job (:mod:`.job`), the
defaults this machine decides (:mod:`.machine`), a model given by a Hugging Face config.json (:mod:`.hf_model`), validation and
:func:`load_job_config`.

May import: torch, torchtitan and the standard library; nothing else of this
package (the bottom tier, see :mod:`torchtitan_ext`).
"""

from torchtitan_ext.config.errors import ConfigError
from torchtitan_ext.config.hf_model import hf_flavor_args, HF_FLAVOR_PREFIX, register_hf_model, unread_checkpoint_names
from torchtitan_ext.config.job import (
    data_parallel_degree,
    job_world_size,
    max_tokens_per_rank,
    tokens_per_dispatch,
    fsdp_shards,
    meta_model,
    shared_meta_model,
    model_args_of,
    model_class_and_args,
    moe_layer_ids,
    moe_shape,
    routed_moe_args,
    MoEShape,
    nonstandard_experts,
    routed_expert_elements,
    routed_expert_parameter_elements,
)
from torchtitan_ext.config.loading import load_job_config, parse
from torchtitan_ext.config.parsing import with_config_file
from torchtitan_ext.config.ranges import Range
from torchtitan_ext.config.registry import register_check, register_section, ValidationContext
from torchtitan_ext.config.sections import comm_backend, job_summary, overlaps_expert_parallel
from torchtitan_ext.config.validation import validate

__all__ = [
    "comm_backend",
    "ConfigError",
    "hf_flavor_args",
    "HF_FLAVOR_PREFIX",
    "job_summary",
    "data_parallel_degree",
    "job_world_size",
    "load_job_config",
    "max_tokens_per_rank",
    "tokens_per_dispatch",
    "fsdp_shards",
    "meta_model",
    "shared_meta_model",
    "model_args_of",
    "model_class_and_args",
    "moe_layer_ids",
    "overlaps_expert_parallel",
    "moe_shape",
    "routed_moe_args",
    "MoEShape",
    "nonstandard_experts",
    "routed_expert_elements",
    "routed_expert_parameter_elements",
    "parse",
    "register_hf_model",
    "unread_checkpoint_names",
    "Range",
    "register_check",
    "register_section",
    "validate",
    "with_config_file",
    "ValidationContext",
]
