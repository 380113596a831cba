"""bench replication_cpu_time: each rank's CPU time split per MoE layer, and the step one device per rank would take."""

import pytest

from torchtitan_ext.bench import replication_cpu_time as bench
from torchtitan_ext.runtime.workers import run_workers


def _record(total, choice, layers, wall=20.0):
    return {"total": total, "choice": choice, "wall": wall, "layers": {
        layer: dict(zip(bench.LAYER_SEGMENTS, segments)) for layer, segments in layers.items()}}


def test_each_segment_of_a_layer_waits_for_its_slowest_rank_and_replication_adds_its_slowest_transfers():
    # router, experts forward (with the fetch), experts backward (with the return), fetch, return
    ranks = [
        _record(10.0, 0.5, {1: (1.0, 2.0, 3.0, 0.5, 1.0), 3: (1.0, 1.0, 1.0, 0.0, 0.0)}),
        _record(9.0, 0.25, {1: (2.0, 1.0, 1.0, 0.25, 0.25), 3: (1.0, 3.0, 4.0, 1.0, 1.0)}, wall=21.0),
    ]
    parts = bench.verdict(ranks)
    # without transfers, per segment: layer 1 (1, 1.5, 2) against (2, 0.75, 0.75); layer 3 (1, 1, 1) against (1, 2, 3)
    assert parts["layers"] == pytest.approx(2.0 + 1.5 + 2.0 + 1.0 + 2.0 + 3.0)
    assert parts["balanced"] == pytest.approx((4.5 + 3.5 + 3.0 + 6.0) / 2)
    # what is left of each rank's step once its layers' timed segments (transfers included) and choice are out
    assert parts["remainder"] == pytest.approx(max(10.0 - 0.5 - 9.0, 9.0 - 0.25 - 12.0))
    assert parts["replication"] == pytest.approx(0.5 + 1.0 + 1.0 + 1.0 + 0.5)
    assert parts["step"] == pytest.approx(parts["layers"] + parts["remainder"] + parts["replication"])
    assert parts["wall"] == 21.0  # the slowest rank's


def test_the_mean_rank_per_step_leaves_out_the_warm_up_and_the_transfers_from_the_experts():
    warm = _record(100.0, 100.0, {1: (100.0, 100.0, 100.0, 100.0, 100.0)})
    ranks = [{2: warm, 4: _record(10.0, 0.5, {1: (1.0, 2.0, 3.0, 0.5, 1.0), 3: (1.0, 1.0, 1.0, 0.0, 0.0)})},
             {2: warm, 4: _record(9.0, 0.25, {1: (2.0, 1.0, 1.0, 0.25, 0.25), 3: (1.0, 3.0, 4.0, 1.0, 1.0)})}]
    means = bench.mean_segments([ranks])
    assert means == pytest.approx({"router": 2.5, "experts_forward": (2.5 + 2.75) / 2, "experts_backward": (3.0 + 3.75) / 2,
                                   "fetch": 0.875, "return": 1.125, "choice": 0.375, "total": 9.5})


@pytest.mark.parametrize("argv, message", [
    (["--steps", "3"], "--steps 3: use more than 3 (the first 3 are warm-up)"),
    (["--nproc", "1"], "use at least 2 ranks, 1 slot, 1 round and a drift of 1 step"),
    (["--alphas", "1,x"], "--alphas 1,x: use finite alphas >= 0, comma separated"),
])
def test_a_bad_argument_is_refused_before_any_run(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_clock_times_every_moe_layers_segments_and_the_transfers_only_with_replicas(tmp_path):
    job = [*bench.JOB, "--model.flavor", "debugmodel_small", "--parallelism.expert_parallel_degree", "2",
           "--training.steps", "3", "--training.local_batch_size", "2", "--training.seq_len", "64"]
    arms = [("none", [*job, "--job.dump_folder", str(tmp_path / "none")]),
            ("replicas", [*job, "--expert_replication.slots_per_rank", "1", "--expert_replication.adapt_every", "1",
                          "--expert_replication.min_gain", "0", "--job.dump_folder", str(tmp_path / "replicas")])]
    ranks = run_workers(2, bench.train_arms, arms, True, preload=["torchtitan_ext.training.trainer"])
    for timed in ranks:
        for arm, steps in timed.items():
            assert sorted(steps) == [1, 2, 3], arm
            for step, record in steps.items():
                assert sorted(record["layers"]) == [1, 2, 3, 4, 5], (arm, step)
                replicated = arm == "replicas" and step > 1  # the first choice comes before step 2
                for segments in record["layers"].values():
                    assert segments["router"] > 0 and segments["experts_forward"] > 0, (arm, step, segments)
                    assert segments["experts_backward"] > 0, (arm, step, segments)
                    assert (segments["fetch"] > 0) == (segments["return"] > 0) == replicated, (arm, step, segments)
                    # the transfers are timed inside the experts' segments
                    assert segments["experts_forward"] >= segments["fetch"], (arm, step, segments)
                    assert segments["experts_backward"] >= segments["return"], (arm, step, segments)
                if arm == "none":
                    assert record["choice"] == 0, step
                elif replicated:
                    assert record["choice"] > 0, step
                timed_parts = record["choice"] + sum(
                    segments["router"] + segments["experts_forward"] + segments["experts_backward"]
                    for segments in record["layers"].values())
                assert record["total"] > timed_parts, (arm, step, record)
