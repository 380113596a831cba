"""A job config as a TOML file that loads back to the same config."""

import dataclasses
import os
from pathlib import Path

import tomli_w

from torchtitan_ext.config.errors import ConfigError
from torchtitan_ext.config.loading import load_job_config


def _present(value):
    """``value`` with the None fields left out (TOML has no null; a field left out loads as its default)."""
    if isinstance(value, dict):
        return {key: _present(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_present(item) for item in value]
    return value


def _fields(job_config) -> dict:
    fields = dataclasses.asdict(job_config)
    fields["job"].pop("config_file", None)
    return fields


def write_job_config(job_config, path: Path, world_size: int, header: str) -> None:
    """Write every field of ``job_config`` to ``path`` (atomically: a partial file never stays), then load it
    back and validate it for ``world_size`` ranks; ConfigError, and no file, when it does not load back equal.
    ``header``: comment lines (without '#') that open the file."""
    text = "".join(f"# {line}\n" for line in header.splitlines()) + tomli_w.dumps(_present(_fields(job_config)))
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        loaded = load_job_config(["--job.config_file", str(partial)], device_type=None, world_size=world_size)
        if _fields(loaded) != _fields(job_config):
            raise ConfigError(f"--emit-config {path}: the written config does not load back as the advised one (a "
                              "field TOML cannot hold): pass the advice's overrides on the command line instead")
        os.replace(partial, path)
    except OSError as e:
        raise ConfigError(f"--emit-config {path}: could not write it ({e.strerror}): free space or choose another path") from None
    finally:
        partial.unlink(missing_ok=True)
