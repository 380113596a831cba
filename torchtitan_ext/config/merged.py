"""torchtitan's JobConfig with our sections: a class made at run time, whose module this is.

tyro looks for each top-level section's docstring in the merged class's source on every parse (a search per
section): the search reads this module's file, so it stays this short.
"""

import functools
from dataclasses import field, make_dataclass

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TorchTitanJobConfig


@functools.cache
def merged_job_config(sections: tuple[tuple[str, type], ...]) -> type:
    """torchtitan's JobConfig with one field per ``(name, section class)``, once per set of sections."""
    ours = make_dataclass("JobConfig", [(name, cls, field(default_factory=cls)) for name, cls in sections])
    merged = ConfigManager._merge_configs(TorchTitanJobConfig, ours)
    merged.__module__ = __name__
    return merged
