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
