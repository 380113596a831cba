"""Non-blocking HybridEP never waits for the host, metrics counters included.

Counted over one MoE layer's forward and backward through the reference
kernels, with the per-layer dispatch counters on: scalar reads and host copies
(.item, .tolist, .cpu, bool(), ...) and ops whose output shape depends on
values (nonzero, boolean indexing, bincount, unique, ...), any of which would
stall a GPU stream. Blocking mode is the control: it must sync.
"""

import pytest

from tests.ep_cases import Case, host_sync_worker
from tests.helpers import run_distributed

EP = 2
CASE = Case("host_sync", num_experts=8, top_k=2, score_before_experts=False, seed=31, pad_multiple=8)


@pytest.fixture(scope="module")
def events():
    return run_distributed(EP, host_sync_worker, CASE)


def test_non_blocking_dispatch_and_combine_never_sync(events):
    for rank_events in events:
        assert rank_events["non_blocking"] == {}
        assert rank_events["non_blocking_counters_recorded"]


def test_blocking_mode_syncs(events):
    """The counter sees syncs where they exist: blocking mode sizes its output on the host."""
    for rank_events in events:
        assert sum(rank_events["blocking"].values()) > 0
