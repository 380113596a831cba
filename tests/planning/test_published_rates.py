"""Each backend's published kernel figures: quoted from docs/published_ep_figures.md, converted to the
fraction of a link's nominal rate that bytes leaving the rank reach, chosen by the configured SMs, and used
by the advisor's all-to-all price."""

import copy
import json
import re
from dataclasses import asdict

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.bench import ep as bench_ep
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.ep import PLANNING_PROFILES
from torchtitan_ext.ep import deepep, hybridep, nccl
from torchtitan_ext.ep.published_rates import FABRICS, nearest_sms, PublishedRate
from torchtitan_ext.measuring.ep_variants import job_args
from torchtitan_ext.planning import cost_model as cm
from torchtitan_ext.planning.layout_advisor import advise
from torchtitan_ext.planning.layout_links import kernel_rate_fractions
from torchtitan_ext.planning.measured_rates import calibration_rates
from torchtitan_ext.planning.topology import Level, Topology
from torchtitan_ext.records.ep_bench import BENCH_COMMAND

FIGURES = (REPO_ROOT / "docs" / "published_ep_figures.md").read_text(encoding="utf-8")
ALL_RATES = [*nccl.PUBLISHED_RATES, *hybridep.PUBLISHED_RATES,
             *(rate for rates in deepep.PUBLISHED_RATES.values() for rate in rates)]
DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    return float(re.search(r"\d+(?:\.\d+)?", cell)[0])


def _cited_row(rate: PublishedRate) -> tuple[list[str], int, int, int | None]:
    """The document's table row a rate cites, and which of its cells hold dispatch, combine and the SMs."""
    row = re.match(r"docs/published_ep_figures\.md (\S+):", rate.source)[1]
    if row in ("4b", "4c"):  # a section: its row for the rate's SMs (4b: DeepEP's Torch API; 4c: 32 ranks)
        section = FIGURES.split(f"### {row}.")[1].split("###")[0]
        lead = ["DeepEP", "Torch API", str(rate.sms)] if row == "4b" else ["32", str(rate.sms)]
        rows = [cells for cells in map(_cells, section.splitlines()) if cells[:len(lead)] == lead]
        assert len(rows) == 1, (row, rows)
        return (rows[0], 4, 5, 2) if row == "4b" else (rows[0], 3, 4, 1)
    rows = [_cells(line) for line in FIGURES.splitlines() if line.startswith(f"| {row} |")]
    assert len(rows) == 1, (row, rows)
    if row.startswith("1."):
        return rows[0], 6, 7, None
    if row.startswith("3."):
        return rows[0], 4, 5, 6
    if row.startswith("4d."):  # algorithm bandwidth, or for the RDMA level the NIC bus bandwidth beside it
        return (rows[0], 6, 7, 3) if rate.fabric == "rdma" else (rows[0], 4, 5, 3)
    return rows[0], 4, 4, None  # 5.6, 5.8: one busbw for the all-to-all


@pytest.mark.parametrize("rate", ALL_RATES, ids=lambda rate: f"{rate.fabric}-{rate.sms}-{rate.dispatch_GBps}")
def test_every_figure_is_quoted_in_the_document_at_its_row(rate):
    """The row the source names holds the dispatch figure in its dispatch column (BF16 where the table has
    both), the combine figure in its combine column and the SM count in its SM column; the fabric is one a
    topology may name."""
    assert rate.fabric in FABRICS
    cells, dispatch, combine, sms = _cited_row(rate)
    assert (_number(cells[dispatch]), _number(cells[combine])) == (rate.dispatch_GBps, rate.combine_GBps), cells
    if sms is not None:
        assert _number(cells[sms]) == rate.sms, cells


def test_a_figure_becomes_the_share_of_the_nominal_rate_that_leaves_the_rank():
    """HybridEP on GB200, 32 ranks, 16 SMs: 485.50 GB/s dispatch counts the rank's own 1/32 of the bytes."""
    rate = next(r for r in hybridep.PUBLISHED_RATES if r.fabric == "mnnvl" and r.sms == 16)
    assert rate.dispatch_fraction == pytest.approx(485.50 * 31 / 32 / 900)
    assert rate.combine_fraction == pytest.approx(423.19 * 31 / 32 / 900)
    bus = PublishedRate("rdma", 46.0, 40.0, 50.0, None, None, "a bus bandwidth")
    assert (bus.dispatch_fraction, bus.combine_fraction) == (pytest.approx(0.92), pytest.approx(0.8))


def test_the_configured_sms_pick_the_figure():
    rates = hybridep.PUBLISHED_RATES
    assert {r.fabric: r.sms for r in nearest_sms(rates, 16)} == {"mnnvl": 16, "nvlink": 16, "rdma": 8}
    assert {r.fabric: r.sms for r in nearest_sms(rates, 32)} == {"mnnvl": 32, "nvlink": 16, "rdma": 8}
    assert {r.fabric: r.sms for r in nearest_sms(rates, 3)} == {"mnnvl": 16, "nvlink": 4, "rdma": 2}
    assert {r.fabric: r.sms for r in nearest_sms(rates, None)} == {"mnnvl": 16, "nvlink": 4, "rdma": 2}

    def chosen(*overrides):
        job_config = load_job_config([*DEBUG_JOB, *overrides], device_type=None, world_size=2)
        backend = overrides[1]
        return {rate.fabric: rate for rate in PLANNING_PROFILES[backend].published_rates(job_config)}

    # v1 unset uses the library's 20 SMs: on NVLink 5 the 16- and 24-SM figures are as near, and ties go to the
    # fewer SMs; elsewhere only 24-SM figures are published
    legacy = chosen("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "legacy")
    assert (legacy["mnnvl"].sms, legacy["nvlink"].sms, legacy["rdma"].sms) == (16, 24, 24)
    elastic = chosen("--parallelism.expert_parallel_comm_backend", "deepep", "--deepep.api", "elastic", "--deepep.num_sms", "48")
    assert (elastic["nvlink"].sms, elastic["rdma"].sms) == (64, 6)
    split = chosen("--parallelism.expert_parallel_comm_backend", "hybridep", "--hybridep.num_sms_dispatch", "32",
                   "--hybridep.num_sms_combine", "16")["mnnvl"]
    assert (split.dispatch_GBps, split.combine_GBps) == (484.22, 423.19)
    assert set(chosen("--parallelism.expert_parallel_comm_backend", "nccl")) == {"nvlink", "rdma"}


def test_the_all_to_all_takes_the_backends_share_of_each_link():
    """Without start-up latency an all-to-all's time is its bytes over the link's rate times the backend's
    fraction (dispatch and combine, one each way: their harmonic mean); a link without a figure stays nominal."""
    level = Level("node", 4, 100.0, 0.0, 100.0, 100.0, "nvlink")
    outer = Level("network", None, 10.0, 0.0, 10.0, 10.0, None)
    topology = Topology("t", 1.0, True, (level, outer))
    job_config = load_job_config([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep",
                                  "--parallelism.expert_parallel_degree", "4"], device_type=None, world_size=8)
    fractions = kernel_rate_fractions("hybridep", job_config, topology, topology)
    rate = next(r for r in hybridep.PUBLISHED_RATES if r.fabric == "nvlink" and r.sms == 16)
    assert fractions == {0: pytest.approx(2 / (1 / rate.dispatch_fraction + 1 / rate.combine_fraction))}
    work = cm.MoEWorkload(tokens=1024, hidden=256, top_k=2, experts=8, expert_parameters=1000, activation_bytes=2,
                          gather_bytes=2, reduce_bytes=4, pre_expert_flops=1e9, regather_in_backward=True)
    nominal = cm.layer_costs(work, topology, 8, 4, 2, True)
    priced = cm.layer_costs(work, topology, 8, 4, 2, True, token_rate_fractions=fractions)
    assert priced.a2a == pytest.approx(nominal.a2a / fractions[0])
    assert (priced.all_gather, priced.token_copies) == (nominal.all_gather, nominal.token_copies)
    across = cm.layer_costs(work, topology, 8, 8, 1, True, token_rate_fractions=fractions)
    assert across.a2a == cm.layer_costs(work, topology, 8, 8, 1, True).a2a  # the network's bytes set it, nominal


def _bench_row(backend, tokens, median_ms, ep=2, processes=2, forward_only=False):
    """A row as ``python -m torchtitan_ext.bench ep --json`` writes it (built by the bench's own row builder), of one
    timed iteration of ``median_ms`` whose collectives alone took half of it."""
    shape = bench_ep.Shape(tokens=tokens, hidden=256, experts=8, top_k=2, ep=ep)
    row = bench_ep.bench_row(backend, shape, processes, times=[median_ms / 1e3], bare=[median_ms / 2e3],
                             bytes_sent=tokens * 256 * 2, collectives=4, dtype="bfloat16", forward_only=forward_only,
                             local_bytes=tokens * 256 * 8, copy_gbps=100.0)
    return asdict(row)


TWO_LEVELS = Topology("t", 1.0, True, (Level("node", 8, 100.0, 0.0, 100.0, 100.0, "nvlink"),
                                       Level("network", None, 10.0, 0.0, 10.0, 10.0, "rdma")))


def _bench(tmp_path, *rows):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"command": f"{BENCH_COMMAND} ...", "machine": "test", "rows": list(rows)}))
    return bench


def test_a_measured_rate_replaces_the_published_one(tmp_path):
    """The measured fraction is the model's nominal time for the timed all-to-alls over the measured time; the
    row with the most tokens wins; upstream's rows and local-work rows (EP = 1) calibrate nothing; each DeepEP API
    is its own rate. The advisor then prices that backend's all-to-all on that link at it, and every other
    backend and link at its published figure."""
    bench = _bench(tmp_path, _bench_row("nccl", 512, 1.0), _bench_row("nccl", 4096, 20.0),
                   _bench_row("upstream", 4096, 5.0), _bench_row("hybridep", 4096, 3.0, ep=1),
                   _bench_row("deepep_lib", 4096, 8.0, forward_only=True), _bench_row("deepep_legacy_lib", 4096, 9.0))
    rates = calibration_rates([bench], TWO_LEVELS)
    assert sorted(rates) == [("deepep", ("elastic",), 0), ("deepep", ("legacy",), 0), ("nccl", (), 0)]
    work = cm.MoEWorkload(tokens=4096, hidden=256, top_k=2, experts=8, expert_parameters=0, activation_bytes=2,
                          gather_bytes=2, reduce_bytes=2, pre_expert_flops=0.0, regather_in_backward=False)
    nccl_nominal = 4 * cm.layer_costs(work, TWO_LEVELS, 2, 2, 1, False).a2a
    deepep_nominal = cm.layer_costs(work, TWO_LEVELS, 2, 2, 1, True).a2a
    assert rates["nccl", (), 0].fraction == pytest.approx(nccl_nominal / 20e-3)
    assert rates["deepep", ("elastic",), 0].fraction == pytest.approx(2 * deepep_nominal / 8e-3)
    assert rates["deepep", ("legacy",), 0].fraction == pytest.approx(4 * deepep_nominal / 9e-3)
    job_config = load_job_config([*DEBUG_JOB, "--parallelism.expert_parallel_degree", "4"], device_type=None, world_size=8)
    fractions = kernel_rate_fractions("nccl", job_config, TWO_LEVELS, TWO_LEVELS, rates)
    assert fractions == {0: rates["nccl", (), 0].fraction, 1: pytest.approx(0.92)}  # the network: the published figure
    published = kernel_rate_fractions("hybridep", job_config, TWO_LEVELS, TWO_LEVELS)
    assert kernel_rate_fractions("hybridep", job_config, TWO_LEVELS, TWO_LEVELS, rates) == published
    # and the advice prices with it: nccl's all-to-all within a node takes nominal / fraction, in place of
    # nominal / the published NVLink fraction (docs/published_ep_figures.md 5.8: 370 of 450 GB/s)
    calibrated, _ = advise(DEBUG_JOB, 8, TWO_LEVELS, measured_rates=rates)
    nominal, _ = advise(DEBUG_JOB, 8, TWO_LEVELS)
    pick = {layout.label: layout for layout in calibrated if (layout.ep, layout.refused) == (8, None)}
    plain = {layout.label: layout for layout in nominal if (layout.ep, layout.refused) == (8, None)}
    nccl_nvlink = kernel_rate_fractions("nccl", job_config, TWO_LEVELS, TWO_LEVELS)[0]
    assert nccl_nvlink == pytest.approx(370 / 450)
    assert pick["nccl"].costs.a2a == pytest.approx(plain["nccl"].costs.a2a * nccl_nvlink / rates["nccl", (), 0].fraction)
    assert pick["deepep legacy"].costs.a2a == pytest.approx(
        plain["deepep legacy"].costs.a2a * (1 / rates["deepep", ("legacy",), 0].fraction) / (
            1 / kernel_rate_fractions("deepep", _legacy(job_config), TWO_LEVELS, TWO_LEVELS)[0]))
    assert pick["hybridep"].costs == plain["hybridep"].costs


def _legacy(job_config):
    job_config = copy.deepcopy(job_config)
    job_config.parallelism.expert_parallel_comm_backend = "deepep"
    job_config.deepep.api = "legacy"
    return job_config


@pytest.mark.parametrize("change, message", [
    (lambda row: row.pop("median_ms"),
     f"rows[0].median_ms is missing: write the file with {BENCH_COMMAND} (this version)"),
    (lambda row: row.update(median_ms=0), "rows[0].median_ms = 0: a measured time is finite and > 0"),
    (lambda row: row.update(median_ms=True), f"rows[0].median_ms = True: not what {BENCH_COMMAND} writes"),
    (lambda row: row.update(dtype="fp8"), "rows[0].dtype = 'fp8': one of float32, bfloat16"),
    (lambda row: row.update(ep="2"), f"rows[0].ep = '2': not what {BENCH_COMMAND} writes"),
    (lambda row: row.update(ep=3), "rows[0].ep = 3 does not divide processes = 2: not a bench_ep row"),
    (lambda row: row.update(median_ms=1e-6),
     "rows[0].median_ms = 1e-06: faster than the 0.0105 ms its all-to-alls take at the nominal rate of 'node': it "
     "was timed on another link, or that level's bandwidth_GBps is below the link's"),
    (lambda row: row.update(comm_backend="deepep", job_args=job_args("deepep_legacy_lib"), ep=16, processes=16,
                            experts=16),
     "rows[0].ep = 16: deepep's kernels reach 8 ranks over NVLink, and a group of 16 spans their split: time it at "
     "EP <= 8"),
    (lambda row: row.update(ep=1), f"no row times an EP backend between ranks (ep > 1): run {BENCH_COMMAND} with "
                                   "--nproc and --ep-degree >= 2"),
])
def test_a_bench_file_that_is_not_bench_eps_is_one_line(tmp_path, change, message):
    row = _bench_row("nccl", 512, 1.0)
    change(row)
    bench = _bench(tmp_path, row)
    with pytest.raises(ConfigError) as error:
        calibration_rates([bench], TWO_LEVELS)
    assert str(error.value).replace(f"--calibrate-from {bench}: ", "") == message


def test_two_rows_for_one_rate_are_refused(tmp_path):
    """HybridEP's blocking and non-blocking rows are two rates; two blocking rows at one shape are one too many."""
    bench = _bench(tmp_path, _bench_row("hybridep", 512, 1.0), _bench_row("hybridep_non_blocking", 512, 2.0))
    both = calibration_rates([bench], TWO_LEVELS)
    assert sorted(both) == [("hybridep", ("blocking",), 0), ("hybridep", ("non-blocking",), 0)]
    bench = _bench(tmp_path, _bench_row("hybridep", 512, 1.0), _bench_row("hybridep", 512, 2.0))
    with pytest.raises(ConfigError, match=r"rows\[1\]: times hybridep blocking at T=512 on the link rows\[0\] times "
                                          r"it: keep one of them"):
        calibration_rates([bench], TWO_LEVELS)
