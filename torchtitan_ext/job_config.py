"""The job config: torchtitan's sections, ours, and each backend's, assembled and validated.

This module sits above :mod:`torchtitan_ext.config` (parsing, the shared
sections and rules) and :mod:`torchtitan_ext.ep` (the backends, each owning
its section): the ``JobConfig`` is assembled from the backend registry, so a
new backend brings its section and its checks with it, and neither layer
imports the other.

:func:`parse` turns TOML + CLI into a job config and :func:`validate`
rejects bad values and combinations with one line naming the field and the
fix. Both run before any process group, buffer or model exists.
"""

import dataclasses
from dataclasses import dataclass, field, fields

import torch
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TorchTitanJobConfig
from torchtitan.models import _supported_models
from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec

from torchtitan_ext import config
from torchtitan_ext.config import check_ranges, comm_backend, ConfigError, FIELD_RANGES
from torchtitan_ext.data import check_dataset_options
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.ep.base import max_tokens_per_rank, MoEShape
from torchtitan_ext.placement import load_placement


@dataclass
class SharedSections:
    """Our sections that no backend owns."""

    parallelism: config.Parallelism = field(default_factory=config.Parallelism)
    routing_stats: config.RoutingStats = field(default_factory=config.RoutingStats)
    faults: config.Faults = field(default_factory=config.Faults)
    expert_placement: config.ExpertPlacement = field(default_factory=config.ExpertPlacement)


JobConfig = dataclasses.make_dataclass(
    "JobConfig",
    [
        (backend.config_section, backend.Config, field(default_factory=backend.Config))
        for backend in BACKENDS.values()
        if backend.config_section is not None
    ],
    bases=(SharedSections,),
)
"""Our sections: the shared ones and one per backend that has knobs."""

MergedJobConfig = ConfigManager._merge_configs(TorchTitanJobConfig, JobConfig)
"""torchtitan's JobConfig with our sections; what :func:`parse` returns."""

ALL_RANGES = {
    **FIELD_RANGES,
    **{key: valid for backend in BACKENDS.values() for key, valid in backend.config_ranges.items()},
}
"""The valid range of every numeric field of the job config."""


def parse(args: list[str]):
    """TOML (``--job.config_file``) + CLI overrides -> job config (see :func:`config.parse_job_config`)."""
    return config.parse_job_config(args, MergedJobConfig)


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


def validate(job_config, *, device_type: str | None, world_size: int | None = None) -> None:
    """Reject invalid values and combinations before anything is allocated.

    ``device_type`` is where the job runs ("cuda"/"cpu"; None when validating
    for another machine, which skips the checks of what this machine can run);
    ``world_size`` the number of processes in the job, when known.
    """
    backend = comm_backend(job_config)
    if backend not in BACKENDS:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend = '{backend}' is not a backend: "
            f"use one of {', '.join(BACKENDS)} ('standard' means nccl)"
        )
    _check_foreign_sections(job_config, backend)
    check_ranges(job_config, ALL_RANGES)
    shape = moe_shape(job_config)
    _check_attention(job_config, device_type)
    _check_profiling(job_config, device_type)
    _check_expert_degrees(job_config, shape)
    _check_activation_checkpointing(job_config)
    _check_pipeline(job_config, device_type)
    check_dataset_options(job_config)
    if world_size is not None:
        _check_world_size(job_config, world_size)
    if shape is not None:
        BACKENDS[backend].validate_config(job_config, device_type, shape)
    _check_expert_placement(job_config, shape)


def _check_expert_placement(job_config, shape: MoEShape | None) -> None:
    path = job_config.expert_placement.file
    if not path:
        return
    where = f"expert_placement.file = '{path}'"
    if shape is None:
        raise ConfigError(f"{where} but the model has no MoE layers: remove [expert_placement] file")
    load_placement(path).check_job(
        moe_layer_ids(job_config), shape.num_experts, job_config.parallelism.expert_parallel_degree, where
    )


def _check_foreign_sections(job_config, backend: str) -> None:
    """A backend's knobs live in its own section: setting another backend's is a mistake."""
    for name, backend_class in BACKENDS.items():
        section_name = backend_class.config_section
        if section_name is None or name == backend:
            continue
        section = getattr(job_config, section_name)
        changed = [f.name for f in fields(section) if getattr(section, f.name) != f.default]
        if changed:
            raise ConfigError(
                f"[{section_name}] {changed[0]} is set but parallelism.expert_parallel_comm_backend "
                f"is '{backend}': remove the [{section_name}] settings or select "
                f"expert_parallel_comm_backend = '{name}'"
            )


def _check_attention(job_config, device_type: str | None) -> None:
    attention = getattr(model_args_of(job_config), "attn_type", "sdpa")
    if attention == "flex" and device_type == "cpu":
        raise ConfigError(
            f"model.flavor = '{job_config.model.flavor}' uses FlexAttention, whose backward PyTorch does not "
            "implement on CPU: use an SDPA flavour (e.g. debugmodel) on CPU"
        )


def _check_profiling(job_config, device_type: str | None) -> None:
    if job_config.profiling.enable_profiling and device_type == "cpu":
        raise ConfigError(
            "profiling.enable_profiling on CPU: torchtitan 0.2.2's profiler asks torch.profiler for a GPU activity "
            "that a CPU-only machine does not have (it passes None, and every rank fails at the first step); "
            "unset it on CPU (py-spy record --subprocesses profiles a CPU job)"
        )


def _check_expert_degrees(job_config, shape: MoEShape | None) -> None:
    backend = comm_backend(job_config)
    backend_class = BACKENDS[backend]
    ep = job_config.parallelism.expert_parallel_degree
    if shape is not None and shape.num_experts % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} does not divide the model's "
            f"{shape.num_experts} experts: pick a divisor of {shape.num_experts}"
        )
    if backend_class.needs_expert_parallelism and ep == 1 and shape is not None:
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


def _check_activation_checkpointing(job_config) -> None:
    ac = job_config.activation_checkpoint
    if ac.mode == "memory_budget" and not (job_config.compile.enable and "model" in job_config.compile.components):
        raise ConfigError(
            "activation_checkpoint.mode = 'memory_budget' works through torch.compile: set compile.enable = true "
            "(with 'model' in compile.components), or use mode 'selective' or 'full'"
        )
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        option = ac.selective_ac_option
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = '{option}': use 'op' (per operator) "
                "or a positive integer N (every N-th layer)"
            )


def _check_pipeline(job_config, device_type: str | None) -> None:
    p = job_config.parallelism
    overlapped_dual_pipe = (
        p.pipeline_parallel_degree > 1
        and p.expert_parallel_degree > 1
        and p.pipeline_parallel_schedule.lower() == "dualpipev"
        and p.pipeline_parallel_expert_parallel_overlap
    )
    if not overlapped_dual_pipe:
        return
    if job_config.activation_checkpoint.mode != "none":
        raise ConfigError(
            "pipeline_parallel_schedule = 'DualPipeV' overlapping expert parallelism cannot run with "
            f"activation_checkpoint.mode = '{job_config.activation_checkpoint.mode}' (torchtitan 0.2.2): set "
            "activation_checkpoint.mode = 'none' or parallelism.pipeline_parallel_expert_parallel_overlap = false"
        )
    if device_type == "cpu":
        raise ConfigError(
            "pipeline_parallel_schedule = 'DualPipeV' overlaps expert parallelism on CUDA streams, which a CPU "
            "does not have: set parallelism.pipeline_parallel_expert_parallel_overlap = false on CPU"
        )


def _check_world_size(job_config, world_size: int) -> None:
    p = job_config.parallelism
    fixed = p.data_parallel_replicate_degree * p.context_parallel_degree
    fixed *= p.tensor_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not a multiple of dp_replicate x cp x tp x pp = {fixed}: "
                f"change NGPU (or the node count) or those degrees"
            )
        shard = world_size // fixed
    elif shard * fixed != world_size:
        raise ConfigError(
            f"dp_replicate x dp_shard x cp x tp x pp = {shard * fixed} but the world size is "
            f"{world_size}: set parallelism.data_parallel_shard_degree = -1 or NGPU = {shard * fixed}"
        )
    ep, etp, tp = p.expert_parallel_degree, p.expert_tensor_parallel_degree, p.tensor_parallel_degree
    divisor = tp * 2 * p.context_parallel_degree
    seq_len = job_config.training.seq_len
    if seq_len % divisor:
        raise ConfigError(
            f"training.seq_len = {seq_len} is not divisible by TP x 2 x CP = {divisor}: use a multiple of {divisor}"
        )
    batch_ranks = p.data_parallel_replicate_degree * shard
    global_batch = job_config.training.global_batch_size
    local_batch = job_config.training.local_batch_size
    if global_batch != -1 and global_batch % (local_batch * batch_ranks):
        raise ConfigError(
            f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size x data-parallel "
            f"ranks = {local_batch} x {batch_ranks}: use a multiple of {local_batch * batch_ranks} (or -1)"
        )
    if p.pipeline_parallel_degree > 1 and local_batch % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"training.local_batch_size = {local_batch} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}: "
            "use a multiple of it"
        )
    microbatches = local_batch // p.pipeline_parallel_microbatch_size
    stages = 2 * p.pipeline_parallel_degree  # DualPipeV runs two stages per rank (the V)
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule.lower() == "dualpipev" and microbatches < stages:
        raise ConfigError(
            f"pipeline_parallel_schedule = 'DualPipeV' runs {stages} stages and needs as many microbatches, but "
            f"training.local_batch_size = {local_batch} / pipeline_parallel_microbatch_size = "
            f"{p.pipeline_parallel_microbatch_size} gives {microbatches}: raise local_batch_size to "
            f"{stages * p.pipeline_parallel_microbatch_size} or more"
        )
    if ep == 1:
        return
    if etp not in (1, tp):
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree = {etp}: use 1 or tensor_parallel_degree ({tp})")
    borrowed = shard * p.context_parallel_degree * tp
    if borrowed % (ep * etp):
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} (x expert TP {etp}) must divide "
            f"dp_shard x cp x tp = {borrowed}: choose an EP degree that divides {borrowed}"
        )
    expert_shards = borrowed // (ep * etp)
    if shard * p.context_parallel_degree == 1 and expert_shards > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} leaves {expert_shards} ranks holding the same "
            f"experts, but there is no data-parallel shard dimension to shard them over "
            f"(dp_shard x cp = 1): set expert_parallel_degree = {borrowed // etp} or add data parallelism"
        )


def saved_moe_layers(job_config, rank_layers, rank_moe_layers) -> tuple[int, str]:
    """MoE layers on this rank whose dispatch output stays alive for backward, and why."""
    ac = job_config.activation_checkpoint
    moe = len(rank_moe_layers)
    if ac.mode == "none":
        return moe, "no activation checkpointing: every MoE layer keeps its dispatched rows"
    if ac.mode == "full":
        return 0, "full activation checkpointing: rows are recomputed in backward (one layer's are live at a time)"
    if ac.selective_ac_option == "op":
        return moe, "per-op selective checkpointing: dispatch is on the save list, so every MoE layer keeps its rows"
    every = int(ac.selective_ac_option)
    wrapped = {layer for index, layer in enumerate(rank_layers, start=1) if index % every == 0}
    kept = sum(layer not in wrapped for layer in rank_moe_layers)
    return kept, f"per-layer selective checkpointing every {every} layers: {kept} of {moe} MoE layers keep their rows"
