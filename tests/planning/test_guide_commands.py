"""Every dry-run command the GB200 guide gives (docs/gb200_nvl72.md) runs as written: the guide's variants are one
command each here, and its commands without overrides are shipped configs' dry runs, which
tests/measuring/test_dry_run.py runs. The commands are read from the guide as inputs; nothing expected is read from
it."""

import re
import shlex
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import REPO_ROOT
from tests.measuring.test_dry_run import SHIPPED
from torchtitan_ext.config import load_job_config
from torchtitan_ext.measuring.dry_run import dry_run
from torchtitan_ext.training import prepare

GUIDE = REPO_ROOT / "docs" / "gb200_nvl72.md"
DRY_RUN = re.compile(r"^COMM_MODE=fake_backend NGPU=(\d+) CONFIG_FILE=(\S+) \./run_train\.sh(.*)$")


def _commands() -> list[tuple[int, str, list[str]]]:
    found = []
    for line in GUIDE.read_text().splitlines():
        match = DRY_RUN.match(line.strip())
        if match:
            found.append((int(match[1]), match[2], shlex.split(match[3])))
    return found


def test_the_guide_gives_the_dry_runs_and_variants():
    """A guard of this file's own coverage: the pattern finds the guide's commands (both configs, four variants), and
    each command without overrides is a shipped config at the world size tests/measuring/test_dry_run.py dry-runs it
    at, so that it runs there (the test below runs the variants)."""
    commands = _commands()
    assert len(commands) >= 6 and len(VARIANTS) >= 4
    assert all(world_size == SHIPPED[Path(config).name] for world_size, config, overrides in commands if not overrides)


VARIANTS = [command for command in _commands() if command[2]]


@pytest.mark.parametrize("world_size, config, overrides", VARIANTS,
                         ids=lambda value: " ".join(value) if isinstance(value, list) else str(value))
def test_the_guides_dry_run_runs(world_size, config, overrides):
    prepare()
    try:
        report = dry_run(load_job_config(["--job.config_file", str(REPO_ROOT / config), *overrides],
                                         device_type=None, world_size=world_size), world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert report.world_size == world_size and report.parameter_devices == {"meta"}
