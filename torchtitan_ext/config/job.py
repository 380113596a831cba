"""What a job config fixes about the job: its model's arguments and MoE shape, its tokens per dispatch,
its world size. Read from the config and torchtitan's train-spec registry; nothing is allocated."""

import copy
import os
from dataclasses import dataclass

import torch
from torchtitan.models import _supported_models
from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec

from torchtitan_ext.config.errors import ConfigError
from torchtitan_ext.config.hf_model import hf_flavor_args, HF_FLAVOR_PREFIX


@dataclass(frozen=True)
class MoEShape:
    """The MoE layers a backend serves, as fixed by the job config."""

    hidden_dim: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    """Most tokens one rank brings to one dispatch: a microbatch's tokens on this rank."""


def model_args_of(job_config):
    """The configured model flavour's arguments; ConfigError for an unknown model or flavour."""
    name, flavor = job_config.model.name, job_config.model.flavor
    read = hf_flavor_args(name, flavor) if flavor.startswith(HF_FLAVOR_PREFIX) else None
    try:
        spec = get_train_spec(name)
    except ValueError:
        if read is not None:
            return read
        known = sorted(set(_extra_train_specs) | set(_supported_models))
        raise ConfigError(f"model.name = '{name}' is not a registered model: use one of {', '.join(known)}") from None
    if read is not None:
        try:
            return spec.model_args[flavor]  # our spec's flavours hold it as the model's own args
        except KeyError:
            return read
    if flavor not in spec.model_args:
        raise ConfigError(f"model.flavor = '{flavor}' is not a flavour of {name}: use one of {', '.join(spec.model_args)}")
    return spec.model_args[flavor]


def max_tokens_per_rank(job_config) -> int:
    """Most tokens one rank dispatches per MoE call of a training step: a microbatch, split by CP, and by TP when EP
    borrows it. A backend sized by it (``sized_by_dispatch``) takes no larger validation dispatch
    (:func:`tokens_per_dispatch`; the validation's check refuses one)."""
    return tokens_per_dispatch(job_config)["training"]


def tokens_per_dispatch(job_config) -> dict[str, int]:
    """{pass: tokens one rank dispatches per MoE call} for training and, where the job validates, validation: a
    microbatch (under PP, the pipeline microbatch; validation's batch is split into as many microbatches as
    training's), split by CP, and by TP when EP borrows it."""
    parallelism = job_config.parallelism
    training, validation = job_config.training, job_config.validation
    batches = {"training": (training.local_batch_size, training.seq_len)}
    if validation.enable:
        batches["validation"] = (validation.local_batch_size, validation.seq_len)
    if parallelism.pipeline_parallel_degree > 1:
        size = parallelism.pipeline_parallel_microbatch_size
        microbatches = max(training.local_batch_size // size, 1)
        batches = {name: (size if name == "training" else max(batch // microbatches, 1), seq_len)
                   for name, (batch, seq_len) in batches.items()}
    divisor = parallelism.context_parallel_degree
    if parallelism.tensor_parallel_degree > 1 and parallelism.expert_tensor_parallel_degree == 1:
        divisor *= parallelism.tensor_parallel_degree
    return {name: batch * seq_len // divisor for name, (batch, seq_len) in batches.items()}


def routed_moe_args(model_args):
    """A model's MoE arguments, or None where it has no routed experts: no ``moe_args``, or, as Qwen3's dense
    flavours, ``moe_args`` that no layer uses (``moe_enabled = False``)."""
    if getattr(model_args, "moe_enabled", True) is False:
        return None
    return getattr(model_args, "moe_args", None)


def moe_shape(job_config) -> MoEShape | None:
    """The MoE layers' shape for this job, or None for a dense model."""
    model_args = model_args_of(job_config)
    moe_args = routed_moe_args(model_args)
    if moe_args is None:
        return None
    return MoEShape(model_args.dim, moe_args.num_experts, moe_args.top_k, max_tokens_per_rank(job_config))


def meta_model(job_config):
    """The job's model on the meta device, built for the caller, who may change it: its structure, no memory."""
    model_cls, model_args = model_class_and_args(job_config)
    with torch.device("meta"):
        return model_cls(model_args)


def shared_meta_model(job_config):
    """The job's model on the meta device, shared by every caller in this process: to be read, never changed
    (:func:`meta_model` builds one to change). Building a 671B model takes a fifth of a second, and the config
    checks, the planner and the tools read the structure of one job many times."""
    model_cls, model_args = model_class_and_args(job_config)
    # every attribute of the arguments (those set outside their fields too, such as DeepSeek-V3's moe_impl), and the
    # dtype new parameters take: the arguments are not hashable
    key = (model_cls, type(model_args), repr(vars(model_args)), torch.get_default_dtype())
    if key not in _SHARED_META_MODELS:
        if len(_SHARED_META_MODELS) >= SHARED_META_MODELS_KEPT:
            _SHARED_META_MODELS.pop(next(iter(_SHARED_META_MODELS)))
        with torch.device("meta"):
            _SHARED_META_MODELS[key] = model_cls(model_args)
    return _SHARED_META_MODELS[key]


def model_class_and_args(job_config):
    """The job's model class and a copy of its flavour's arguments, updated from the job config as torchtitan's
    trainer updates them. The registry's arguments stay as registered: torchtitan's update changes them in place
    (``max_seq_len`` becomes the job's sequence length), and a process that checks several jobs (the planner's
    candidates, the launcher's pre-flight check run by a tool) would otherwise start each from the last one's."""
    model_args = copy.deepcopy(model_args_of(job_config))
    model_args.update_from_config(job_config)
    return get_train_spec(job_config.model.name).model_cls, model_args


SHARED_META_MODELS_KEPT = 8
"""How many models :func:`shared_meta_model` keeps (the oldest built goes first)."""
_SHARED_META_MODELS: dict[tuple, torch.nn.Module] = {}


def routed_expert_parameter_elements(job_config) -> tuple[int, ...]:
    """Elements of one routed expert's row in each of its parameters (w1, w2, w3; GPT-OSS's weights and biases),
    from the model built on the meta device (empty for a dense model)."""
    for block in shared_meta_model(job_config).layers.values():
        if block.moe_enabled:
            return tuple(parameter[0].numel() for parameter in block.moe.experts.parameters())
    return ()


def routed_expert_elements(job_config) -> int:
    """Elements of one routed expert's weights, all parameters (0 for a dense model)."""
    return sum(routed_expert_parameter_elements(job_config))


STANDARD_EXPERT_PARAMETERS = ("w1", "w2", "w3")
"""torchtitan's routed experts (``GroupedExperts``): SwiGLU without bias, one stacked weight per projection."""


def nonstandard_experts(job_config) -> str | None:
    """None when the model's routed experts are torchtitan's standard ones (:data:`STANDARD_EXPERT_PARAMETERS`);
    else what a refusal says of them (e.g. GPT-OSS's biased, clamped experts). Read from the model on the meta
    device: call it only where a feature needs the standard experts."""
    for block in shared_meta_model(job_config).layers.values():
        if block.moe_enabled:
            names = tuple(name for name, _ in block.moe.experts.named_parameters())
            if names == STANDARD_EXPERT_PARAMETERS:
                return None
            return f"{job_config.model.name}'s routed experts ({', '.join(names)}) are not the bias-free SwiGLU " \
                   f"experts ({', '.join(STANDARD_EXPERT_PARAMETERS)}) it is written for"
    return None


def moe_layer_ids(job_config) -> list[int]:
    """Ids of the model's MoE layers (the ``layers.<id>`` of their parameters)."""
    return sorted(int(layer_id) for layer_id, block in shared_meta_model(job_config).layers.items() if block.moe_enabled)


def data_parallel_degree(job_config, world_size: int | None) -> int | None:
    """The ranks that read different batches (data_parallel_replicate x data_parallel_shard on ``world_size`` ranks):
    torchtitan's data loader shards its data, and its checkpointed state, over them. None where the world size is
    unknown and dp_shard is automatic, or the degrees do not divide it (validation says so)."""
    p = job_config.parallelism
    shard = p.data_parallel_shard_degree
    if shard == -1:
        fixed = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
        fixed *= p.pipeline_parallel_degree
        if world_size is None or world_size % fixed:
            return None
        shard = world_size // fixed
    return p.data_parallel_replicate_degree * shard


def fsdp_shards(job_config, world_size: int | None) -> bool | None:
    """Whether FSDP shards the job (dp_shard x cp > 1 on ``world_size`` ranks). Precision mixes there: torchtitan casts
    to ``training.mixed_precision_param`` through FSDP, or through autocast where there is no TP or PP, so a TP or PP
    job without FSDP runs its model in float32 whatever that says (``maybe_enable_amp`` only warns). None where the
    world size is unknown and dp_shard is automatic, or the degrees do not divide it (validation says so)."""
    p = job_config.parallelism
    degree = data_parallel_degree(job_config, world_size)
    if degree is None:
        return None
    return degree // p.data_parallel_replicate_degree > 1 or p.context_parallel_degree > 1


def job_world_size(job_config, given: int | None = None) -> int:
    """The job's world size, by one rule for every tool: ``given`` (a ``--world-size`` flag), else the
    ``NGPU`` environment variable, else the product of the config's degrees when they fix it.

    ConfigError when none says it, or when ``given``/NGPU is not a rank count.
    """
    if given is None and os.environ.get("NGPU"):
        text = os.environ["NGPU"]
        if not text.isdigit():
            raise ConfigError(f"NGPU='{text}' is not an integer: set NGPU to the process count, e.g. NGPU=2")
        given = int(text)
    if given is not None:
        if given < 1:
            raise ConfigError(f"world size {given}: set NGPU (or --world-size) to a rank count >= 1")
        return given
    p = job_config.parallelism
    fixed = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
    fixed *= p.pipeline_parallel_degree
    if p.data_parallel_shard_degree > 0:
        return fixed * p.data_parallel_shard_degree
    experts_span = p.expert_parallel_degree * p.expert_tensor_parallel_degree
    smallest = next(shard for shard in range(1, experts_span + 1)
                    if (shard * p.context_parallel_degree * p.tensor_parallel_degree) % experts_span == 0)
    raise ConfigError(
        "the world size is open (parallelism.data_parallel_shard_degree = -1): set NGPU=N (the python -m tools "
        f"also take --world-size N) to the job's process count, a multiple of {fixed * smallest} for this config"
    )
