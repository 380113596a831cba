"""The valid range of every numeric field: torchtitan's sections' here, each feature's where it registers
its section (:func:`torchtitan_ext.config.registry.register_section`)."""

import types
import typing
from dataclasses import dataclass, fields, is_dataclass

from torchtitan_ext.config.errors import ConfigError

@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    also: tuple = ()
    """Sentinels allowed besides the range (e.g. -1 meaning "automatic")."""
    meaning: str = ""

    def problem(self, value) -> str | None:
        if value is None or value in self.also:
            return None
        low_ok = self.minimum is None or (value > self.minimum if self.exclusive_minimum else value >= self.minimum)
        high_ok = self.maximum is None or (value < self.maximum if self.exclusive_maximum else value <= self.maximum)
        if low_ok and high_ok:
            return None
        return f"use {self.describe()}"

    def describe(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"{'<' if self.exclusive_maximum else '<='} {self.maximum:g}")
        text = "a value " + " and ".join(parts)
        if self.also:
            text += " (or " + " or ".join(str(v) for v in self.also) + ")"
        return text + (f" ({self.meaning})" if self.meaning else "")


AT_LEAST_1 = Range(1)
AT_LEAST_0 = Range(0)
POSITIVE = Range(0, exclusive_minimum=True)
FRACTION = Range(0, 1)
DEGREE = Range(1, meaning="a parallelism degree")

FIELD_RANGES: dict[str, Range] = {
    "profiling.profile_freq": Range(1, meaning="steps between profiles"),
    "profiling.profiler_active": AT_LEAST_1,
    "profiling.profiler_warmup": AT_LEAST_0,
    "metrics.log_freq": Range(1, meaning="steps between log lines"),
    "optimizer.lr": POSITIVE,
    "optimizer.beta1": Range(0, 1, exclusive_maximum=True),
    "optimizer.beta2": Range(0, 1, exclusive_maximum=True),
    "optimizer.eps": POSITIVE,
    "optimizer.weight_decay": AT_LEAST_0,
    "lr_scheduler.warmup_steps": Range(0, meaning="steps"),
    "lr_scheduler.total_steps": Range(1, meaning="steps, or unset for training.steps"),
    "lr_scheduler.decay_ratio": FRACTION,
    "lr_scheduler.min_lr_factor": FRACTION,
    "training.local_batch_size": Range(1, meaning="sequences per rank"),
    "training.global_batch_size": Range(1, also=(-1,), meaning="sequences per step; -1: local x data parallel"),
    "training.seq_len": Range(1, meaning="tokens per sequence"),
    "training.max_norm": POSITIVE,
    "training.steps": Range(1, meaning="training steps"),
    "training.gc_freq": Range(1, meaning="steps between garbage collections"),
    "training.dataloader.num_workers": AT_LEAST_0,
    "training.dataloader.prefetch_factor": AT_LEAST_1,
    "parallelism.data_parallel_replicate_degree": DEGREE,
    "parallelism.data_parallel_shard_degree": Range(1, also=(-1,), meaning="a degree; -1: the rest of the world"),
    "parallelism.tensor_parallel_degree": DEGREE,
    "parallelism.pipeline_parallel_degree": DEGREE,
    "parallelism.pipeline_parallel_first_stage_less_layers": AT_LEAST_0,
    "parallelism.pipeline_parallel_last_stage_less_layers": AT_LEAST_0,
    "parallelism.pipeline_parallel_layers_per_stage": AT_LEAST_1,
    "parallelism.pipeline_parallel_microbatch_size": Range(1, meaning="sequences per microbatch"),
    "parallelism.context_parallel_degree": DEGREE,
    "parallelism.expert_parallel_degree": DEGREE,
    "parallelism.expert_tensor_parallel_degree": DEGREE,
    "checkpoint.interval": Range(1, meaning="steps between checkpoints"),
    "checkpoint.keep_latest_k": Range(0, meaning="checkpoints kept; 0 keeps all"),
    "checkpoint.load_step": Range(0, also=(-1,), meaning="a step; -1: the latest"),
    "activation_checkpoint.memory_budget": FRACTION,
    "comm.init_timeout_seconds": AT_LEAST_1,
    "comm.train_timeout_seconds": AT_LEAST_1,
    "comm.trace_buf_size": AT_LEAST_0,
    "fault_tolerance.process_group_timeout_ms": AT_LEAST_1,
    "fault_tolerance.replica_id": AT_LEAST_0,
    "fault_tolerance.group_size": AT_LEAST_0,
    "fault_tolerance.min_replica_size": AT_LEAST_1,
    "validation.local_batch_size": Range(1, meaning="sequences per rank"),
    "validation.seq_len": Range(1, meaning="tokens per sequence"),
    "validation.freq": Range(1, meaning="steps between validations"),
    "validation.steps": Range(1, also=(-1,), meaning="batches; -1: the whole dataset"),
    "validation.dataloader.num_workers": AT_LEAST_0,
    "validation.dataloader.prefetch_factor": AT_LEAST_1,
    "debug.seed": AT_LEAST_0,
}
"""The valid range of every numeric field of torchtitan's sections; each of our sections states its own
where it is registered."""


def numeric_fields(cls, prefix: str = "") -> list[str]:
    """Dotted names of every int/float field of ``cls`` (recursively)."""
    names = []
    for f in fields(cls):
        if is_dataclass(f.type):
            names += numeric_fields(f.type, f"{prefix}{f.name}.")
            continue
        members = typing.get_args(f.type) if typing.get_origin(f.type) in (typing.Union, types.UnionType) else (f.type,)
        if any(member in (int, float) for member in members):
            names.append(f"{prefix}{f.name}")
    return names


def check_ranges(job_config, ranges: dict[str, Range]) -> None:
    """ConfigError for the first field of ``ranges`` whose value is out of its range."""
    for dotted, valid in ranges.items():
        value = job_config
        for part in dotted.split("."):
            value = getattr(value, part)
        problem = valid.problem(value)
        if problem:
            raise ConfigError(f"{dotted} = {value}: {problem}")
