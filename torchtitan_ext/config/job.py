"""What a job config fixes about the job: its model's arguments and MoE shape, its tokens per dispatch,
its world size. Read from the config and torchtitan's train-spec registry; nothing is allocated."""

import math
from dataclasses import dataclass

import torch
from torchtitan.models import _supported_models
from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec

from torchtitan_ext.config.errors import ConfigError


@dataclass(frozen=True)
class MoEShape:
    """The MoE layers a backend serves, as fixed by the job config."""

    hidden_dim: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    """Most tokens one rank brings to one dispatch: a microbatch's tokens on this
    rank, in training or validation, whichever is larger."""


def model_args_of(job_config):
    """The configured model flavour's arguments; ConfigError for an unknown model or flavour."""
    name, flavor = job_config.model.name, job_config.model.flavor
    try:
        spec = get_train_spec(name)
    except ValueError:
        known = sorted(set(_extra_train_specs) | set(_supported_models))
        raise ConfigError(f"model.name = '{name}' is not a registered model: use one of {', '.join(known)}") from None
    if flavor not in spec.model_args:
        raise ConfigError(f"model.flavor = '{flavor}' is not a flavour of {name}: use one of {', '.join(spec.model_args)}")
    return spec.model_args[flavor]


def max_tokens_per_rank(job_config) -> int:
    """Most tokens one rank dispatches per MoE call: a microbatch (of training, or of
    validation when it is on), split by CP, and by TP when EP borrows it."""
    parallelism = job_config.parallelism
    jobs = [(job_config.training.local_batch_size, job_config.training.seq_len)]
    if job_config.validation.enable:
        jobs.append((job_config.validation.local_batch_size, job_config.validation.seq_len))
    if parallelism.pipeline_parallel_degree > 1:
        jobs = [(parallelism.pipeline_parallel_microbatch_size, seq_len) for _, seq_len in jobs]
    tokens = max(batch * seq_len for batch, seq_len in jobs) // parallelism.context_parallel_degree
    if parallelism.tensor_parallel_degree > 1 and parallelism.expert_tensor_parallel_degree == 1:
        tokens //= parallelism.tensor_parallel_degree
    return tokens


def moe_shape(job_config) -> MoEShape | None:
    """The MoE layers' shape for this job, or None for a dense model."""
    model_args = model_args_of(job_config)
    moe_args = getattr(model_args, "moe_args", None)
    if moe_args is None:
        return None
    return MoEShape(model_args.dim, moe_args.num_experts, moe_args.top_k, max_tokens_per_rank(job_config))


def meta_model(job_config):
    """The job's model on the meta device: its structure, no memory."""
    model_args = model_args_of(job_config)
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        return get_train_spec(job_config.model.name).model_cls(model_args)


def moe_layer_ids(job_config) -> list[int]:
    """Ids of the model's MoE layers (the ``layers.<id>`` of their parameters)."""
    return sorted(int(layer_id) for layer_id, block in meta_model(job_config).layers.items() if block.moe_enabled)


def job_world_size(job_config) -> int:
    """The world size the job's degrees fix; ConfigError when data_parallel_shard_degree = -1 leaves it open."""
    p = job_config.parallelism
    if p.data_parallel_shard_degree < 0:
        raise ConfigError(
            "data_parallel_shard_degree = -1 leaves the world size open: pass --world-size N"
        )
    return math.prod((
        p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
        p.tensor_parallel_degree, p.pipeline_parallel_degree,
    ))
