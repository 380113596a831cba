"""bench replication reads each run's metrics.jsonl: the worst and all-layers rank load, the slowest rank's step
time and the loss, per step."""

import pytest

from torchtitan_ext.bench import replication
from torchtitan_ext.records.metrics import MetricsFile


def test_a_runs_measurements_are_its_logged_metrics_per_step(tmp_path):
    metrics = MetricsFile(tmp_path)
    for step in range(1, 6):
        metrics.write(step, {"loss_metrics/global_avg_loss": 8.0 + step / 100, "grad_norm": 2.0,
                             "time_metrics/end_to_end(s)": 1.0, "time_metrics/end_to_end_slowest_rank(s)": step + 0.5,
                             "ep/recv_rows_max_over_mean_worst": 1.0 + step / 10,
                             "ep/recv_rows_max_over_mean_all_layers": 1.0 + step / 20,
                             # replication's own, from its first choice on
                             **({"ep/replica_layers_set_aside": 0.5} if step > 3 else {})})
    measured = replication.measured(tmp_path)
    assert measured["set_aside"] == {4: 0.5, 5: 0.5} and measured["choice"] == {}
    assert measured["recv"] == pytest.approx({step: 1.0 + step / 10 for step in range(1, 6)})
    assert measured["all_layers"] == pytest.approx({step: 1.0 + step / 20 for step in range(1, 6)})
    assert measured["loss"] == pytest.approx({step: 8.0 + step / 100 for step in range(1, 6)})
    # the slowest rank's, not the logging rank's; steps 4 and 5 after the 3 warm-up steps
    assert replication.slowest_median(measured["time"]) == pytest.approx(5.0)


def test_the_headroom_captured_is_against_forced_balance_round_by_round():
    """Per round, (no replicas - replicated) / (no replicas - forced balance): 1/2, 3/4 and 3/5 of the headroom,
    median 60%; under forced balance the replicated run's ratio and its replicas set aside on every layer-step
    after the 3 warm-up steps.
    Printed, and in the campaign's summary rows."""
    def run(seconds, ratio=1.0, aside=None):
        return {"median_time": seconds, "time_ratio": ratio, "set_aside": aside or {}}

    rows = {
        ("alpha 2", "no replicas"): [run(10.0), run(10.0), run(10.0)],
        ("alpha 2", "1 slot, adapt every 1"): [run(9.0), run(8.5), run(8.8)],
        ("forced balance", "no replicas"): [run(8.0), run(8.0), run(8.0)],
        ("forced balance", "1 slot, adapt every 1"): [run(8.0, 1.0, {3: 0.0, 4: 1.0, 5: 1.0}), run(8.1, 1.01, {4: 1.0}),
                                                      run(7.9, 0.99, {5: 1.0})],
    }
    assert replication._headroom_lines(rows) == [
        "",
        "alpha 2, 1 slot, adapt every 1: headroom captured 60% (50% to 75%, 3 rounds) (no replicas 10.000 s, forced "
        "balance 8.000 s)",
        "forced balance, 1 slot, adapt every 1: step time vs no replicas 1.000 (0.990 to 1.010, 3 rounds); replicas "
        "set aside on 100% of layer-steps after step 3",
    ]
    figures = replication.headroom(rows)
    assert replication._headroom_fields(figures["alpha 2", "1 slot, adapt every 1"]) == pytest.approx(
        {"headroom_captured_median": 0.6, "headroom_captured_low": 0.5, "headroom_captured_high": 0.75})
    assert replication._headroom_fields(figures["forced balance", "1 slot, adapt every 1"]) == {"set_aside_share": 1.0}
