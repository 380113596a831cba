"""Shared helpers: repository paths, running the launcher, reading step logs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def launcher_env(**overrides: str) -> dict[str, str]:
    """Environment for run_train.sh: this interpreter first on PATH, no color codes."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MASTER_PORT", None)
    env.update(overrides)
    return env


def run_launcher(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ./run_train.sh from the repository root, capturing stdout+stderr."""
    return subprocess.run(
        ["./run_train.sh", *args],
        cwd=REPO_ROOT,
        env=launcher_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def step_losses(output: str) -> dict[int, float]:
    """{step: loss} from the console step lines of one rank's log."""
    plain = ANSI_ESCAPE.sub("", output)
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(plain)}


@pytest.fixture(scope="session")
def embedded_assets():
    """The embedded corpus and tokenizer, built once into the default directory."""
    from torchtitan_ext.data import DEFAULT_ASSETS_DIR, ensure_assets

    return ensure_assets(REPO_ROOT / DEFAULT_ASSETS_DIR)
