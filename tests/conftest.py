"""Session fixtures."""

import pytest

from tests.helpers import REPO_ROOT


@pytest.fixture(scope="session")
def embedded_assets():
    """The embedded corpus and tokenizer, built once into the default directory."""
    from torchtitan_ext.data import DEFAULT_ASSETS_DIR, ensure_assets

    return ensure_assets(REPO_ROOT / DEFAULT_ASSETS_DIR)
