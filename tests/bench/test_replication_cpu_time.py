"""bench replication_cpu_time: each rank's CPU time split per MoE layer, and the step one device per rank would take."""

import argparse

import pytest

from torchtitan_ext.bench import replication_cpu_time as bench
from torchtitan_ext.runtime.workers import run_workers


def _record(total, choice, layers, wall=20.0):
    return {"total": total, "choice": choice, "wall": wall, "layers": {
        layer: dict(zip(bench.LAYER_SEGMENTS, segments)) for layer, segments in layers.items()}}


# per layer: router (with the count exchange), experts forward (after the dispatch; the fetch is issued before it),
# experts backward (with the return), count exchange, fetch, return
RANK_0 = _record(12.0, 0.5, {1: (1.5, 2.0, 3.0, 0.5, 0.5, 1.0), 3: (1.0, 1.0, 1.0, 0.0, 0.0, 0.0)})
RANK_1 = _record(14.0, 0.25, {1: (2.25, 1.0, 1.0, 0.25, 0.25, 0.25), 3: (1.0, 3.0, 4.0, 0.0, 1.0, 1.0)}, wall=21.0)


def test_each_segment_of_a_layer_waits_for_its_slowest_rank_and_replication_adds_its_slowest_transfers():
    parts = bench.verdict([RANK_0, RANK_1])
    # without transfers, per segment: layer 1 (1, 2, 2) against (2, 1, 0.75); layer 3 (1, 1, 1) against (1, 3, 3)
    assert parts["layers"] == pytest.approx(2.0 + 2.0 + 2.0 + 1.0 + 3.0 + 3.0)
    assert parts["balanced"] == pytest.approx((8.0 + 10.75) / 2)
    # what is left of each rank's step once its layers' timed segments, fetches and choice are out
    assert parts["remainder"] == pytest.approx(max(12.0 - 0.5 - 10.0, 14.0 - 0.25 - 13.5))
    assert parts["replication"] == pytest.approx(0.5 + 0.5 + 1.0 + 1.0 + 1.0 + 0.5)
    assert parts["step"] == pytest.approx(parts["layers"] + parts["remainder"] + parts["replication"])
    assert parts["wall"] == 21.0  # the slowest rank's


def test_a_segment_timed_twice_is_refused():
    with pytest.raises(ValueError, match="a segment was timed twice"):
        bench.verdict([RANK_0, {**RANK_1, "total": 12.0}])


def test_the_mean_rank_per_step_leaves_out_the_warm_up_and_the_transfers_from_their_segments():
    warm = _record(100.0, 100.0, {1: (100.0,) * 6})
    means = bench.mean_segments([[{bench.WARMUP: warm, bench.WARMUP + 1: RANK_0},
                                  {bench.WARMUP: warm, bench.WARMUP + 1: RANK_1}]])
    assert means == pytest.approx({"router": 2.5, "counts": 0.375, "experts_forward": 3.5, "experts_backward": 3.375,
                                   "fetch": 0.875, "return": 1.125, "choice": 0.375, "total": 13.0})


@pytest.mark.parametrize("replicated_losses, failed", [
    ({4: 8.0, 5: 7.0}, False),
    ({4: 8.0, 5: 7.01}, True),  # 1.4e-3 apart
    ({4: 8.0}, True),  # a step missing
    ({4: 8.0, 5: float("nan")}, True),
])
def test_the_arms_must_train_alike(replicated_losses, failed):
    def run(losses):
        rows = [{"step": step, "loss_metrics/global_avg_loss": loss, "ep/recv_rows_max_over_mean_all_layers": 1.0}
                for step, loss in losses.items()]
        parts = {"step": 1.0, "layers": 0.5, "balanced": 0.5, "remainder": 0.5, "replication": 0.0, "wall": 1.0}
        return {"parts": parts, "metrics": rows, "ranks": [{bench.WARMUP + 1: RANK_0}, {bench.WARMUP + 1: RANK_1}]}

    runs = {"0 alpha 2 no replicas": run({4: 8.0, 5: 7.0}), "0 alpha 2 2 slots": run(replicated_losses)}
    lines, got = bench._report(runs, argparse.Namespace(rounds=1), ["alpha 2"], ["no replicas", "2 slots"])
    assert got == failed, lines


@pytest.mark.slow
def test_the_clock_times_every_moe_layers_segments_and_the_weights_transfers_once_replicas_are_chosen(tmp_path):
    job = [*bench.JOB, "--model.flavor", "debugmodel_small", "--parallelism.expert_parallel_degree", "2",
           "--training.steps", "2", "--training.local_batch_size", "2", "--training.seq_len", "64",
           "--expert_replication.slots_per_rank", "1", "--expert_replication.adapt_every", "1",
           "--expert_replication.min_gain", "0", "--job.dump_folder", str(tmp_path)]
    for timed in run_workers(2, bench.train_arms, [("replicas", job)], True, preload=["torchtitan_ext.training.trainer"]):
        steps = timed["replicas"]
        assert sorted(steps) == [1, 2]
        for step, record in steps.items():
            assert sorted(record["layers"]) == [1, 2, 3, 4, 5], step
            chosen = step > 1  # the first choice comes before step 2
            for segments in record["layers"].values():
                # the split exchanges counts at every step, chosen replicas or not
                assert segments["router"] > segments["counts"] > 0, (step, segments)
                assert segments["experts_forward"] > 0 and segments["experts_backward"] > 0, (step, segments)
                assert (segments["fetch"] > 0) == (segments["return"] > 0) == chosen, (step, segments)
                # the return is timed inside the experts' backward; the fetch, before the dispatch, outside
                assert segments["experts_backward"] >= segments["return"], (step, segments)
            assert record["choice"] > 0 or not chosen, step
            timed_parts = record["choice"] + sum(
                segments["router"] + segments["fetch"] + segments["experts_forward"] + segments["experts_backward"]
                for segments in record["layers"].values())
            assert record["total"] > timed_parts, (step, record)


def test_the_headroom_captured_is_the_replicated_arms_share_of_the_gap_to_forced_balance():
    """Round 1: 1.0 s without replicas, 0.8 s under forced balance, 0.9 s replicated: half the headroom. Round 2:
    forced balance no faster (1.0 s), so no headroom to capture: left out."""
    steps = {(0, "alpha 2", "no replicas"): 1.0, (0, "forced balance", "no replicas"): 0.8,
             (0, "alpha 2", "2 slots"): 0.9, (1, "alpha 2", "no replicas"): 1.0,
             (1, "forced balance", "no replicas"): 1.0, (1, "alpha 2", "2 slots"): 0.7}
    runs = {f"{round_index} {skew} {name}": {"parts": {"step": step}} for (round_index, skew, name), step in steps.items()}
    lines = bench._headroom_lines(runs, 2, ["alpha 2", "forced balance"], ["no replicas", "2 slots"])
    assert lines[1] == "alpha 2, 2 slots: headroom captured (CPU-time step) 50% (50%-50%) over 1 round(s)"
    # the campaign's summary row: under forced balance the replicated arm took 0.8 and 1.01 s, its replicas set
    # aside on 1, 1 (round 1) and 1, 0.5 (round 2) of the layers at steps 4 and 5 (step 3 is warm-up)
    for index, step, aside in ((0, 0.8, 1.0), (1, 1.01, 0.5)):
        runs[f"{index} forced balance 2 slots"] = {"parts": {"step": step}, "metrics": [
            {"step": 3, "ep/replica_layers_set_aside": 0.0}, {"step": 4, "ep/replica_layers_set_aside": 1.0},
            {"step": 5, "ep/replica_layers_set_aside": aside}]}
    assert bench.summary(runs, 2, ["alpha 2", "forced balance"], ["no replicas", "2 slots"]) == pytest.approx({
        "headroom_captured_alpha2": 0.5, "headroom_captured_alpha2_low": 0.5, "headroom_captured_alpha2_high": 0.5,
        "replicated_vs_none_alpha2": 0.8, "ideal_vs_none_alpha2": 0.9,
        "balanced_replicated_vs_none": 1.005, "balanced_low": 1.0, "balanced_high": 1.01,
        "balanced_set_aside_share": 0.875})
