"""plan --calibrate-from reads nccl-tests' alltoall_perf log: the nccl backend's rate on the link its ranks
spanned, from a size sweep fitted to a per-call floor and a bandwidth, or from the largest message alone (the
model's time at the nominal rate over the measured time); a log that is not one alltoall_perf run per link,
placed as it ran, is refused in one line naming the line."""

import json
import re
from dataclasses import asdict, replace

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext import plan
from torchtitan_ext.bench.ep import bench_row, Shape
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.planning.layout_advisor import advise
from torchtitan_ext.planning.layout_links import candidate_config, rate_evidence
from torchtitan_ext.planning.measured_rates import calibration_rates, fit_sweep
from torchtitan_ext.planning.nccl_tests_log import all_to_all_runs
from torchtitan_ext.planning.topology import Level, load_topology, Topology
from torchtitan_ext.records.ep_bench import BENCH_COMMAND

NODE_GBPS, NETWORK_GBPS = 100.0, 10.0
TWO_LEVELS = Topology("t", 1.0, True, (Level("node", 8, NODE_GBPS, 0.0, NODE_GBPS, NODE_GBPS, "nvlink"),
                                       Level("network", None, NETWORK_GBPS, 0.0, NETWORK_GBPS, NETWORK_GBPS, "rdma")))
DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]
MiB = 2**20


def _log(hosts, rows, program="alltoall_perf", groups=None, time_column="time", per_iteration=False, noise=()):
    """An nccl-tests log as its printf formats lay it out; rows: (size in bytes, out-of-place time in us, #wrong).
    ``per_iteration``: -I 1's four columns after each half's #wrong; ``noise``: NCCL INFO lines after the ranks."""
    lines = [
        "# nccl-tests version 2.17.6 nccl-headers=22803 nccl-library=22803",
        f"# Collective test starting: {program}",
        f"# nThread 1 nGpus 1 minBytes {rows[0][0]} maxBytes {rows[-1][0]} step: 2(factor) warmup iters: 5 "
        "iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    for rank, host in enumerate(hosts):
        group = 0 if groups is None else groups[rank]
        lines.append(f"#  Rank {rank:2d} Group {group:2d} Pid {40000 + rank:6d} on {host:>10s} device {rank % 8:2d} "
                     f"[0000:{0x18 + rank % 8:02x}:00] NVIDIA H100 80GB HBM3")
    lines += list(noise)
    extra = "    i_min    i_max    i_p99    i_cv%" if per_iteration else ""
    lines += ["#", "# " + " " * 52 + "out-of-place                       in-place",
              f"#       size         count      type   redop    root  {time_column:>7s}   algbw   busbw #wrong{extra}  "
              f"{time_column:>7s}   algbw   busbw #wrong{extra}",
              "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  "
              "(GB/s)"]
    n = len(hosts)
    for size, time_us, wrong in rows:
        algbw = size / time_us / 1e3
        busbw = algbw * (n - 1) / n
        columns = f"  {time_us * 0.9:7.2f}  {time_us * 1.1:7.2f}  {time_us * 1.1:7.2f}  {1.5:7.2f}" if per_iteration else ""
        lines.append(f"{size:12d}  {size // 4 // n:12d}  {'float':>8s}  {'none':>6s}  {-1:6d}  {time_us:7.2f}  "
                     f"{algbw:6.2f}  {busbw:6.2f}  {wrong:>6}{columns}  {time_us:7.2f}  {algbw:6.2f}  {busbw:6.2f}  "
                     f"{'N/A':>6}{columns}")
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 12.5 ", "#",
              f"# Collective test concluded: {program}", ""]
    return "\n".join(lines)


def _time_us(size, ranks, peers_gbps, fraction):
    """The out-of-place time of a ``size``-byte all-to-all over ``ranks`` ranks whose off-rank bytes' slowest link
    runs at ``peers_gbps`` x ``fraction``: (peers on that link) x size / ranks over its rate."""
    return size * peers_gbps[0] / ranks / (peers_gbps[1] * 1e9 * fraction) * 1e6


def _write(tmp_path, text, name="alltoall.log"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_log_calibrates_nccl_on_the_link_its_ranks_spanned(tmp_path):
    """8 ranks on one host: the node's link, 7 of 8 shares leave the rank; 16 ranks on two hosts: the network's
    link carries the 8 shares of the other node, which set the time. The largest message is the one read."""
    inside = _log(["node-a"] * 8, [(MiB, 40.0, 0), (64 * MiB, _time_us(64 * MiB, 8, (7, NODE_GBPS), 0.6), 0)])
    across = _log(["node-a"] * 8 + ["node-b"] * 8,
                  [(MiB, 500.0, 0), (256 * MiB, _time_us(256 * MiB, 16, (8, NETWORK_GBPS), 0.8), "N/A")])
    rates = calibration_rates([_write(tmp_path, inside + across)], TWO_LEVELS)
    assert sorted(rates) == [("nccl", (), 0), ("nccl", (), 1)]
    assert rates["nccl", (), 0].fraction == pytest.approx(0.6, rel=1e-3)  # the printed time has two decimals
    assert rates["nccl", (), 1].fraction == pytest.approx(0.8, rel=1e-3)
    assert "alltoall_perf on 16 ranks (2 host(s)), 268435456 B" in rates["nccl", (), 1].source



def test_a_size_sweep_is_fitted_to_a_floor_per_call_and_a_rate_which_the_advice_charges(tmp_path):
    """Five sizes timed as 25 us per call plus the node's bytes at 0.6 of its rate: the fit gives both back, its
    residuals within the printed times' rounding, and nccl's all-to-all is priced with that floor in place of the
    level's latency (here 0): 25 us more per call than the same rate without it."""
    rows = [(size, 25.0 + _time_us(size, 8, (7, NODE_GBPS), 0.6), 0) for size in (MiB * 4**k for k in range(5))]
    rate = calibration_rates([_write(tmp_path, _log(["node-a"] * 8, rows))], TWO_LEVELS)["nccl", (), 0]
    assert rate.fraction == pytest.approx(0.6, rel=1e-3) and rate.floor_s == pytest.approx(25e-6, rel=1e-2)
    assert "5 sizes 1048576-268435456 B fitted to a 25 us floor per call" in rate.source
    assert re.search(r"residuals [+-]0% to [+-]0%", rate.source)
    with_floor = advise(DEBUG_JOB, 8, TWO_LEVELS, measured_rates={("nccl", (), 0): rate})[0]
    without = advise(DEBUG_JOB, 8, TWO_LEVELS, measured_rates={("nccl", (), 0): replace(rate, floor_s=None)})[0]
    a2a = {(layout.backend, layout.ep): layout.costs.a2a for layout in without if layout.refused is None}
    assert [layout.costs.a2a - a2a["nccl", layout.ep] for layout in with_floor
            if layout.backend == "nccl" and layout.ep > 1 and layout.refused is None] == pytest.approx([25e-6] * 3,
                                                                                                    rel=1e-2)


def test_the_advice_prices_nccl_at_the_measured_rates(tmp_path):
    """Nodes of 4: a 4-rank run calibrates the node's link, an 8-rank run on two hosts the network's. nccl's
    all-to-all at EP = 8 (across the network) takes its published RDMA figure (0.92) to the measured 0.8, at
    EP = 4 (one node) its published NVLink figure (370 of 450 GB/s) to the measured 0.6; other backends keep
    theirs."""
    topology = Topology("t4", 1.0, True, (Level("node", 4, NODE_GBPS, 0.0, NODE_GBPS, NODE_GBPS, "nvlink"),
                                          TWO_LEVELS.levels[1]))
    inside = _log(["node-a"] * 4, [(64 * MiB, _time_us(64 * MiB, 4, (3, NODE_GBPS), 0.6), 0)])
    across = _log(["node-a"] * 4 + ["node-b"] * 4, [(256 * MiB, _time_us(256 * MiB, 8, (4, NETWORK_GBPS), 0.8), 0)])
    rates = calibration_rates([_write(tmp_path, inside + across)], topology)
    calibrated, _ = advise(DEBUG_JOB, 16, topology, measured_rates=rates)
    plain, _ = advise(DEBUG_JOB, 16, topology)
    pick = {(layout.label, layout.ep): layout for layout in calibrated if layout.refused is None}
    published = {(layout.label, layout.ep): layout for layout in plain if layout.refused is None}
    assert pick["nccl", 8].costs.a2a == pytest.approx(published["nccl", 8].costs.a2a * 0.92 / 0.8, rel=1e-3)
    assert pick["nccl", 4].costs.a2a == pytest.approx(published["nccl", 4].costs.a2a * (370 / 450) / 0.6, rel=1e-3)
    assert pick["hybridep", 8].costs == published["hybridep", 8].costs


def test_a_log_is_placed_as_the_job_places_its_ranks(tmp_path):
    """Racks of 72 of which the job uses 64 (plan --ranks-per-group 64): a 128-rank run over two racks, placed
    as the job places its ranks, calibrates the link between racks; bench_ep's rows stay placed on whole machines."""
    racks = Topology("racks", 1.0, True, (Level("rack", 72, 900.0, 0.0, 900.0, 900.0, "mnnvl"),
                                          Level("between racks", None, 50.0, 0.0, 50.0, 50.0, "rdma")))
    log = _write(tmp_path, _log([f"tray-{rank // 4}" for rank in range(128)],
                                [(256 * MiB, _time_us(256 * MiB, 128, (64, 50.0), 0.9), 0)]))
    with pytest.raises(ConfigError, match="level 'rack' has workers = 72, which does not divide the world size 128"):
        calibration_rates([log], racks)
    rates = calibration_rates([log], racks, racks.placing(64))
    assert list(rates) == [("nccl", (), 1)]
    assert rates["nccl", (), 1].fraction == pytest.approx(0.9, rel=1e-3)
    assert not rates["nccl", (), 1].includes_local_work  # NCCL's all-to-all alone: --measure-compute may add it


def test_measured_compute_is_refused_beside_bench_rows_only(tmp_path, capsys):
    """bench_ep's rows hold each backend's permutes, which --measure-compute would count again; a log does not."""
    from torchtitan_ext import plan

    row = bench_row("hybridep", Shape(tokens=4096, hidden=256, experts=8, top_k=2, ep=2), 2, [5e-3], [2e-3], 2**20, 2,
                    "bfloat16", False, local_bytes=2**22, copy_gbps=100.0)
    bench = _write(tmp_path, json.dumps({"rows": [asdict(row)]}), "bench.json")
    with pytest.raises(SystemExit) as exit_info:
        plan.main([*DEBUG_JOB, "--world-size", "2", "--topology", "hgx_h100_ib", "--calibrate-from", str(bench),
                   "--measure-compute"])
    assert (exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]) == (
        2, "error: --calibrate-from's bench_ep rates hold each backend's local work, which --measure-compute adds "
           "again: drop one of them")


def test_bench_ep_rows_at_three_shapes_are_fitted_to_a_floor_per_call_and_a_rate(tmp_path):
    """nccl at EP=2 on the node's link (100 GB/s, no latency), timed at three token counts as 30 us per all-to-all
    plus its bytes at half the rate, four all-to-alls an iteration: by hand, half of each token's 2 rows of 256
    bf16 leave the rank, 512 bytes a token per all-to-all. The fit gives back 30 us and 0.5."""
    rows = []
    for tokens in (1024, 4096, 16384):
        iteration = 4 * (30e-6 + 512 * tokens / (NODE_GBPS * 1e9) / 0.5)
        rows.append(asdict(bench_row("nccl", Shape(tokens=tokens, hidden=256, experts=8, top_k=2, ep=2), 2,
                                     [iteration], [iteration / 2], 2**20, 4, "bfloat16", False,
                                     local_bytes=2**22, copy_gbps=100.0)))
    rate = calibration_rates([_write(tmp_path, json.dumps({"rows": rows}), "bench.json")], TWO_LEVELS)["nccl", (), 0]
    assert rate.fraction == pytest.approx(0.5, rel=1e-6) and rate.floor_s == pytest.approx(30e-6, rel=1e-6)
    assert rate.source.startswith("bench.json rows[0,1,2]: 3 shapes fitted to a 30 us floor per all-to-all and 0.50")


def test_a_log_and_a_bench_file_combine_and_may_not_measure_one_rate_twice(tmp_path):
    log = _write(tmp_path, _log(["node-a"] * 8, [(64 * MiB, _time_us(64 * MiB, 8, (7, NODE_GBPS), 0.5), 0)]))
    row = bench_row("hybridep", Shape(tokens=4096, hidden=256, experts=8, top_k=2, ep=2), 2, [5e-3], [2e-3], 2**20, 2,
                    "bfloat16", False, local_bytes=2**22, copy_gbps=100.0)
    bench = _write(tmp_path, json.dumps({"rows": [asdict(row)]}), "bench.json")
    rates = calibration_rates([log, bench], TWO_LEVELS)
    assert sorted(rates) == [("hybridep", ("blocking",), 0), ("nccl", (), 0)]
    again = _write(tmp_path, _log(["node-b"] * 8, [(MiB, 1000.0, 0)]), "again.log")
    with pytest.raises(ConfigError) as error:
        calibration_rates([log, again], TWO_LEVELS)
    assert str(error.value) == (f"--calibrate-from {again}: measures nccl on 'node' as alltoall.log line 18: "
                                "alltoall_perf on 8 ranks (1 host(s)), 67108864 B, "
                                f"{_time_us(64 * MiB, 8, (7, NODE_GBPS), 0.5):.2f} us measured, 587 us at the "
                                "nominal rate does: keep one of them")


FAST = _time_us(MiB, 8, (7, NODE_GBPS), 1.0) / 2


ONE_ROW = [(MiB, 100.0, 0)]


@pytest.mark.parametrize("text, message", [
    (_log(["a"] * 8, ONE_ROW, program="all_reduce_perf"),
     "line 2: a all_reduce_perf run: the advisor calibrates the all-to-all, run nccl-tests' alltoall_perf"),
    (_log(["a"] * 8, ONE_ROW, program="alltoallv_perf"),
     "line 2: a alltoallv_perf run: the advisor calibrates the all-to-all, run nccl-tests' alltoall_perf"),
    (_log(["a"] * 8, [(MiB, 100.0, 3)]),
     "line 18: #wrong = 3: the all-to-all delivered wrong data; fix the cluster before timing it"),
    (_log(["a"] * 8, ONE_ROW).replace("  100.00  ", "  nan  ", 1), "line 18: time = nan us: a measured time is > 0"),
    (_log(["a"] * 8, ONE_ROW).replace("  100.00  ", "  fast  ", 1), "line 18: time = 'fast' is not a number"),
    (_log(["a"] * 8, ONE_ROW).replace("  float", "", 1),
     "line 18: not an nccl-tests result row (size count type redop root time algbw busbw #wrong and the in-place "
     "half)"),
    (_log(["a"] * 8, ONE_ROW, time_column="cputime"),
     "line 16: the run reports cputime (-C 1): time the GPUs, without -C"),
    ("\n".join(_log(["a"] * 8, ONE_ROW).splitlines()[:19]),
     "the alltoall_perf run at line 2 did not conclude (no '# Collective test concluded' line): it failed, or the "
     "log is cut short"),
    ("\n".join(_log(["a"] * 8, ONE_ROW).splitlines()[:14]) + "\n" + _log(["a"] * 8, ONE_ROW),
     "the alltoall_perf run at line 2 did not conclude (no '# Collective test concluded' line before the next run): "
     "it failed"),
    (_log(["a"] * 8, [(0, 20.0, 0)]),
     "line 18: its largest message is 0 bytes (each peer's share rounds down to 16 bytes): run alltoall_perf with -e "
     "of at least a few MB"),
    (_log(["a"] * 8, ONE_ROW).replace("#  Rank  3", "#  Rank 13"),
     "the alltoall_perf run at line 2 lists ranks [0, 1, 2, 4, 5, 6, 7, 13]: expected every rank from 0 (a log cut "
     "short?)"),
    (_log(["a"] * 8, ONE_ROW, groups=[0] * 4 + [1] * 4),
     "the alltoall_perf run at line 2 splits its ranks into groups [0, 1]: run one all-to-all over all of them "
     "(NCCL_TESTS_SPLIT and NCCL_TESTS_SPLIT_MASK unset)"),
    (_log(["a"], ONE_ROW), "line 11: an all-to-all on 1 rank moves nothing between ranks: run it on 2 or more"),
    (_log(["a", "b"] * 4, ONE_ROW),
     "line 18: ranks 0-7 ran on hosts a, b, but fill one group of 'node', one node's NVLink: run it with 8 ranks per "
     "node, placed in blocks (mpirun --map-by slot, srun -m block)"),
    (_log(["a"] * 8, [(MiB, FAST, 0)]),
     f"line 18: time = {round(FAST, 2):g} us: faster than the 9.18 us a 1048576-byte all-to-all takes at the nominal "
     "rate of 'node': it ran on another link, or that level's bandwidth_GBps is below the link's"),
    (_log(["a"] * 12, ONE_ROW),
     "line 22: 12 ranks: topology 't': level 'node' has workers = 8, which does not divide the world size 12: use a "
     "world size that is a multiple of 8, or say how many ranks the job places in each with --ranks-per-group"),
    (_log(["a"] * 8, ONE_ROW) + _log(["b"] * 8, [(MiB, 200.0, 0)]),
     "line 40: a second alltoall_perf run on 'node' (alltoall.log line 18: alltoall_perf on 8 ranks (1 host(s)), "
     "1048576 B, 100 us measured, 9.18 us at the nominal rate): keep one of them"),
    ("# nThread 1 nGpus 1 minBytes 8 maxBytes 1048576\n# size count type\n1048576 262144 float none -1 100.0 10.5 9.2 0\n",
     "no '# Collective test starting: alltoall_perf' line: write the log with nccl-tests' alltoall_perf (v2.16.7 or "
     "later prints that line)"),
    ("size,time\n1048576,100\n", f"neither {BENCH_COMMAND} output, an nccl-tests alltoall_perf log, nor DeepEP's or HybridEP's test log"),
])
def test_a_log_that_cannot_calibrate_is_one_line(tmp_path, text, message):
    log = _write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        calibration_rates([log], TWO_LEVELS)
    assert str(error.value) == f"--calibrate-from {log}: {message}"


def test_what_real_logs_hold_besides_the_run_is_read_past(tmp_path):
    """A build's name suffix, -I 1's per-iteration columns, NCCL INFO lines, a launcher's banner before the run and
    srun -l's rank prefixes on every line: the same rate as the plain log."""
    rows = [(MiB, 40.0, 0), (64 * MiB, _time_us(64 * MiB, 8, (7, NODE_GBPS), 0.6), 0)]
    plain = calibration_rates([_write(tmp_path, _log(["a"] * 8, rows), "plain.log")], TWO_LEVELS)
    noise = ["a:40000:40000 [0] NCCL INFO Bootstrap: Using eth0:10.0.0.1<0>",
             "a:40000:40000 [0] NCCL INFO NCCL version 2.28.3+cuda12.9"]
    variants = [
        _log(["a"] * 8, rows, program="alltoall_perf_mpi"),
        _log(["a"] * 8, rows, per_iteration=True),
        "Option -R (register) is not supported before NCCL 2.19. Ignoring\n" + _log(["a"] * 8, rows, noise=noise),
        "\n".join(f"0: {line}" for line in _log(["a"] * 8, rows).splitlines()),
    ]
    for index, text in enumerate(variants):
        rates = calibration_rates([_write(tmp_path, text, f"variant{index}.log")], TWO_LEVELS)
        assert {key: rate.fraction for key, rate in rates.items()} == \
            {key: rate.fraction for key, rate in plain.items()}, index


def test_the_evidence_names_a_logs_measurement_on_the_links_the_all_to_all_crosses(tmp_path):
    """The advice's evidence line, for nccl on HGX H100 calibrated by a log of 16 ranks on 2 hosts: NVLink at its
    published figure, InfiniBand by the log's row (a source with parentheses of its own); where the all-to-all
    crosses NVLink alone, only NVLink."""
    log = _write(tmp_path, _log([f"node-{i // 8}" for i in range(16)],
                                [(256 * MiB, _time_us(256 * MiB, 16, (8, 50.0), 0.7), 0)]))
    topology = load_topology("hgx_h100_ib")
    measured = calibration_rates([log], topology)
    (source,) = {rate.source for rate in measured.values()}
    assert "(2 host(s))" in source
    candidate = candidate_config(load_job_config(DEBUG_JOB, device_type=None, world_size=16), "nccl", 16)
    assert rate_evidence("nccl", candidate, topology, topology, measured, crossed=2) == (
        "NVLink (one node) docs/published_ep_figures.md 5.8", f"InfiniBand measured ({source})")
    assert rate_evidence("nccl", candidate, topology, topology, measured, crossed=1) == (
        "NVLink (one node) docs/published_ep_figures.md 5.8",)


def test_the_cli_prices_nccl_at_the_logs_rate(tmp_path, capsys):
    """Through plan: the advice's rate line names the log's measurement on the InfiniBand link."""
    log = _write(tmp_path, _log([f"node-{i // 8}" for i in range(16)],
                                [(256 * MiB, _time_us(256 * MiB, 16, (8, 50.0), 0.7), 0)]))
    plan.main([*DEBUG_JOB, "--world-size", "16", "--topology", "hgx_h100_ib", "--calibrate-from", str(log)])
    out = capsys.readouterr().out
    assert "InfiniBand: 0.70 of nominal, measured (alltoall.log line 26: alltoall_perf on 16 ranks (2 host(s))" \
        in " ".join(out.split()), out


PUBLISHED_LOG = REPO_ROOT / "tests/planning/data/alltoall_perf_oci_gb300.log"
"""A real alltoall_perf log, verbatim from a public page (its header names the page): 4 ranks of one GB300 tray."""


def test_a_published_log_is_read_to_its_largest_row_and_its_sweep():
    """Read by hand from the file: ranks 0-3 on host GPU-3882; the largest message, 17179869184 B per rank, on line
    33, 20527 us out of place (18929 in place, not read); 16 sizes from 524288 B (14.50 us, line 18)."""
    [run] = all_to_all_runs(PUBLISHED_LOG, PUBLISHED_LOG.read_text())
    assert (run.hosts, run.size_bytes, run.time_us, run.line) == (("GPU-3882",) * 4, 17179869184, 20527.0, 33)
    assert len(run.rows) == 16 and run.rows[0] == (524288, 14.5, 18) and run.rows[-1] == (17179869184, 20527.0, 33)
    # its sweep fits a floor per call of the order of its smallest message's time, and a line within 25% of every
    # size (the guide says so)
    floor_s, seconds_per_byte, residuals = fit_sweep(run.rows)
    assert 0 < floor_s < 2 * 14.5e-6 and max(abs(residual) for residual in residuals) < 0.25 and seconds_per_byte > 0


@pytest.mark.parametrize("size, time_us, busbw", [
    (4194304, 23.03, 136.59), (1073741824, 1454.3, 553.75), (17179869184, 20527.0, 627.69)])
def test_a_published_row_calibrates_to_the_bus_bandwidth_it_prints(tmp_path, size, time_us, busbw):
    """The published log cut to one row (figures copied by hand from it), so that no sweep is fitted: the
    parser reads that row's size and out-of-place time, and over one zero-latency link the nccl rate is the
    busbw the row prints over the link's nominal rate (nccl-tests' busbw: size / time x (ranks - 1) / ranks, the
    bytes that leave a rank, as the model counts them)."""
    lines = PUBLISHED_LOG.read_text().splitlines()
    first = next(number for number, line in enumerate(lines) if line.split()[:1] == ["524288"])
    row = next(number for number, line in enumerate(lines, start=1) if line.split()[:1] == [str(size)])
    cut = _write(tmp_path, "\n".join(lines[:first] + [lines[row - 1]] + lines[-4:]) + "\n")
    assert lines[-1] == "# Collective test concluded: alltoall_perf"
    [run] = all_to_all_runs(cut, cut.read_text())
    assert (run.size_bytes, run.time_us, run.line) == (size, time_us, first + 1)
    link = Topology("link", 1.0, True, (Level("NVLink", None, 900.0, 0.0, 900.0, 900.0, "mnnvl"),))
    rate = calibration_rates([cut], link)["nccl", (), 0]
    # the printed time has 4 or 5 significant digits (busbw was computed from the unrounded one)
    assert rate.fraction * 900.0 == pytest.approx(busbw, rel=3e-4)
