"""Parsing and validating job configs: torchtitan's sections, ours, and the rules they share.

Every torchtitan 0.2.2 section and key keeps its meaning. This module adds
the sections that are not any one backend's (``[parallelism]``'s widened
backend field, ``[routing_stats]``) and the machinery: TOML + CLI parsing with
unknown keys and ill-typed values named in one line, and the range of every
numeric field. Backends own their sections (see ``torchtitan_ext.ep``);
:mod:`torchtitan_ext.job_config` assembles the whole job config from both.

Nothing here allocates, builds a process group, or imports a backend.
"""

import difflib
import math
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan.config import ConfigManager

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value or combination; the message is one line: field and fix."""


BACKEND_ALIASES = {"standard": "nccl"}
"""torchtitan's backend names that mean one of ours."""

CONFIG_FILE_KEYS = ("--job.config_file", "--job.config-file")


@dataclass
class Parallelism:
    expert_parallel_comm_backend: str = "standard"
    """
    Expert-parallel communication backend, used when expert_parallel_degree > 1.

    - "nccl": all-to-all over torch.distributed (NCCL on GPU, gloo on CPU).
      "standard", torchtitan's name for it, is accepted as an alias.
    - "deepep": DeepEP's kernels; knobs in [deepep].
    - "hybridep": DeepEP's HybridEP kernels (fused permute, optional
      non-blocking mode); knobs in [hybridep].

    No effect for models without MoE layers or when expert_parallel_degree = 1.
    """


@dataclass
class RoutingStats:
    enable: bool = False
    """
    Record routing statistics per MoE layer (tokens per expert per step,
    top-k co-activation, layer-to-layer transitions) and save them as .npz
    (schema in torchtitan_ext/routing_stats.py). Off by default: it costs two
    [E, E] matrix products per MoE layer and microbatch.
    """

    save_every: int = 10
    """Steps between saved files, an integer >= 1; the last training step always saves."""

    folder: str = "routing_stats"
    """Folder for the files, inside job.dump_folder."""

    sample_tokens: int = 256
    """
    Tokens per MoE layer, step and rank whose top-k expert ids are kept
    verbatim (the step's first ones), an integer >= 0; 0 keeps none. The
    placement tool measures distinct destination ranks per token on them,
    which the co-activation counts alone do not give for top-k > 2. A rank
    that routes fewer tokens in a step keeps what it has.
    """


@dataclass
class ExpertPlacement:
    file: str = ""
    """
    Placement file (JSON, made by ``python -m torchtitan_ext.placement``): the
    physical slot of every MoE layer's logical experts. Empty: expert e in
    slot e. Needs expert_parallel_degree > 1, the EP degree and the model the
    file was made for. Routers keep logical ids and a logical-to-slot map sends
    tokens to slots; at start or resume the expert weights and their optimizer
    state move to their slots, and checkpoints record the placement they hold,
    so a checkpoint resumes under any placement (or none).
    """


@dataclass
class Faults:
    on_nonfinite: Literal["stop", "skip_step"] = "stop"
    """
    What a step does when its loss, or an MoE router's output, is not finite
    (NaN or Inf) on any rank:

    - "stop": the run ends with one line naming the step and the first MoE layer
      whose router produced a non-finite score (exit status 1); the last
      checkpoint is untouched;
    - "skip_step": that step's update is skipped (parameters and optimizer state
      stay as they were; the learning-rate schedule advances), a warning names the
      step and the layer, and training goes on.

    Either way it costs one small all-reduce and one host read per step, which
    also carries the ranks' agreement on a preemption signal.
    """


def comm_backend(job_config) -> str:
    """The EP backend's canonical name (aliases resolved)."""
    name = job_config.parallelism.expert_parallel_comm_backend
    return BACKEND_ALIASES.get(name, name)


# ---- parsing ------------------------------------------------------------------------------


def parse_job_config(args: list[str], config_cls) -> Any:
    """TOML (``--job.config_file``) + CLI overrides -> a ``config_cls`` instance.

    Unknown keys, ill-typed values, a missing or malformed file raise
    ``ConfigError`` with one line, before torchtitan's parser sees them.
    """
    config_file = _config_file_from_args(args)
    toml_values = _load_toml(config_file) if config_file else {}
    custom_module = _custom_config_module(args, toml_values)
    if custom_module:
        import importlib

        config_cls = ConfigManager._merge_configs(config_cls, importlib.import_module(custom_module).JobConfig)
    _check_toml(config_cls, toml_values, config_file)
    _check_cli(config_cls, args)
    return ConfigManager(config_cls=config_cls).parse_args(args)


def _config_file_from_args(args: list[str]) -> str | None:
    found = None
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in CONFIG_FILE_KEYS:
            if not value:
                if i + 1 >= len(args):
                    raise ConfigError(f"{key} needs a path: {key}=train_configs/debug_model.toml")
                value = args[i + 1]
            if found is not None and value != found:
                raise ConfigError(
                    f"--job.config_file is given twice ('{found}' and '{value}'): pass one "
                    "(with run_train.sh: CONFIG_FILE=... or --job.config_file, not both)"
                )
            found = value
    return found


def _load_toml(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError(
            f"config file '{path}' not found: set CONFIG_FILE (or --job.config_file) "
            "to an existing TOML, e.g. train_configs/debug_model.toml"
        )
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None


def _custom_config_module(args: list[str], toml_values: dict[str, Any]) -> str:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("--job.custom_config_module", "--job.custom-config-module"):
            return value or (args[i + 1] if i + 1 < len(args) else "")
    job = toml_values.get("job", {})
    return job.get("custom_config_module", "") if isinstance(job, dict) else ""


def _field_types(cls) -> dict[str, Any]:
    return {f.name: f.type for f in fields(cls)}


def _unknown_key_error(section: str, key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key '{section}{key}' in {where}: {hint}")


def _check_toml(cls, values: dict[str, Any], path: str | None, prefix: str = "") -> None:
    types_ = _field_types(cls)
    for key, value in values.items():
        if key not in types_:
            raise _unknown_key_error(prefix, key, list(types_), path or "the config")
        if is_dataclass(types_[key]) and isinstance(value, dict):
            _check_toml(types_[key], value, path, f"{prefix}{key}.")
            continue
        problem = _type_problem(types_[key], value)
        if problem:
            raise ConfigError(f"{prefix}{key} = {value!r} in {path or 'the config'}: {problem}")


def _cli_keys(args: list[str]) -> list[str]:
    """Dotted keys the command line sets ("training.steps"; "--x.no-flag" gives "x.no_flag")."""
    return [
        arg[2:].partition("=")[0].replace("-", "_")
        for arg in args
        if arg.startswith("--") and arg not in ("--help", "-h")
    ]


def explicit_settings(args: list[str]) -> set[str]:
    """Dotted keys that the TOML (``--job.config_file``) or the command line sets explicitly.

    Defaults chosen for the machine (:func:`torchtitan_ext.runtime.choose_cpu_precision`)
    never override these.
    """
    config_file = _config_file_from_args(args)
    toml_values = _load_toml(config_file) if config_file else {}

    def flatten(values: dict[str, Any], prefix: str = ""):
        for key, value in values.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    cli = {key if not key.split(".")[-1].startswith("no_") else key.replace(".no_", ".", 1) for key in _cli_keys(args)}
    return set(flatten(toml_values)) | cli


def _check_cli(cls, args: list[str]) -> None:
    for index, arg in enumerate(args):
        if not arg.startswith("--") or arg in ("--help", "-h"):
            continue
        dotted, has_value, value = arg[2:].partition("=")
        *sections, key = dotted.replace("-", "_").split(".")
        target, prefix = cls, ""
        for section in sections:
            types_ = _field_types(target)
            if section not in types_ or not is_dataclass(types_[section]):
                raise _unknown_key_error(prefix, section, list(types_), "the command line")
            target, prefix = types_[section], f"{prefix}{section}."
        types_ = _field_types(target)
        if key not in types_ and not (key.startswith("no_") and key[3:] in types_):
            raise _unknown_key_error(prefix, key, list(types_), "the command line")
        if key not in types_:
            continue
        if not has_value and index + 1 < len(args) and not args[index + 1].startswith("--"):
            value, has_value = args[index + 1], True
        if has_value:
            problem = _type_problem(types_[key], value, from_text=True)
            if problem:
                raise ConfigError(f"--{prefix}{key} {value}: {problem}")


def _type_problem(field_type, value, from_text: bool = False) -> str | None:
    """Why ``value`` cannot be a ``field_type`` (None if it can, or if the type is not checked here).

    ``from_text``: the value is command-line text, to be read as that type.
    """
    origin = typing.get_origin(field_type)
    if origin is Literal:
        choices = typing.get_args(field_type)
        if value in choices or (from_text and value in [str(c) for c in choices]):
            return None
        return f"use one of {', '.join(repr(c) for c in choices)}"
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(field_type)
        if type(None) in members and (value is None or (from_text and value == "None")):
            return None
        problems = [_type_problem(member, value, from_text) for member in members if member is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if field_type is bool:
        if isinstance(value, bool) or (from_text and value in ("True", "False", "true", "false")):
            return None
        return "use true or false"
    if field_type in (int, float):
        if from_text:
            try:
                number = int(value) if field_type is int else float(value)
            except ValueError:
                return f"use {'an integer' if field_type is int else 'a number'}"
            return None if field_type is int or math.isfinite(number) else "use a finite number"
        if isinstance(value, bool) or not isinstance(value, (int, float) if field_type is float else int):
            return f"use {'an integer' if field_type is int else 'a number'}"
        return None
    if field_type is str and not from_text and not isinstance(value, str):
        return "use a string"
    return None


# ---- ranges of numeric fields ------------------------------------------------------------


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
    "routing_stats.save_every": Range(1, meaning="steps"),
    "routing_stats.sample_tokens": Range(0, meaning="tokens per MoE layer, step and rank"),
}
"""The valid range of every numeric field of torchtitan's sections and of ours that no
backend owns; a backend's section states its own (``RoutedExpertParallel.config_ranges``)."""


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
