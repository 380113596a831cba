"""The EP backend's checks of a job config, registered with :mod:`torchtitan_ext.config`.

The backend named must exist; only its own section may be set; it must
support the job's expert parallel degrees; then the backend checks its
section and combinations itself (``RoutedExpertParallel.validate_config``).
"""


from torchtitan_ext.config import (
    comm_backend, ConfigError, fsdp_shards, nonstandard_experts, ValidationContext,
)
from torchtitan_ext.ep.backends import BACKENDS
from torchtitan_ext.ep.replication.plan import dispatched_shape


def check_backend(job_config, context: ValidationContext) -> None:
    backend = comm_backend(job_config)
    if backend not in BACKENDS:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend = '{backend}' is not a backend: "
            f"use one of {', '.join(BACKENDS)} ('standard' means nccl)"
        )
    _check_foreign_sections(job_config, backend, context.command_line)
    if context.moe_shape is None:
        return
    _check_degrees(job_config, backend)
    BACKENDS[backend].validate_config(job_config, context.device_type, dispatched_shape(job_config, context.moe_shape))
    if BACKENDS[backend].kernels_take_bf16_tokens_only(job_config, context.device_type):
        _check_tokens_reach_the_kernels_in_bf16(job_config, context.world_size, BACKENDS[backend].config_section)


def _check_tokens_reach_the_kernels_in_bf16(job_config, world_size: int | None, section: str) -> None:
    """torchtitan casts the model to ``training.mixed_precision_param`` through FSDP only: without it,
    under TP or PP (which expert parallelism without a data-parallel shard implies) the model runs in
    fp32, and a library's kernels would get fp32 tokens at the first dispatch."""
    if fsdp_shards(job_config, world_size) is not False:
        return
    raise ConfigError(
        f"parallelism.data_parallel_shard_degree is 1 (and context_parallel_degree 1): without FSDP, "
        f"torchtitan runs the model in fp32 (training.mixed_precision_param applies through FSDP), and the "
        f"{section} kernels take bf16 tokens only: shard data parallelism (data_parallel_shard_degree > 1), "
        f"or set {section}.implementation = 'reference'"
    )


def _check_foreign_sections(job_config, backend: str, command_line: frozenset[str]) -> None:
    """A backend's knobs live in its own section. A config file may hold another backend's section (its settings
    for this hardware, so that trying that backend is one override); the command line setting another backend's
    knob is a mistake."""
    for name, backend_class in BACKENDS.items():
        section_name = backend_class.config_section
        if section_name is None or name == backend:
            continue
        typed = sorted(key for key in command_line if key.startswith(f"{section_name}."))
        if typed:
            raise ConfigError(
                f"--{typed[0]} is set but parallelism.expert_parallel_comm_backend is '{backend}': remove it or "
                f"select --parallelism.expert_parallel_comm_backend {name}"
            )


def _check_degrees(job_config, backend: str) -> None:
    backend_class = BACKENDS[backend]
    ep = job_config.parallelism.expert_parallel_degree
    if backend_class.needs_expert_parallelism and ep == 1:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend = '{backend}' needs expert parallelism, but "
            "expert_parallel_degree = 1: set expert_parallel_degree > 1 or use the nccl backend"
        )
    etp = job_config.parallelism.expert_tensor_parallel_degree
    if not backend_class.supports_expert_tensor_parallel and ep > 1 and etp > 1:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree = {etp} is not supported by the "
            f"'{backend}' backend: set expert_tensor_parallel_degree = 1 or use the nccl backend"
        )
    if ep > 1 and etp > 1:
        experts = nonstandard_experts(job_config)
        if experts:
            raise ConfigError(f"parallelism.expert_tensor_parallel_degree = {etp}: expert TP under EP splits "
                              f"w1, w3 by column and w2 by row, and {experts}: set expert_tensor_parallel_degree = 1")
