"""A job config from the command line: parse (TOML + overrides), fit to this machine, validate."""

import os

from torchtitan.tools.logging import logger

from torchtitan_ext.config.machine import choose_cpu_precision
from torchtitan_ext.config.parsing import command_line_keys, parse_job_config
from torchtitan_ext.config.registry import job_config_class
from torchtitan_ext.config.validation import validate


def parse(args: list[str]):
    """TOML (``--job.config_file``) + CLI overrides -> job config with every registered section;
    ConfigError for unknown keys, ill-typed values and a missing or malformed file."""
    return parse_job_config(args, job_config_class())[0]


def load_job_config(args: list[str], device_type: str | None, world_size: int | None = None):
    """Parse, fit to the CPU (:func:`~torchtitan_ext.config.machine.choose_cpu_precision`) and validate;
    raises ConfigError with a one-line message.

    ``device_type``: where the job runs ("cpu", "cuda"), or None to validate it for another machine.
    ``world_size`` defaults to the job's: NGPU under the fake backend, else torchrun's WORLD_SIZE.
    """
    job_config, explicit = parse_job_config(args, job_config_class())
    if device_type == "cpu":
        logger.info(choose_cpu_precision(job_config, explicit))
    if world_size is None:
        world_size = _world_size_from_env(job_config.comm.mode)
    validate(job_config, device_type=device_type, world_size=world_size, command_line=command_line_keys(args))
    return job_config


def _world_size_from_env(comm_mode: str) -> int | None:
    value = os.environ.get("NGPU" if comm_mode != "default" else "WORLD_SIZE", "")
    return int(value) if value.isdigit() else None
