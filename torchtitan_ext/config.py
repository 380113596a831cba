"""Our config sections, merged into torchtitan's ``JobConfig``, and their validation.

Every torchtitan 0.2.2 section and key keeps its meaning. We add:

- ``[parallelism] expert_parallel_comm_backend``: widened to our backends;
- ``[deepep]`` and ``[hybridep]``: knobs of those backends only;
- ``[routing_stats]``: the optional routing-statistics recorder.

:func:`parse_job_config` turns TOML + CLI into a ``JobConfig`` and
:func:`validate` rejects bad values and combinations with one line naming the
field and the fix. Both run before any process group, buffer or model exists.
"""

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TorchTitanJobConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value or combination; the message is one line: field and fix."""


BACKEND_ALIASES = {"standard": "nccl"}
"""torchtitan's backend names that mean one of ours."""

KNOWN_BACKENDS = ("nccl", "deepep", "hybridep")


@dataclass
class Parallelism:
    expert_parallel_comm_backend: str = "standard"
    """
    Expert-parallel communication backend, used when expert_parallel_degree > 1.

    - "nccl": all-to-all over torch.distributed (NCCL on GPU, gloo on CPU).
      "standard", torchtitan's name for it, is accepted as an alias.
    - "deepep": DeepEP v1 normal-mode kernels; knobs in [deepep].
    - "hybridep": DeepEP's HybridEP kernels (fused permute, optional
      non-blocking mode); knobs in [hybridep].

    No effect for models without MoE layers or when expert_parallel_degree = 1.
    """


@dataclass
class DeepEP:
    implementation: Literal["auto", "deep_ep", "reference"] = "auto"
    """
    Which kernels run the DeepEP calls.

    - "auto": the real deep_ep library on CUDA, the reference on CPU. On CUDA
      without deep_ep installed this is an error, never a silent fallback.
    - "deep_ep": the real library (CUDA only; built from source, see docs/backends.md).
    - "reference": torchtitan_ext's pure torch.distributed implementation of the
      same calls with the same results, on any device. Slow; for debugging and CI.
    """

    num_sms: int | None = None
    """
    Streaming multiprocessors the normal-mode kernels use (``Buffer.set_num_sms``).
    Even integer >= 2 (DeepEP runs one channel per 2 SMs); unset keeps the
    library's default of 20. More SMs speed up communication and leave fewer
    for the experts' GEMMs. Ignored by the reference implementation.
    """


@dataclass
class HybridEP:
    implementation: Literal["auto", "deep_ep", "reference"] = "auto"
    """Which kernels run the HybridEP calls; same meaning as in [deepep]."""

    non_blocking_capacity_factor: float | None = None
    """
    Unset: blocking mode. Dispatch waits for the device once per MoE layer to
    learn how many rows each expert receives and sizes its output exactly:
    no token is ever dropped.

    A float in (0, 1]: non-blocking mode. No host sync; dispatch writes into
    M = roundup(int(N * R * min(L, K) * factor), P) rows, with N tokens per rank
    before dispatch, R = EP degree, L = experts per rank, K = top_k and P the pad
    multiple. 1.0 is the worst case when P = 1 (every token to every local expert);
    smaller factors save memory. When the padded layout needs more than M rows,
    the (token, expert) pairs whose row would be >= M are dropped, from the tail
    (highest local expert first, latest source rank and token first); they add
    nothing to the output, the overflow flag is set and they are counted and reported.
    With P > 1 even 1.0 can drop: padding adds up to L * (P - 1) rows.
    """

    num_sms_dispatch: int = 16
    """SMs given to the dispatch kernels (library constructor argument). Integer >= 1."""

    num_sms_combine: int = 16
    """SMs given to the combine kernels (library constructor argument). Integer >= 1."""

    ranks_per_nvlink_domain: int | None = None
    """
    Ranks that share one NVLink domain; exported as
    NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN before the buffer is created. Must
    divide expert_parallel_degree. Unset lets the library count the
    peer-accessible GPUs (8 on an HGX node). GB200 NVL72: 64 (or the EP degree
    when smaller), so that all-to-all stays on NVLink.
    """

    use_mnnvl: bool | None = None
    """
    Multi-node NVLink (the NVL72 fabric). false exports USE_MNNVL=0, which
    disables cross-node NVLink memory; true exports USE_MNNVL=1 (the library
    then uses the fabric where the driver offers it). Unset leaves the
    environment untouched.
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


@dataclass
class JobConfig:
    parallelism: Parallelism = field(default_factory=Parallelism)
    deepep: DeepEP = field(default_factory=DeepEP)
    hybridep: HybridEP = field(default_factory=HybridEP)
    routing_stats: RoutingStats = field(default_factory=RoutingStats)


MergedJobConfig = ConfigManager._merge_configs(TorchTitanJobConfig, JobConfig)
"""torchtitan's JobConfig with our sections; what ``parse_job_config`` returns."""


def comm_backend(job_config) -> str:
    """The EP backend's canonical name (aliases resolved)."""
    name = job_config.parallelism.expert_parallel_comm_backend
    return BACKEND_ALIASES.get(name, name)


def parse_job_config(args: list[str]) -> Any:
    """TOML (``--job.config_file``) + CLI overrides -> ``JobConfig``.

    Unknown keys, a missing or malformed file raise ``ConfigError`` with one line.
    """
    config_file = _config_file_from_args(args)
    toml_values = _load_toml(config_file) if config_file else {}
    config_cls = MergedJobConfig
    custom_module = _custom_config_module(args, toml_values)
    if custom_module:
        import importlib

        config_cls = ConfigManager._merge_configs(
            MergedJobConfig, importlib.import_module(custom_module).JobConfig
        )
    _check_toml_keys(config_cls, toml_values, config_file)
    _check_cli_keys(config_cls, args)
    return ConfigManager(config_cls=config_cls).parse_args(args)


def _config_file_from_args(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            if value:
                return value
            if i + 1 < len(args):
                return args[i + 1]
            raise ConfigError(f"{key} needs a path: {key}=train_configs/debug_model.toml")
    return None


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


def _check_toml_keys(cls, values: dict[str, Any], path: str | None, prefix: str = "") -> None:
    types = _field_types(cls)
    for key, value in values.items():
        if key not in types:
            raise _unknown_key_error(prefix, key, list(types), path or "the config")
        if is_dataclass(types[key]) and isinstance(value, dict):
            _check_toml_keys(types[key], value, path, f"{prefix}{key}.")


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


def _check_cli_keys(cls, args: list[str]) -> None:
    for dotted in _cli_keys(args):
        *sections, key = dotted.split(".")
        target, prefix = cls, ""
        for section in sections:
            types = _field_types(target)
            if section not in types or not is_dataclass(types[section]):
                raise _unknown_key_error(prefix, section, list(types), "the command line")
            target, prefix = types[section], f"{prefix}{section}."
        types = _field_types(target)
        if key not in types and not (key.startswith("no_") and key[3:] in types):
            raise _unknown_key_error(prefix, key, list(types), "the command line")


def validate(
    job_config, *, device_type: str | None, num_experts: int | None, world_size: int | None = None
) -> None:
    """Reject invalid values and combinations before anything is allocated.

    ``device_type`` is where the job runs ("cuda"/"cpu"; None when validating
    for another machine, which skips the kernel-availability checks);
    ``num_experts`` the model flavour's expert count (None for dense models);
    ``world_size`` the number of processes in the job, when known.
    """
    backend = comm_backend(job_config)
    if backend not in KNOWN_BACKENDS:
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend = '{backend}' is not a backend: "
            f"use one of {', '.join(KNOWN_BACKENDS)} ('standard' means nccl)"
        )
    # a backend's knobs live in the section named after it
    for section_name in KNOWN_BACKENDS:
        section = getattr(job_config, section_name, None)
        if section is None:
            continue
        changed = [f.name for f in fields(section) if getattr(section, f.name) != f.default]
        if changed and section_name != backend:
            raise ConfigError(
                f"[{section_name}] {changed[0]} is set but parallelism.expert_parallel_comm_backend "
                f"is '{backend}': remove the [{section_name}] settings or select "
                f"expert_parallel_comm_backend = '{section_name}'"
            )
    # the backends' modules import this one: look the class up at call time
    from torchtitan_ext.ep import BACKENDS

    backend_class = BACKENDS[backend]
    _validate_degrees(job_config, num_experts, backend_class)
    if job_config.routing_stats.save_every < 1:
        raise ConfigError(
            f"routing_stats.save_every = {job_config.routing_stats.save_every}: use an integer >= 1 (steps)"
        )
    if world_size is not None:
        _validate_world_size(job_config.parallelism, world_size, job_config.training.seq_len)
    backend_class.validate_config(job_config, device_type)


def _validate_degrees(job_config, num_experts: int | None, backend_class) -> None:
    ep = job_config.parallelism.expert_parallel_degree
    if ep < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree = {ep}: use an integer >= 1")
    if num_experts is not None and num_experts % ep != 0:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} does not divide the model's "
            f"{num_experts} experts: pick a divisor of {num_experts}"
        )
    backend = comm_backend(job_config)
    if backend_class.needs_expert_parallelism and ep == 1 and num_experts is not None:
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


def _validate_world_size(p, world_size: int, seq_len: int) -> None:
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
    if seq_len % divisor:
        raise ConfigError(
            f"training.seq_len = {seq_len} is not divisible by TP x 2 x CP = {divisor}: "
            f"use a multiple of {divisor}"
        )
    if ep > 1:
        if etp not in (1, tp):
            raise ConfigError(
                f"parallelism.expert_tensor_parallel_degree = {etp}: use 1 or "
                f"tensor_parallel_degree ({tp})"
            )
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
