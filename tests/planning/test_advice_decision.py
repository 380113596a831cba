"""The advice's decision on hand-worked cases: a pick only past the measured band, a nominal-rate bound listed
when it may be as fast, the TFLOPS range from the measured figure ratios, and the error measured from held-out
rows worked by hand."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from torchtitan_ext.config import ConfigError
from torchtitan_ext.planning.advice_decision import decide
from torchtitan_ext.planning.advisor_error import load_error, measured_error, ModelError, write_error

ERROR = ModelError("as shipped", gap_band=0.10, figure_ratio_low=1.25, figure_ratio_high=2.5, rows=("row",))


def layout(step_s: float, nominal: bool = False, tflops: float = 500.0):
    return SimpleNamespace(step_s=step_s, nominal_links=("NVLink",) if nominal else (), tflops_per_gpu=tflops)


def test_a_layout_is_picked_only_when_the_next_is_slower_by_more_than_the_band():
    first, second, third = layout(1.0), layout(1.11), layout(1.5)
    assert decide([first, second, third], ERROR).kind == "pick"
    close = layout(1.09)
    decision = decide([first, close, third], ERROR)
    assert decision.kind == "measure" and decision.candidates == (first, close)


def test_a_nominal_rate_bound_that_may_be_as_fast_is_a_candidate_and_never_a_pick():
    first, bound_fast, bound_slow = layout(1.0), layout(0.8, nominal=True), layout(1.2, nominal=True)
    decision = decide([first, layout(1.3), bound_fast, bound_slow], ERROR)
    assert decision.kind == "measure" and decision.candidates == (first, bound_fast)
    assert decide([bound_fast], ERROR).kind == "measure"


def test_the_tflops_range_divides_by_the_measured_figure_ratios():
    # the advisor overstated the published figures by 1.25x to 2.5x: 500 predicted stands for 200 to 400
    assert decide([layout(1.0, tflops=500.0)], ERROR).tflops_range(layout(1.0, tflops=500.0)) == (200.0, 400.0)


def row(row_id: str, role: str, measured: dict[str, float], metric: str = "TFLOPS/GPU"):
    """A comparison: the gap is how much faster the second backend is than the first, less one."""
    def gap(figures):
        first, second = (figures[name] for name in measured)
        return second / first - 1 if metric == "TFLOPS/GPU" else first / second - 1
    return SimpleNamespace(id=row_id, role=role, metric=metric, measured=measured, gap=gap)


def prediction(figures: dict[str, float]):
    return SimpleNamespace(figures=figures, figure=figures.__getitem__)


def test_the_error_is_measured_on_the_held_out_rows_only_whichever_backend_a_row_lists_first():
    rows = [row("fit", "fit", {"nccl": 100.0, "hybridep": 200.0}),
            row("a", "held_out", {"nccl": 100.0, "hybridep": 110.0}),   # hybridep 1.10x as fast
            row("b", "held_out", {"hybridep": 190.0, "deepep": 200.0})]  # deepep 200/190 = 1.053x as fast
    predictions = {"fit": prediction({"nccl": 900.0, "hybridep": 100.0}),  # a fit row's error counts for nothing
                   "a": prediction({"nccl": 150.0, "hybridep": 150.0}),   # predicted alike: 1.10x off
                   "b": prediction({"hybridep": 300.0, "deepep": 300.0})}  # predicted alike: 1.053x off
    error = measured_error("as shipped", rows, predictions)
    assert error.gap_band == pytest.approx(0.10) and error.rows == ("a", "b")
    listed_the_other_way = [rows[0], rows[1], row("b", "held_out", {"deepep": 200.0, "hybridep": 190.0})]
    assert measured_error("as shipped", listed_the_other_way, predictions).gap_band == pytest.approx(0.10)
    # predicted / published throughput: 1.5, 150/110, 300/190, 1.5
    assert (error.figure_ratio_low, error.figure_ratio_high) == pytest.approx((150 / 110, 300 / 190))
    with pytest.raises(ConfigError, match="no held-out comparison is priced"):
        measured_error("as shipped", rows[:1], predictions)


def test_a_row_timed_in_seconds_per_step_counts_its_throughput_ratio():
    """A model that predicts half the published step time overstates throughput 2x: ratio 2, as in TFLOPS."""
    timed = [row("s", "held_out", {"nccl": 4.0, "deepep": 2.0}, metric="s/step")]  # deepep 2x as fast
    error = measured_error("as shipped", timed, {"s": prediction({"nccl": 2.0, "deepep": 1.0})})
    assert (error.figure_ratio_low, error.figure_ratio_high, error.gap_band) == pytest.approx((2.0, 2.0, 0.0))


def test_the_error_file_reads_back_and_refuses_a_pricing_it_does_not_hold(tmp_path):
    path = tmp_path / "error.toml"
    write_error([ERROR], path, "test")
    assert load_error(path, "as shipped") == replace(ERROR, file=str(path))
    with pytest.raises(ConfigError, match="no measured error for pricing 'my_fit.toml' \\(it holds: as shipped\\)"):
        load_error(path, "my_fit.toml")
    path.write_text(path.read_text().replace("figure_ratio_low = 1.25", "figure_ratio_low = 3.0"))
    with pytest.raises(ConfigError, match="figure_ratio_low must be > 0 and at most figure_ratio_high"):
        load_error(path, "as shipped")
