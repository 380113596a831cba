"""bench replica_transfer times the replicas' fetch and gradient return through the op training calls."""

import re

import pytest

from torchtitan_ext.bench.replica_transfer import main


@pytest.mark.slow
def test_a_run_times_both_transfers_of_each_slot_count(capsys):
    assert main(["--slots", "1", "--iterations", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    # the debug model's expert: w1, w2 and w3 of 256 x 256 floats each
    assert re.fullmatch(r"\| 1 \| 0\.750 \| \d+\.\d{3} \| \d+\.\d{3} \| \d+\.\d{2} \|", row), row
