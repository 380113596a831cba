"""Expert-parallel metrics: exact counters, their reduction and summary, the drop warning."""

import functools
import itertools
import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.checkpoint import checkpoint

from tests.helpers import run_distributed
from tests.training.cases import console_of_a_run
from torchtitan_ext.ep.base import DispatchStats, Routing
from torchtitan_ext.training.metrics import ExpertParallelMetrics
from torchtitan_ext.balancing.routing_stats import load
from torchtitan_ext import routing_report


def test_dispatch_counters_are_exact():
    stats = DispatchStats()
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]])
    stats.record_routing(ids, num_experts=4)
    stats.record_routing(torch.tensor([[2, 3]]), num_experts=4)
    stats.record_rows(torch.tensor([8, 0, 16]))
    stats.record_rows(torch.tensor([8, 8, 0]))
    stats.record_kept(torch.tensor([3, 0]))
    stats.record_kept(torch.tensor([1, 1]))
    routed, rows, kept = stats.read_and_reset()
    assert routed.tolist() == [2, 1, 1, 4]
    assert (int(rows), int(kept)) == (40, 5)
    assert stats.read_and_reset() == (None, None, None)


def test_recomputation_is_not_counted():
    stats = DispatchStats()
    x = torch.randn(3, requires_grad=True)

    def layer(x):
        stats.record_routing(torch.tensor([[1], [1], [0]]), num_experts=2)
        return x * 2

    checkpoint(layer, x, use_reentrant=False).sum().backward()  # forward + recompute in backward
    routed, _, _ = stats.read_and_reset()
    assert routed.tolist() == [1, 2]


class _Dims:
    def __init__(self, tp=1, etp=1):
        self.tp, self.etp, self.ep_enabled = tp, etp, True


class _JobConfig:
    class parallelism:
        expert_parallel_comm_backend = "hybridep"

    class hybridep:
        non_blocking_capacity_factor = 0.3


def _summary(sums, maxima, dims=None):
    metrics = ExpertParallelMetrics(_JobConfig, dims or _Dims())
    return metrics, *metrics._summarize(sums, maxima, num_experts=4, step=7)


def test_summary_of_reduced_counters(caplog):
    # columns: routed per expert (4), rows, kept pairs, ranks holding the layer, ranks counting kept pairs.
    # layer 0 dense (no holder); layer 1: routed [10, 30, 20, 20], 100 rows over 2 ranks (max 60), 72 of
    # the 80 pairs kept (8 dropped); layer 2: a backend that cannot drop (no kept counts)
    sums = [[0, 0, 0, 0, 0, 0, 0, 0], [10, 30, 20, 20, 100, 72, 2, 2], [20, 20, 20, 20, 80, 0, 2, 0]]
    with caplog.at_level(logging.WARNING):
        metrics, values, console = _summary(sums, [0, 60, 40])
    assert values["ep/layer_1/load_imbalance"] == pytest.approx(30 / 20)
    assert values["ep/layer_1/drop_rate"] == pytest.approx(8 / 80)
    assert values["ep/layer_1/recv_rows_max"] == 60 and values["ep/layer_1/recv_rows_mean"] == 50
    assert values["ep/layer_2/load_imbalance"] == pytest.approx(1.0) and values["ep/layer_2/dropped_pairs"] == 0
    assert "ep/layer_0/drop_rate" not in values
    assert values["ep/dropped_pairs"] == 8 and values["ep/drop_rate"] == pytest.approx(8 / 160)
    assert values["ep/load_imbalance_worst_layer"] == 1
    # all layers: the busiest ranks' 60 + 40 rows over the mean ranks' 50 + 40
    assert values["ep/recv_rows_max_over_mean_all_layers"] == pytest.approx(100 / 90)
    assert console == "recv max/mean: 1.20  dropped: 5.00%"
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "in MoE layer 1 by step 7" in warnings[0]
    assert "raise hybridep.non_blocking_capacity_factor (now 0.3" in warnings[0]
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        metrics._summarize(sums, [0, 60, 40], num_experts=4, step=8)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING], "warns once per run"


def test_replicated_routing_and_dispatch_are_not_double_counted():
    # expert TP=2: both expert-TP ranks route and dispatch the same tokens (routed and kept counts arrive twice)
    sums = [[20, 60, 40, 40, 200, 144, 4, 4]]
    _, values, _ = _summary(sums, [60], _Dims(tp=2, etp=2))
    assert values["ep/dropped_pairs"] == 8 and values["ep/drop_rate"] == pytest.approx(8 / 80)


def test_inconsistent_kept_counts_are_an_error():
    """Routed less kept is a drop count only if every rank holding the layer counted its kept pairs,
    and never negative."""
    with pytest.raises(RuntimeError, match="MoE layer 0: 1 of the 2 ranks holding it counted kept pairs"):
        _summary([[10, 30, 20, 20, 100, 72, 2, 1]], [60])
    with pytest.raises(RuntimeError, match="MoE layer 0: 2 more pairs kept than routed"):
        _summary([[10, 30, 20, 20, 100, 82, 2, 2]], [60])


@pytest.mark.slow
def test_training_log_reports_drops_once_and_records_routing(tmp_path):
    """A run of the default job: drops in every step line, one warning, routing statistics saved and plotted.
    (The launcher's part of the console, that it shows these lines of rank 0, is the quick start's test.)"""
    args = ["--job.config_file", "train_configs/debug_model.toml",
            "--model.flavor", "debugmodel_small_3layers", "--training.steps", "2", "--metrics.disable_color_printing",
            "--job.dump_folder", str(tmp_path),
            "--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.non_blocking_capacity_factor", "0.3",
            "--routing_stats.enable", "--routing_stats.save_every", "1", "--metrics.enable_tensorboard"]
    rank0 = run_distributed(2, console_of_a_run, args)[0]
    step_lines = [line for line in rank0 if "step:" in line and "loss:" in line]
    assert len(step_lines) == 2
    assert all("recv max/mean: " in line and len(line) < 120 for line in step_lines), step_lines
    assert "dropped: " in step_lines[0], "the first step drops: its line shows the rate"
    # the imbalance summed over the layers goes to TensorBoard (the console line keeps to 120 columns)
    events = next((tmp_path / "tb").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    logged = accumulator.Scalars("ep/recv_rows_max_over_mean_all_layers")
    assert [event.step for event in logged] == [1, 2] and all(event.value >= 1.0 for event in logged)
    warnings = [line for line in rank0 if "(token, expert) pairs" in line and "dropped" in line]
    assert len(warnings) == 1 and "raise hybridep.non_blocking_capacity_factor" in warnings[0]

    folder = tmp_path / "routing_stats"
    assert sorted(p.name for p in folder.glob("*.npz")) == ["routing_step000001-000001.npz", "routing_step000002-000002.npz"]
    data = load(folder / "routing_step000002-000002.npz")
    # the debug model cut to 3 layers: MoE layers 1 and 2, 8 experts, top-3; 2 ranks x 4 sequences x 256
    # tokens
    assert data["layers"].tolist() == [1, 2]
    assert data["tokens_per_expert"].shape == (1, 2, 8)
    assert (data["tokens_per_expert"].sum(axis=2) == 2 * 4 * 256 * 3).all()
    # the report's co-activation plot is of the layer whose busiest expert is furthest above the mean, over steps
    totals = sum(load(path)["tokens_per_expert"].sum(axis=0) for path in folder.glob("*.npz"))  # [layers, experts]
    furthest = data["layers"][int((totals.max(axis=1) / totals.mean(axis=1)).argmax())]
    assert [path.name for path in routing_report.main([str(folder)])] == ["expert_load.png",
                                                                         f"coactivation_layer{furthest}.png"]


def _metrics_processor(log_freq: int, dump_folder):
    from torchtitan.distributed import ParallelDims

    from torchtitan_ext import runtime
    from torchtitan_ext.config import parse
    from torchtitan_ext.training.metrics import build_metrics_processor

    runtime.configure()
    job_config = parse(["--job.config_file", "train_configs/debug_model.toml", "--metrics.log_freq", str(log_freq),
                        "--job.dump_folder", str(dump_folder)])
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    processor = build_metrics_processor(job_config, dims)
    processor.num_flops_per_token = 1
    logged = {}
    processor.logger.log = lambda metrics, step: logged.update({step: metrics})
    return processor, logged


@pytest.mark.parametrize("log_freq", [1, 5])
def test_step_time_after_a_resume_counts_only_the_steps_since_the_last_log(log_freq, monkeypatch, tmp_path):
    """Resumed at step 10, the first line's step time covers the steps trained, not 10 + them."""
    processor, logged = _metrics_processor(log_freq, tmp_path)
    # a clock that reads 3 s later at each call: the suite's other processes cannot stretch the interval
    processor.time_last_log = 100.0
    monkeypatch.setattr("torchtitan_ext.training.metrics.time.perf_counter", functools.partial(next, itertools.count(103.0, 3.0)))
    for step in range(11, 16):  # torchtitan's train_step asks should_log once per step
        if processor.should_log(step):
            processor.log(step, 1.0, 1.0, 0.5)
    logged_step = 11 if log_freq == 1 else 15
    step_time = logged[logged_step]["time_metrics/end_to_end(s)"]
    assert step_time == pytest.approx(3.0 / (1 if log_freq == 1 else 5), rel=1e-9)


def test_a_validation_pass_is_left_out_of_the_training_steps_time_and_throughput(monkeypatch, tmp_path):
    """Step 1 logged at t = 103; from 110 to 120 a validation reads 500 tokens, and logs 50 tokens/s; step 2 (100
    tokens before the pass, 200 after) is logged at t = 125: its 12 s of training (7 before the pass, 5 after) and
    300 tokens, not 22 s and 800."""
    from torchtitan_ext.records.metrics import read_metrics, VALIDATION_FILE

    processor, logged = _metrics_processor(1, tmp_path)
    now = [103.0]
    monkeypatch.setattr("torchtitan_ext.training.metrics.time.perf_counter", lambda: now[0])
    processor.time_last_log = 100.0
    processor.log(1, 1.0, 1.0, 0.5)
    processor.ntokens_since_last_log = 100
    now[0] = 110.0
    with processor.validation_window():
        processor.ntokens_since_last_log += 500  # as torchtitan's validator counts its batches
        now[0] = 120.0
        processor.log_validation(2.0, 1)
    processor.ntokens_since_last_log += 200
    now[0] = 125.0
    processor.log(2, 1.0, 1.0, 0.5)
    assert read_metrics(tmp_path, VALIDATION_FILE)[0]["validation_metrics/throughput(tps)"] == pytest.approx(50.0)
    assert logged[2]["time_metrics/end_to_end(s)"] == pytest.approx(12.0)
    assert logged[2]["throughput(tps)"] == pytest.approx(25.0)


def test_evaluation_forwards_are_not_counted():
    """Validation runs the model in eval mode: neither the dispatch counters nor the routing recorder count it."""
    from torchtitan_ext.balancing.routing_stats import RoutingRecorder

    from types import SimpleNamespace

    from torchtitan_ext.ep import NcclExpertParallel

    class WithoutCommunication(NcclExpertParallel):
        """The nccl backend's dispatch path with its collectives left out: each pick is a row."""

        def dispatch(self, x, scores, expert_ids, num_experts, group, sent_counts=None):
            return x.repeat_interleave(expert_ids.shape[1], dim=0), torch.bincount(expert_ids.reshape(-1), minlength=2)

    style = WithoutCommunication(score_before_experts=False)
    experts = torch.nn.Module()
    experts.num_experts = 2
    mesh = SimpleNamespace(ndim=1, get_group=lambda: None)
    routing = Routing(torch.ones(3, 2), torch.tensor([[0, 1], [1, 1], [0, 0]]))
    for training in (True, False, True):
        experts.train(training)
        style._token_dispatch(experts, (torch.zeros(3, 4), routing), mesh)
    routed, rows, _ = style.stats.read_and_reset()
    assert routed.tolist() == [6, 6] and int(rows) == 12, "two training forwards counted, the eval one not"

    router = torch.nn.Linear(4, 2)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"1": torch.nn.Module()})})
    model.layers["1"].moe = torch.nn.Module()
    model.layers["1"].moe.router = router
    recorder = RoutingRecorder(num_layers=2, num_experts=2, top_k=1, device=torch.device("cpu"))
    recorder.attach([model])
    ids = torch.tensor([[1], [0], [1]])
    for training in (True, False):
        model.train(training)
        recorder._router_hook(1)(router, (), (None, ids))
    assert recorder.current[1].tolist() == [1, 2]
