"""bench ep: its labels select the backend variants, its rows are what the advisor's calibration reads, and a run's
JSON calibrates the advisor."""

import json
import re
from dataclasses import asdict

import pytest

from torchtitan_ext import plan
from torchtitan_ext.bench import ep
from torchtitan_ext.config import parse
from torchtitan_ext.ep.backends import backend_variants, variant_backend
from torchtitan_ext.measuring import ep_variants
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.records.ep_bench import EPBenchRow


def test_every_backend_variant_is_a_label_and_selects_its_backend_on_the_kernels_it_names():
    """A variant runs on the reference kernels, its ``_lib`` label on its library's; nccl has no kernel choice."""
    labels = ep_variants.labels()
    assert set(backend_variants()) < set(labels) and "upstream" in labels and "nccl_lib" not in labels
    for variant, overrides in backend_variants().items():
        assert ep_variants.job_args(variant)[:len(overrides)] == overrides
        backend = variant_backend(variant)
        assert parse(ep_variants.job_args(variant)).parallelism.expert_parallel_comm_backend == backend
        if variant + ep_variants.LIBRARY in labels:
            assert getattr(parse(ep_variants.job_args(variant)), backend).implementation == "reference"
            library = getattr(parse(ep_variants.job_args(variant + ep_variants.LIBRARY)), backend).implementation
            assert library == BACKENDS[backend].library_implementation and library in ("deep_ep", "nccl_ep")
    assert ep_variants.job_args("nccl") == backend_variants()["nccl"]


def test_a_row_as_the_bench_writes_it_reads_back_through_the_calibrations_schema():
    shape = ep.Shape(tokens=32, hidden=16, experts=4, top_k=2, ep=2)
    row = ep.bench_row("hybridep_non_blocking_lib", shape, 4, times=[0.003, 0.001, 0.002], bare=[0.001, 0.0005],
                       bytes_sent=2_000_000, collectives=3, dtype="bfloat16", forward_only=True,
                       local_bytes=6_000_000, copy_gbps=100.0)
    assert EPBenchRow.read(json.loads(json.dumps(asdict(row))), "rows[0]") == row
    assert (row.min_ms, row.median_ms, row.max_ms, row.bare_median_ms) == pytest.approx((1.0, 2.0, 3.0, 0.75))
    assert (row.ratio, row.overhead_us, row.gbps, row.local_gbps) == pytest.approx((2.0 / 0.75, 1250.0, 1.0, 3.0))
    assert row.comm_backend == "hybridep" and row.job_args == ep_variants.job_args("hybridep_non_blocking_lib")
    upstream = ep.bench_row("upstream", shape, 2, [0.001], [0.001], 1, 1, "float32", False, 1, 1.0)
    assert (upstream.comm_backend, upstream.job_args) == (None, [])


def test_local_work_rows_name_the_groups_that_ran_side_by_side():
    row = ep.bench_row("nccl", ep.Shape(32, 16, 4, 2, ep=1), 2, [0.001], [0.001], 1, 1, "float32", False,
                       local_bytes=5_000_000, copy_gbps=10.0)
    assert ep.shape_label(row) == "T=32 H=16 E=4 K=2 EP=1 x 2 groups"
    assert ep.summary_line(row, 4).endswith("local 5.0 GB/s (50% of the copy's 10.0)")


@pytest.mark.slow
def test_a_bench_ep_run_calibrates_the_layout_advisor(tmp_path, capsys):
    """The rows of a tiny run, in --backends order, read back through the calibration's schema; the file then
    prices each backend it timed between ranks on the link these 2 processes share."""
    out, campaign = tmp_path / "ep.json", tmp_path / "ep_test-machine_2026-11-29.jsonl"
    assert ep.main(["--nproc", "2", "--tokens", "32", "--hidden", "16", "--experts", "4", "--top-k", "2", "--warmup",
                    "1", "--iters", "2", "--no-progress", "--json", str(out), "--campaign", str(campaign)]) == 0
    rows = [EPBenchRow.read(row, f"rows[{i}]") for i, row in enumerate(json.loads(out.read_text())["rows"])]
    assert [(r.backend, r.comm_backend, r.ep, r.processes, r.dtype, r.forward_only) for r in rows] == [
        ("nccl", "nccl", 2, 2, "float32", False), ("deepep", "deepep", 2, 2, "float32", False),
        ("hybridep", "hybridep", 2, 2, "float32", False),
        ("hybridep_non_blocking", "hybridep", 2, 2, "float32", False), ("ncclep", "ncclep", 2, 2, "float32", False),
        ("upstream", None, 2, 2, "float32", False)]
    assert all(row.bytes_sent_per_rank > 0 and row.collectives > 0 and row.local_bytes_per_rank > 0 for row in rows)
    assert len({row.copy_gbps for row in rows}) == 1 and rows[0].copy_gbps > 0
    header, *campaign_rows = [json.loads(line) for line in campaign.read_text().splitlines()]
    assert header["commands"][0].startswith("python -m torchtitan_ext.bench ep ") and campaign_rows == [
        json.loads(json.dumps(row)) for row in json.loads(out.read_text())["rows"]]
    capsys.readouterr()
    plan.main(["--job.config_file", "train_configs/debug_model.toml", "--topology", "hgx_h100_ib", "--world-size", "2",
               "--calibrate-from", str(out)])
    text = " ".join(capsys.readouterr().out.split())
    # the job's own settings: DeepEP V2 (its rows[1]), HybridEP blocking (rows[2]); and DeepEP v1, not timed
    for backend, row in (("nccl", 0), ("deepep", 1), ("hybridep", 2)):
        assert re.search(rf"{backend}: NVLink \(one node\): [0-9.]+ of nominal, measured \(ep\.json rows\[{row}\]: "
                         r"T=32 H=16 EP=2[^,]*, [0-9.e-]+ ms measured, [0-9.e-]+ ms at the nominal rate\)", text), text
    legacy = r"deepep legacy: NVLink \(one node\): dispatch 0\.67, combine 0\.69 of nominal \(1\.1\)"
    assert re.search(legacy, text), text
