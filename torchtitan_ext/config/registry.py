"""Our config sections and their checks, registered by the features that own them.

A feature (each EP backend, the embedded dataset, expert balancing, training's
fault handling) registers its section (a dataclass: its TOML table and
``--section.key`` flags) with the valid range of each numeric field, and the
checks of its settings. :func:`job_config_class` is torchtitan's ``JobConfig``
with every registered section; :func:`~torchtitan_ext.config.validation.validate`
runs every registered check after the shared ones. So config never imports a
feature, and a feature's knobs and rules live beside its code.

Registration happens when the feature is imported: a process reads job configs
after importing what it runs (``torchtitan_ext.training`` imports every feature).
"""

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_ext.config.job import MoEShape
from torchtitan_ext.config.merged import merged_job_config
from torchtitan_ext.config.ranges import FIELD_RANGES, Range



@dataclass(frozen=True)
class ValidationContext:
    """What a check knows besides the job config: where the job runs and its MoE layers' shape."""

    device_type: str | None
    """Where the job runs ("cuda", "cpu"); None when validating for another machine, which skips
    the checks of what this machine can run."""
    world_size: int | None
    """Processes in the job; None when not known yet."""
    moe_shape: MoEShape | None
    """The model's MoE layers (:func:`~torchtitan_ext.config.job.moe_shape`); None for a dense model."""
    command_line: frozenset[str] = frozenset()
    """The dotted keys the command line set (not the TOML file): a setting a user just typed, where one in a
    shipped file may be a profile for another choice (another EP backend's section)."""


Check = Callable[[object, ValidationContext], None]
"""``check(job_config, context)``: raises ConfigError naming the field and the fix."""

_sections: dict[str, type] = {}
_ranges: dict[str, Range] = {}
_checks: list[Check] = []


def register_section(name: str, section_class: type, ranges: dict[str, Range] | None = None) -> None:
    """Add ``[name]`` (a dataclass) to the job config; ``ranges`` keys are "name.field". Idempotent."""
    registered = _sections.get(name)
    if registered is not None and registered is not section_class:
        raise ValueError(f"config section [{name}] is registered by {registered.__module__} already")
    outside = [key for key in ranges or {} if not key.startswith(f"{name}.")]
    if outside:
        raise ValueError(f"section [{name}] states ranges of other sections' fields: {outside}")
    _sections[name] = section_class
    _ranges.update(ranges or {})


def register_check(check: Check) -> None:
    """Run ``check`` in every validation, after the shared checks, in registration order. Idempotent."""
    if check not in _checks:
        _checks.append(check)


def registered_checks() -> list[Check]:
    return list(_checks)


def field_ranges() -> dict[str, Range]:
    """The valid range of every numeric field of the job config: torchtitan's and every registered section's."""
    return {**FIELD_RANGES, **_ranges}


def job_config_class() -> type:
    """torchtitan's JobConfig with every registered section (a new class when a section joins)."""
    return merged_job_config(tuple(_sections.items()))
