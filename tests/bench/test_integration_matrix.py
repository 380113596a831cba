"""The integration matrix's verdict on a run: it trains only with every step in its metrics.jsonl, and is refused
only in one line before any traceback."""

import pytest

from torchtitan_ext.bench.integration_matrix import outcome

LOSSES = {1: 10.5, 2: 9.25}


@pytest.mark.parametrize("returncode, output, losses, expected", [
    (0, "training done\n", LOSSES, ("trains", "10.5000 9.2500")),
    (0, "training done\n", {1: 10.5}, ("FAILED", "training done")),  # a step missing from metrics.jsonl
    (2, "error: parallelism.x = 3: use 2\n", {}, ("refused", "parallelism.x = 3: use 2")),
    (2, "Traceback (most recent call last):\nValueError: bad\nerror: bad\n", {}, ("FAILED", "error: bad")),
    (None, "step 1\n", {}, ("TIMEOUT", "step 1")),
])
def test_a_runs_outcome(returncode, output, losses, expected):
    assert outcome(returncode, output, losses, steps=2) == expected
