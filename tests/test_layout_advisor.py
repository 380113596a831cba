"""The layout advisor: topology files, its ranking, its CLI and its bad-input errors."""

import pytest

from torchtitan_ext import plan
from torchtitan_ext.config import ConfigError
from torchtitan_ext.layout_advisor import advise
from torchtitan_ext.topology import load_topology, parse_topology, SHIPPED

DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]
LEVELS = [{"name": "node", "workers": 8, "bandwidth_GBps": 400.0, "latency_us": 3.0},
          {"name": "network", "bandwidth_GBps": 50.0, "latency_us": 10.0}]


@pytest.mark.parametrize("name", sorted(p.stem for p in SHIPPED.glob("*.toml")))
def test_shipped_topologies_load(name):
    topology = load_topology(name)
    assert topology.levels and topology.compute_tflops > 0
    assert topology.group_sizes(64)[-1] == 64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"compute_tflops": 0}, "test.compute_tflops = 0.0: use a throughput > 0 (TFLOP/s per worker)"),
        ({"levels": []}, "test.levels is missing or empty: add one [[levels]] table per level, innermost first"),
        ({"levels": [{**LEVELS[0], "bandwidth_GBps": 0}, LEVELS[1]]},
         "test.levels[0].bandwidth_GBps = 0.0: use a bandwidth > 0 (GB/s per worker)"),
        ({"levels": [LEVELS[0], {**LEVELS[1], "bandwidth_GBps": -5}]},
         "test.levels[1].bandwidth_GBps = -5.0: use a bandwidth > 0 (GB/s per worker)"),
        ({"levels": [{**LEVELS[0], "latency_us": -1}, LEVELS[1]]},
         "test.levels[0].latency_us = -1.0: use a latency >= 0 (microseconds)"),
        ({"levels": [{**LEVELS[0], "workers": 0}, LEVELS[1]]}, "test.levels[0].workers = 0: use a count >= 1"),
        ({"levels": [{k: v for k, v in LEVELS[0].items() if k != "workers"}, LEVELS[1]]},
         "test.levels[0].workers is missing: only the outermost level may omit it"),
        ({"overlap": "yes"}, "test.overlap = 'yes': expected a bool"),
    ],
)
def test_bad_topology_fields_are_named(change, message):
    data = {"name": "test", "compute_tflops": 100.0, "overlap": True, "levels": LEVELS, **change}
    with pytest.raises(ConfigError) as error:
        parse_topology(data, "test")
    assert str(error.value) == message


def test_a_level_that_does_not_divide_the_world_size():
    topology = load_topology("hgx_h100_ib")
    with pytest.raises(ConfigError, match=r"level 'NVLink \(one node\)' has workers = 8, which does not divide the world size 12"):
        topology.group_sizes(12)
    assert topology.group_sizes(4) == [4, 4]  # a job inside one node
    assert topology.group_sizes(32) == [8, 32]


def _run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "no_such_cluster", "--world-size", "4", *DEBUG_JOB],
         "error: --topology no_such_cluster: no such file, and not a shipped topology (cross_dc, gb200_nvl72, hgx_h100_ib)\n"),
        (["--topology", "hgx_h100_ib", "--world-size", "12", *DEBUG_JOB],
         "error: topology 'HGX H100, InfiniBand NDR': level 'NVLink (one node)' has workers = 8, which does not divide "
         "the world size 12: use a world size that is a multiple of 8\n"),
        (["--paper", "--topology", "cross_dc", "--world-size", "8"],
         "error: --paper needs --paper-data-mb, --paper-expert-mb, --paper-pre-expert-ms\n"),
        (["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "0", "--paper-expert-mb", "1",
          "--paper-pre-expert-ms", "1"], "error: --paper-data-mb 0.0: use a value > 0\n"),
        (["--calibrate", "--nproc", "1"], "error: --nproc 1: an all-to-all needs at least 2 processes\n"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, err = _run_cli(capsys, *argv)
    assert code == 2
    assert err == message


def test_paper_mode_prints_every_domain_size(capsys):
    plan.main(["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "3",
               "--paper-expert-mb", "0.094", "--paper-pre-expert-ms", "0.099"])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:6]]
    assert [(int(r[0]), r[2], r[3]) for r in rows] == [(1, "56", "0"), (2, "24", "8"), (4, "8", "24"), (8, "0", "56")]
    # Table IV's AG-only row: all-gather only (S = G, p = 0) by both the search and the closed form
    assert out[-1].startswith("  best feasible: S=8 (p=0.000") and out[-1].endswith("p*=0.000")


def test_advice_ranks_runnable_layouts_and_lists_refused_ones():
    layouts = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"))
    runnable = [layout for layout in layouts if layout.refused is None]
    refused = [layout for layout in layouts if layout.refused is not None]
    assert {(layout.backend, layout.ep) for layout in runnable} == {
        (backend, ep) for backend in ("nccl", "deepep", "hybridep") for ep in (1, 2, 4)
    } - {("deepep", 1), ("hybridep", 1)}
    assert {(layout.backend, layout.ep) for layout in refused} == {("deepep", 1), ("hybridep", 1)}
    assert all("needs expert parallelism" in layout.refused for layout in refused)
    assert [layout.exposed_s for layout in runnable] == sorted(layout.exposed_s for layout in runnable)
    assert all(layout.ep * layout.efsdp == 4 for layout in layouts)
    # at equal layout, de-duplicating backends move fewer token copies than per-pair all-to-all
    by_key = {(layout.backend, layout.ep): layout for layout in runnable}
    for ep in (2, 4):
        assert by_key["hybridep", ep].costs.token_copies < by_key["nccl", ep].costs.token_copies
        assert by_key["deepep", ep].costs.token_copies == by_key["hybridep", ep].costs.token_copies


@pytest.fixture(scope="module")
def advice_671b():
    job = ["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml"]
    return {name: advise(job, 256, load_topology(name)) for name in ("gb200_nvl72", "hgx_h100_ib")}


def test_671b_advice_quoted_in_docs(advice_671b):
    """docs/planning.md's tables: the winners, the tie, and the numbers its text explains them with."""
    gb200 = {(layout.backend, layout.ep): layout for layout in advice_671b["gb200_nvl72"] if layout.refused is None}
    first = advice_671b["gb200_nvl72"][0]
    assert (first.backend, first.ep, first.efsdp) == ("hybridep", 64, 4)  # the job's own backend wins the tie
    assert first.exposed_s == gb200["deepep", 64].exposed_s < gb200["nccl", 64].exposed_s
    assert (first.moe_layers, first.recomputed_layers, first.dispatches) == (58, 58, 1)
    ep32 = gb200["deepep", 32]
    assert round(ep32.costs.token_copies, 2) == 7.04 and round(first.costs.token_copies, 2) == 7.56
    assert round(ep32.costs.exposed(True) - 4 * ep32.costs.a2a, 5) == pytest.approx(8.62e-3, abs=1e-5)
    assert round(ep32.exposed_s, 3) == 1.141 and round(first.exposed_s, 3) == 0.687
    assert gb200["nccl", 64].costs.token_copies == pytest.approx(8 * 63 / 64)
    assert round(gb200["deepep", 128].costs.token_copies, 2) == 4.88
    assert gb200["deepep", 128].a2a_level == "RDMA between racks"
    assert ("hybridep", 32) not in gb200  # the config's ranks_per_nvlink_domain = 64 refuses it
    hgx = {(layout.backend, layout.ep): layout for layout in advice_671b["hgx_h100_ib"] if layout.refused is None}
    first = advice_671b["hgx_h100_ib"][0]
    assert (first.backend, first.ep, first.efsdp) == ("deepep", 16, 16)
    assert round(first.costs.token_copies, 2) == 3.85 and round(hgx["nccl", 16].costs.token_copies, 2) == 7.50


@pytest.mark.parametrize(
    "overrides, recomputed, dispatches, regather",
    [
        ([], 0, 1, True),
        (["--activation_checkpoint.mode", "full"], 5, 1, True),
        (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"], 0, 1, True),
        (["--training.local_batch_size", "2", "--training.global_batch_size", "16"], 0, 2, True),
        (["--parallelism.fsdp_reshard_after_forward", "never"], 0, 1, False),
    ],
)
def test_job_shape_follows_checkpointing_accumulation_and_resharding(overrides, recomputed, dispatches, regather):
    from torchtitan_ext.layout_advisor import job_shape
    from torchtitan_ext.train import load_job_config

    job_config = load_job_config([*DEBUG_JOB, *overrides], device_type=None, world_size=4)
    shape = job_shape(job_config, 4)
    assert (shape.moe_layers, shape.recomputed_layers, shape.dispatches) == (5, recomputed, dispatches)
    assert shape.work.regather_in_backward is regather
    assert shape.expert_world == 4
