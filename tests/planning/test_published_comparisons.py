"""The published comparisons as data (refused in one line when malformed), the advisor's fit on them, and the
validation report that sets its predictions against the published figures (the shipped fit's report on the 671B
job: tests/planning/test_layout_advisor.py, where that job is priced already)."""

import math
import re
from pathlib import Path

import pytest

from torchtitan_ext import plan
from torchtitan_ext.config import ConfigError
from torchtitan_ext.planning.advisor_fit import FittedParameters, fit, load_fit, write_fit
from torchtitan_ext.planning.published_comparisons import Comparison, held_out_goals, load_comparisons, predict, Prediction
from torchtitan_ext.training import prepare

ROW = '''
[[comparison]]
id = "row-1"
url = "https://example.org/run"
source = "the run's page"
date = "2026-01-01"
hardware = "8 GPUs, 4 per node"
model = "DeepSeek-V3 debug model"
parallelism = "EP=8"
batch = "local_batch_size 4"
seq_len = 4096
precision = "bf16"
activation_checkpointing = ""
compared = "two backends"
metric = "TFLOPS/GPU"
role = "fit"
measured = { nccl = 100.0, deepep = 120.0 }
priced = { config = "train_configs/debug_model.toml", overrides = [], topology = "TOPOLOGY", world_size = 8, ep = 8 }
'''


TOPOLOGY = """
name = "two nodes"
compute_tflops = 2.0
overlap = true

[[levels]]
name = "NVLink"
fabric = "nvlink"
workers = 4
bandwidth_GBps = 450.0
latency_us = 3.0

[[levels]]
name = "InfiniBand"
fabric = "rdma"
bandwidth_GBps = 50.0
latency_us = 8.0
"""
"""Without a memory bandwidth, so the advisor counts no local work (each prediction in a fraction of a second)."""


def _written(tmp_path: Path, text: str) -> Path:
    topology = tmp_path / "two_nodes.toml"
    topology.write_text(TOPOLOGY)
    path = tmp_path / "comparisons.toml"
    path.write_text(text.replace('"TOPOLOGY"', f'"{topology}"'))
    return path


def test_the_shipped_comparisons_hold_a_fit_a_held_out_set_and_a_flip():
    comparisons = load_comparisons()
    fit_rows = [c for c in comparisons if c.role == "fit"]
    held_out = [c for c in comparisons if c.role == "held_out"]
    assert fit_rows and all(c.priced for c in fit_rows) and len(held_out) >= 3
    # plain all-to-all is slower on every fit row; a held-out row where it wins checks the other way
    assert "nccl" not in {c.faster(c.measured) for c in fit_rows}
    assert any(c.faster(c.measured) == "nccl" and "hybridep" in c.measured for c in held_out)
    assert all(Path(c.priced.config).is_file() for c in comparisons if c.priced)


@pytest.mark.parametrize("old, new, message", [
    ('role = "fit"', 'role = "train"', "comparison 1 ('row-1'): role 'train': use one of fit, held_out"),
    ('url = "https://example.org/run"\n', "", "comparison 1 ('row-1'): 'url' is missing"),
    ("nccl = 100.0, deepep = 120.0", "nccl = 100.0", "'measured' must give the figures of exactly two backends"),
    ("nccl = 100.0,", "alltoall = 100.0,", "measured backend 'alltoall': use this project's names"),
    ("nccl = 100.0,", "nccl = -1.0,", "measured nccl = -1.0: use the published figure, a finite number > 0"),
    ("nccl = 100.0,", "nccl = inf,", "measured nccl = inf: use the published figure, a finite number > 0"),
    ("overrides = [],", "overides = [],", "priced has no field overides"),
    ('metric = "TFLOPS/GPU"', 'metric = "tokens/s"', "metric 'tokens/s' of a priced row: the advisor predicts"),
    ("world_size = 8,", "world_size = 0,", "priced.world_size must be an integer >= 1"),
    ("world_size = 8,", "world_size = 8, a2a_overlap = 1,", "priced.a2a_overlap = 1: use true or false"),
    ("overrides = [],", 'overrides = [], hf_config = "no/config.json",',
     "priced.hf_config no/config.json: cannot read it (No such file or directory)"),
    ("priced = {", 'unpriced = "no model"\npriced = {', "give exactly one of 'priced'"),
    ('precision = "bf16"', 'precision = "fp8"', "precision 'fp8' of a priced row: the advisor prices bf16, fp32, mxfp8"),
])
def test_a_malformed_comparison_is_refused_in_one_line_naming_its_row(tmp_path, old, new, message):
    assert old in ROW
    path = _written(tmp_path, ROW.replace(old, new))
    with pytest.raises(ConfigError) as refused:
        load_comparisons(path)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"--comparisons {path}")


def test_the_held_out_goals_read_a_step_time_row_the_right_way_round():
    """On a row in s/step the shorter step is the faster backend, and a gap is the slower step over the faster:
    hybridep's 5 s against nccl's 10 s is 100% faster, so a prediction of 7 s against 10 s (43%) misses the factor
    of 2 (read as TFLOPS, -50% against -30%, it would meet it)."""
    from types import SimpleNamespace

    row = Comparison("step-time-row", "", "", "held_out", "s/step", {"nccl": 10.0, "hybridep": 5.0}, None, "")

    def predicted(nccl_s: float, hybridep_s: float) -> dict[str, Prediction]:
        layouts = {backend: SimpleNamespace(step_s=step_s, nominal_links=())
                   for backend, step_s in (("nccl", nccl_s), ("hybridep", hybridep_s))}
        return {row.id: Prediction(row, layouts)}

    assert held_out_goals([row], predicted(10.0, 7.0)) == (
        "the faster backend right on 1 of 1 gaps over 3%, the gap within a factor of 2 on 0 of 1, the figure within "
        "25% on 1 of 2")
    assert held_out_goals([row], predicted(11.0, 6.0)) == (
        "the faster backend right on 1 of 1 gaps over 3%, the gap within a factor of 2 on 1 of 1, the figure within "
        "25% on 2 of 2")
    assert held_out_goals([row], predicted(5.0, 10.0)).startswith("the faster backend right on 0 of 1 gaps")


def test_fit_recovers_the_compute_scale_a_row_was_made_with_and_validation_reports_it(tmp_path, capsys):
    """A fit row whose published figures are the advisor's own at half the topology's compute: the fit finds 0.5,
    writes it with its provenance, and the validation report predicts the row exactly under it."""
    prepare()
    made_with = FittedParameters({"two nodes": 0.5}, (), ("row-1",))
    row = load_comparisons(_written(tmp_path, ROW))[0]
    figures = predict(row, made_with).figures
    assert predict(row).figures["nccl"] > figures["nccl"] * 1.2  # the scale matters to the figures
    path = _written(tmp_path, ROW.replace("nccl = 100.0, deepep = 120.0",
                                          f"nccl = {figures['nccl']!r}, deepep = {figures['deepep']!r}"))
    fitted = fit(load_comparisons(path))
    assert fitted.link_fractions == () and math.isclose(fitted.compute_scale["two nodes"], 0.5,
                                                        rel_tol=1e-5)
    assert all(abs(residual) < 1e-4 for residual in fitted.residuals.values())
    written = tmp_path / "fit.toml"
    write_fit(fitted, written, path)
    assert load_fit(written) == fitted and f"--comparisons {path}" in written.read_text().splitlines()[0]
    plan.main(["--validate", "--comparisons", str(path), "--fit-from", str(written)])
    report = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"  with the fit: nccl \S+, deepep \S+ TFLOPS/GPU \(deepep [+-]\d+\.\d%\); off the published "
                        r"by nccl [+-]0\.0%, deepep [+-]0\.0%; the faster backend agrees", report[-4])
    assert report[-3].endswith(f"with the fit ({written}) on 1 of 1 priced (0 of 0 held out)")
