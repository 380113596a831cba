"""Session fixtures and the suite's machine-independent settings."""

import os

import pytest

from tests.helpers import REPO_ROOT

# Every job in the suite behaves as on a CPU without bf16 matrix units (fp32 by
# default), so that no test's speed or numerics depend on the CPU's bf16 support.
os.environ.setdefault("TORCHTITAN_EXT_CPU_BF16", "emulated")


@pytest.fixture(scope="session")
def embedded_assets():
    """The embedded corpus and tokenizer, built once into the default directory."""
    from torchtitan_ext.data import DEFAULT_ASSETS_DIR, ensure_assets

    return ensure_assets(REPO_ROOT / DEFAULT_ASSETS_DIR)
