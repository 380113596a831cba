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


def pytest_terminal_summary(terminalreporter):
    """Times a test measured and asserted a bound on (record_property("measured", ...)), one line each,
    so that a suite's log carries them (docs/reliability.md quotes them)."""
    lines = [
        f"{report.nodeid}: {value}"
        for report in terminalreporter.stats.get("passed", [])
        for name, value in report.user_properties
        if name == "measured"
    ]
    if lines:
        terminalreporter.section("measured times")
        for line in lines:
            terminalreporter.write_line(line)
