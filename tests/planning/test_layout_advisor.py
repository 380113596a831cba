"""The layout advisor: topology files, its ranking, its CLI and its bad-input errors."""

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torchtitan.models.moe import MoE

from tests.planning.advice_text import ERROR, headline, paragraph
from torchtitan_ext import plan, runtime
from torchtitan_ext.config import ConfigError, load_job_config, parse, shared_meta_model
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.ep.planning_profile import nvlink_domain_at_ep
from torchtitan_ext.measuring.compute import check_measurable
from torchtitan_ext.planning.advice_decision import decide, measure_arguments
from torchtitan_ext.planning.advice_report import format_advice, layouts_record
from torchtitan_ext.planning.advisor_fit import load_fit, SHIPPED as SHIPPED_FIT
from torchtitan_ext.planning.cost_model import MeasuredRouting
from torchtitan_ext.planning.layout_advisor import advise, advised_config, overrides_problem
from torchtitan_ext.planning.measured_compute import MeasuredCompute
from torchtitan_ext.planning.advisor_error import AS_SHIPPED, load_error, measured_error, SHIPPED as SHIPPED_ERROR
from torchtitan_ext.planning.published_comparisons import (
    format_validation, load_comparisons, SHIPPED as SHIPPED_COMPARISONS, validate,
)
from torchtitan_ext.planning.topology import load_topology, parse_topology, SHIPPED
from torchtitan_ext.runtime.memory import memory_limit_bytes
from torchtitan_ext.training import prepare

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
        ({"levels": [{**LEVELS[0], "all_gather_bandwidth_GBps": 0}, LEVELS[1]]},
         "test.levels[0].all_gather_bandwidth_GBps = 0.0: use a bandwidth > 0 (GB/s per worker)"),
        ({"levels": [LEVELS[0], {**LEVELS[1], "reduce_scatter_bandwidth_GBps": -1}]},
         "test.levels[1].reduce_scatter_bandwidth_GBps = -1.0: use a bandwidth > 0 (GB/s per worker)"),
        ({"levels": [{**LEVELS[0], "fabric": "nvl"}, LEVELS[1]]},
         "test.levels[0].fabric = 'nvl': use one of 'nvlink': NVLink through one node's NVSwitch (HGX/DGX, up to 8 "
         "GPUs); 'mnnvl': multi-node NVLink (GB200 NVL72: one NVLink domain across the rack's trays); 'rdma': an RDMA "
         "NIC per GPU (InfiniBand or RoCE) between nodes; or omit it (nominal rates)"),
        ({"memory_GB": 0}, "test.memory_GB = 0.0: use the device memory per worker in GB, > 0, or omit it"),
        ({"mxfp8_compute_tflops": -1}, "test.mxfp8_compute_tflops = -1.0: use a throughput > 0 (TFLOP/s per worker), "
                                       "or omit it (MXFP8 GEMMs at compute_tflops)"),
        ({"memory_GB": "80"}, "test.memory_GB = '80': expected a float"),
        ({"sms": 0}, "test.sms = 0: use the worker's count of streaming multiprocessors (>= 1), or omit it"),
        ({"ranks_per_group": 9}, "test.ranks_per_group = 9: its innermost level 'node' holds 8 workers: use a count "
                                 "from 1 to 8, or omit it"),
        ({"levels": [LEVELS[1]], "ranks_per_group": 4},
         "test.ranks_per_group = 4: its only level 'network' has no groups to place ranks in: omit it"),
    ],
)
def test_bad_topology_fields_are_named(change, message):
    data = {"name": "test", "compute_tflops": 100.0, "overlap": True, "levels": LEVELS, **change}
    with pytest.raises(ConfigError) as error:
        parse_topology(data, "test")
    assert str(error.value) == message


def test_fsdp_collectives_default_to_the_all_to_all_bandwidth():
    levels = [{**LEVELS[0], "all_gather_bandwidth_GBps": 200.0, "reduce_scatter_bandwidth_GBps": 100.0}, LEVELS[1]]
    topology = parse_topology({"compute_tflops": 1.0, "overlap": True, "levels": levels}, "test")
    node, network = topology.levels
    assert [node.bandwidth(c) for c in ("all_to_all", "all_gather", "reduce_scatter")] == [400e9, 200e9, 100e9]
    assert [network.bandwidth(c) for c in ("all_to_all", "all_gather", "reduce_scatter")] == [50e9] * 3


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
         "the world size 12: use a world size that is a multiple of 8, or say how many ranks the job places in each "
         "with --ranks-per-group\n"),
        (["--paper", "--topology", "cross_dc", "--world-size", "8"],
         "error: --paper needs --paper-data-mb, --paper-expert-mb, --paper-pre-expert-ms\n"),
        (["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "0", "--paper-expert-mb", "1",
          "--paper-pre-expert-ms", "1"], "error: --paper-data-mb 0.0: use a finite value > 0\n"),
        (["--calibrate", "--nproc", "1"], "error: --nproc 1: an all-to-all needs at least 2 processes\n"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, err = _run_cli(capsys, *argv)
    assert code == 2
    assert err == message


@pytest.mark.parametrize("bandwidth_GBps, optima", [(128.0, [2, 4, 8, 8]), (16.0, [1, 2, 8, 8])],
                         ids=["128MB_per_ms", "128Gbit_per_s"])
def test_paper_mode_gives_table_iv_optima(capsys, tmp_path, bandwidth_GBps, optima):
    """Table IV (G = 8) through the CLI, on a one-level topology at each reading of its 128 unit: as
    128 MB/ms the optima are the table's own (p = 0.75, 0.5, 0, 0: S = 2, 4, 8, 8 by section V-B's mapping);
    as 128 Gbit/s the Mix rows move to S = 1 and 2."""
    topology = tmp_path / "one_link.toml"
    topology.write_text(f'compute_tflops = 1.0\noverlap = true\n[[levels]]\nname = "link"\n'
                        f"bandwidth_GBps = {bandwidth_GBps}\nlatency_us = 0.0\n")
    found = []
    for data_mb, expert_mb, pre_expert_ms in ((8, 4.7, 0.049), (8, 2.35, 0.049), (3, 0.094, 0.099), (3, 0.047, 0.099)):
        plan.main(["--paper", "--topology", str(topology), "--world-size", "8", "--paper-data-mb", str(data_mb),
                   "--paper-expert-mb", str(expert_mb), "--paper-pre-expert-ms", str(pre_expert_ms)])
        found.append(int(re.search(r"best feasible: S=(\d+)", capsys.readouterr().out)[1]))
    assert found == optima


def test_paper_mode_takes_the_link_its_world_spans(capsys):
    """8 GPUs of one data centre talk over its PCIe (the paper's 128 Gbit/s), 16 over the WAN between two."""
    for world, link in (("8", "B=16 GB/s ('PCIe (one data centre)'"), ("16", "B=1.25 GB/s ('WAN between data centres'")):
        plan.main(["--paper", "--topology", "cross_dc", "--world-size", world, "--paper-data-mb", "8",
                   "--paper-expert-mb", "2.35", "--paper-pre-expert-ms", "0.049"])
        assert link in capsys.readouterr().out.splitlines()[0]


def test_paper_mode_prints_every_domain_size(capsys):
    plan.main(["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "3",
               "--paper-expert-mb", "0.094", "--paper-pre-expert-ms", "0.099"])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:6]]
    assert [(int(r[0]), r[2], r[3]) for r in rows] == [(1, "56", "0"), (2, "24", "8"), (4, "8", "24"), (8, "0", "56")]
    # Table IV's AG-only row: all-gather only (S = G, p = 0) by both the search and the closed form
    assert out[-1].startswith("  best feasible: S=8 (p=0.000") and out[-1].endswith("p*=0.000")


def test_advice_ranks_runnable_layouts_and_lists_refused_ones():
    layouts, _ = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"))
    runnable = [layout for layout in layouts if layout.refused is None]
    # DeepEP also at its other API (the job's "auto" resolves to V2 here: v1 is priced beside it); a backend that
    # needs expert parallelism has no layout at EP = 1
    assert {(layout.label, layout.ep) for layout in runnable} == {("nccl", 1)} | {
        (backend, ep) for backend in ("nccl", "deepep", "deepep legacy", "hybridep", "ncclep") for ep in (2, 4)}
    assert len(runnable) == len(layouts)
    # priced layouts by step time, then the bounds at a nominal rate (NCCL EP's)
    priced = [layout for layout in runnable if not layout.nominal_links]
    assert runnable[:len(priced)] == priced and {layout.label for layout in runnable[len(priced):]} == {"ncclep"}
    assert [layout.step_s for layout in priced] == sorted(layout.step_s for layout in priced)
    legacy = next(layout for layout in runnable if layout.label == "deepep legacy")
    assert legacy.settings == (("deepep", "api", "legacy"),) and legacy.overrides()[-2:] == ["--deepep.api", "legacy"]
    # its overrides select it, and the config the advisor priced is the one they give
    assert overrides_problem(DEBUG_JOB, 4, legacy) is None
    assert advised_config(DEBUG_JOB, 4, legacy).deepep.api == "legacy"
    assert load_job_config([*DEBUG_JOB, *legacy.overrides()], device_type=None, world_size=4).deepep.api == "legacy"
    assert all(layout.ep * layout.efsdp == 4 for layout in layouts)
    # at equal layout, de-duplicating backends move fewer token copies than per-pair all-to-all
    by_key = {(layout.label, layout.ep): layout for layout in runnable}
    for ep in (2, 4):
        assert by_key["hybridep", ep].costs.token_copies < by_key["nccl", ep].costs.token_copies
        assert by_key["deepep", ep].costs.token_copies == by_key["hybridep", ep].costs.token_copies
    # expert TP, which only nccl supports: the others are refused, and DeepEP's v1, refused for the reason V2 is,
    # is listed once
    expert_tp_job = [*DEBUG_JOB, "--parallelism.tensor_parallel_degree", "2",
                     "--parallelism.expert_tensor_parallel_degree", "2"]
    layouts, _ = advise(expert_tp_job, 4, load_topology("hgx_h100_ib"))
    refused = [layout for layout in layouts if layout.refused is not None]
    assert {(layout.label, layout.ep) for layout in refused} == {
        ("deepep", 2), ("deepep legacy", 2), ("hybridep", 2), ("ncclep", 2)}
    assert all("expert_tensor_parallel_degree = 2 is not supported" in layout.refused for layout in refused)
    # --json writes a refused layout with its reason and no rank or time
    written = [record for record in layouts_record(layouts) if not record["runnable"]]
    assert [record["refused"] for record in written] == [layout.refused for layout in refused]
    assert not any("rank" in record or "step_s" in record for record in written)
    lines = format_advice(layouts, load_topology("hgx_h100_ib"), 4, "deepseek_v3 debugmodel", None, error=ERROR)
    listed = lines[lines.index("  not runnable (the job's config checks; other backends' sections at their defaults):") + 1:]
    assert [line.split(":")[0].strip() for line in listed if not line.startswith("      ")] == [
        "deepep EP=2", "hybridep EP=2", "ncclep EP=2"]


JOB_671B = ["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml"]
TOPOLOGIES_671B = {"gb200_nvl72": load_topology("gb200_nvl72").placing(64), "hgx_h100_ib": load_topology("hgx_h100_ib")}
"""The 671B job's 256 GPUs: 64 of each NVL72 rack's 72, or 32 HGX nodes."""


@pytest.fixture(autouse=True, scope="module")
def prepared():
    """This process ready to read jobs as the plan CLI makes it: our train specs' model args (every backend builds
    torchtitan's standard MoE; its "deepep" one would import deep_ep)."""
    prepare()


@pytest.fixture(scope="module")
def advice_671b():
    """As the plan CLI prices them: a layout at a nominal rate with the shipped fit's rate as its range's other end."""
    shares = load_fit(SHIPPED_FIT).link_shares()
    return {name: advise(JOB_671B, 256, topology, fitted_fractions=shares)[0] for name, topology in TOPOLOGIES_671B.items()}


def _pattern(words: str) -> str:
    """A regular expression for ``words``, a sentence as the advice prints it with "#" for each figure (a number,
    with thousands separators or decimals)."""
    return re.escape(words).replace(r"\#", r"(\d[\d,]*(?:\.\d+)?)")


def _as_shown(shown: str, value: float) -> str:
    """``value`` written as the advice prints ``shown``: the same decimals and thousands separator."""
    decimals = len(shown.partition(".")[2])
    return f"{value:,.{decimals}f}" if "," in shown else f"{value:.{decimals}f}"


def _number(shown: str) -> float:
    return float(shown.replace(",", ""))


def _advice_lines(advice_671b, name: str) -> list[str]:
    """The plan CLI's advice for the 671B job on topology ``name``, as it prints it."""
    layouts = advice_671b[name]
    return format_advice(layouts, TOPOLOGIES_671B[name], 256, "deepseek_v3 671B",
                         overrides_problem(JOB_671B, 256, layouts[0]), error=ERROR)


def _block_rows(advice_671b, name: str) -> dict[tuple[str, int], dict[str, str]]:
    """The ranked rows of the printed advice for ``name``: {(backend label, EP): {column: the printed text}}."""
    lines = _advice_lines(advice_671b, name)
    header = next(line for line in lines if line.lstrip().startswith("# backend"))
    columns = ["EP", "efsdp", "copy", "A2A ms", "AG ms", "exposed", "local", "step ms", "TFLOPS", "mem GB", "link%", "over"]
    assert header.split() == ["#", "backend", *" ".join(columns).split()]
    rows = {}
    for line in lines[lines.index(header) + 1:]:
        if line.strip() == "...":
            continue
        if not re.match(r"^\s+\d+ ", line):
            break
        # "  {rank:>3} {label:<14} ...": the label may hold a space
        values = dict(zip(columns, line[20:].split(), strict=True))
        rows[line[6:20].strip(), int(values["EP"])] = values
    return rows


def _runnable(advice_671b, name: str) -> dict:
    return {(layout.label, layout.ep): layout for layout in advice_671b[name] if layout.refused is None}


def _model_671b():
    """torchtitan's 671B flavour on the meta device with the job's settings, and the job config."""
    import copy

    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.protocols.train_spec import get_train_spec

    job_config = load_job_config(JOB_671B, device_type=None, world_size=256)
    args = copy.deepcopy(deepseekv3_args["671B"])  # update_from_config changes it in place
    args.update_from_config(job_config)
    with torch.device("meta"):
        return get_train_spec("deepseek_v3").model_cls(args), job_config


def test_671b_data_parallel_sync_is_the_dense_parameters_over_the_outer_link(advice_671b):
    """FSDP over all 256 ranks crosses the outer link on both topologies (50 GB/s per GPU): the 17.1G parameters
    outside the routed experts gathered in bf16 in forward and again in backward (FSDP reshards after forward)
    and reduce-scattered in fp32, 255/256 of each moved, plus one start-up per fully_shard unit (the 61 blocks,
    the embeddings and the output layer) and collective; hidden behind compute (overlap)."""
    model, job_config = _model_671b()
    dense = sum(parameter.numel() for name, parameter in model.named_parameters() if ".moe.experts." not in name)
    assert round(dense / 1e9, 1) == 17.1
    assert (job_config.training.mixed_precision_param, job_config.training.mixed_precision_reduce) == (
        "bfloat16", "float32")
    for name, topology in TOPOLOGIES_671B.items():
        outer = topology.levels[-1]
        assert outer.all_gather_bandwidth_GBps == outer.reduce_scatter_bandwidth_GBps == 50.0
        seconds = (dense * 255 / 256 * (2 + 2 + 4) / 50e9
                   + 3 * (model.model_args.n_layers + 2) * outer.latency_us * 1e-6)
        (compute,) = _printed(advice_671b, name, f"compute # ms per step at {topology.compute_tflops:g} TFLOP/s")
        sync, exposed = _printed(advice_671b, name, "data-parallel sync # ms per step (# exposed)")
        assert [sync, exposed] == [_as_shown(sync, seconds * 1e3),
                                   _as_shown(exposed, max(0.0, _number(sync) - _number(compute)))]


def _printed(advice_671b, name: str, words: str) -> tuple[str, ...]:
    """The figures of ``words`` (:func:`_pattern`) in the printed advice for ``name`` (its lines joined)."""
    found = re.search(_pattern(words), " ".join(" ".join(_advice_lines(advice_671b, name)).split()))
    assert found is not None, (name, words)
    return found.groups()


def test_671b_compute_and_tflops_are_torchtitans_flops(advice_671b):
    """Compute per step is torchtitan's FLOPs per token (6 x active parameters + attention) for the rank's 4 x 4096
    tokens, with every layer's forward recomputed (a third of a pass more), at the topology's TFLOP/s, the routed
    experts' share at its MXFP8 rate where it gives one (GB200); each row's
    TFLOPS is the tokens' FLOPs (recomputation not counted) over the row's step."""
    model, job_config = _model_671b()
    _, per_token = model.model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    flops = per_token * job_config.training.local_batch_size * job_config.training.seq_len
    # the job's quantize.grouped_mm.mx runs the routed experts (6 x top_k of 256 experts per token) in MXFP8
    moe = model.model_args.moe_args
    routed = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    mxfp8 = 6 * routed * moe.top_k / moe.num_experts / per_token
    for name, topology in TOPOLOGIES_671B.items():
        compute, rate, share = _printed(advice_671b, name, "compute # ms per step at # TFLOP/s, its #% in MXFP8 GEMMs")
        mxfp8_rate = topology.mxfp8_compute_tflops or topology.compute_tflops
        seconds = flops * 4 / 3 * ((1 - mxfp8) / topology.compute_tflops + mxfp8 / mxfp8_rate) / 1e12
        assert [compute, rate, share] == [_as_shown(compute, seconds * 1e3), _as_shown(rate, topology.compute_tflops),
                                          _as_shown(share, mxfp8 * 100)]
        for key, row in _block_rows(advice_671b, name).items():
            # TFLOPS is rounded to a unit; the step to the ms moves the TFLOPS from it by under 0.1
            assert flops / (_number(row["step ms"]) * 1e-3) / 1e12 == pytest.approx(_number(row["TFLOPS"]), abs=0.6), key


def test_671b_nccl_copies_are_top_k_over_the_other_ranks(advice_671b):
    """nccl sends one copy per (token, expert) pair that leaves the rank: top-8 x (EP - 1) / EP, in every row."""
    for name in TOPOLOGIES_671B:
        nccl = {ep: row["copy"] for (label, ep), row in _block_rows(advice_671b, name).items() if label == "nccl"}
        assert nccl and nccl == {ep: _as_shown(copy, 8 * (ep - 1) / ep) for ep, copy in nccl.items()}


def test_671b_ep_32_gathers_hide_behind_the_previous_blocks_forward(advice_671b):
    """On GB200, EP=32's expert gathers (12.3 ms a layer) hide behind the previous block's forward (25 ms: a third
    of one block's pass at 1000 TFLOP/s): its exposed communication is the all-to-alls alone, 6 a layer (dispatch
    and combine, forward, recomputed forward and backward) over the 58 MoE layers."""
    model, job_config = _model_671b()
    _, per_token = model.model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    tokens = job_config.training.local_batch_size * job_config.training.seq_len
    block_forward_ms = per_token * tokens / 3 / model.model_args.n_layers / 1000e12 * 1e3
    rows = _block_rows(advice_671b, "gb200_nvl72")
    assert any(ep == 32 for _, ep in rows)
    for (label, ep), row in rows.items():
        if ep == 32:
            assert _number(row["AG ms"]) < block_forward_ms
            # the A2A column has 3 significant digits: 348 all-to-alls carry its rounding (half its last digit)
            rounding = 0.5 * 10 ** -len(row["A2A ms"].partition(".")[2])
            assert _number(row["exposed"]) == pytest.approx(58 * 6 * _number(row["A2A ms"]), abs=0.5 + 348 * rounding)


def test_a_larger_nvlink_domain_than_the_topology_has_is_refused(advice_671b):
    """The 671B job tells HybridEP that 64 ranks share NVLink: right on GB200 NVL72, wrong on HGX nodes of 8."""
    expected = (
        "hybridep.ranks_per_nvlink_domain = 64, but topology 'HGX H100, InfiniBand NDR' groups 8 ranks in its "
        "innermost level 'NVLink (one node)': set it to at most 8 (a divisor of the EP degree)"
    )
    hgx = {layout.ep: layout.refused for layout in advice_671b["hgx_h100_ib"] if layout.backend == "hybridep"}
    assert hgx[64] == expected  # 128 and 256 are refused earlier: they need the multinode build
    assert not any("innermost level" in (layout.refused or "") for layout in advice_671b["gb200_nvl72"])


def test_a_smaller_ep_group_is_priced_with_its_degree_as_the_nvlink_domain(advice_671b):
    """The 671B job tells HybridEP that 64 EP ranks share a rack's NVLink: at EP=32 or 16 the whole EP group lies in
    one rack, so the advisor prices it with the domain at the EP degree, and the layout's overrides say so (the
    job's 64 would not divide the degree); at EP=64 the job's value stands."""
    hybridep = {layout.ep: layout for layout in advice_671b["gb200_nvl72"]
                if layout.backend == "hybridep" and not layout.settings}
    for ep in (16, 32):
        assert hybridep[ep].refused is None
        assert hybridep[ep].ep_settings == (("hybridep", "ranks_per_nvlink_domain", ep),)
        overrides = hybridep[ep].overrides()
        assert overrides[overrides.index("--hybridep.ranks_per_nvlink_domain") + 1] == str(ep)
        assert overrides_problem(JOB_671B, 256, hybridep[ep]) is None
    assert hybridep[64].refused is None and hybridep[64].ep_settings == ()
    assert "--hybridep.ranks_per_nvlink_domain" not in hybridep[64].overrides()
    # an HGX node holds 8 ranks: the job's 64 is refused there, and at EP=16 the refusal says where 16 comes from
    hgx = {layout.ep: layout.refused for layout in advice_671b["hgx_h100_ib"]
           if layout.backend == "hybridep" and not layout.settings}
    assert hgx[16].endswith("(the job sets 64; this layout sets 16, its EP degree)")
    # a degree that does not divide the job's domain keeps it (the checks refuse it), as does a larger one
    assert [nvlink_domain_at_ep(domain, ep) for domain, ep in ((64, 48), (64, 64), (64, 128), (72, 16), (None, 8))] == [
        {}, {}, {}, {}, {}]


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
    from torchtitan_ext.planning.job_shape import job_shape
    from torchtitan_ext.config import load_job_config

    job_config = load_job_config([*DEBUG_JOB, *overrides], device_type=None, world_size=4)
    shape = job_shape(job_config, 4)
    assert (shape.moe_layers, shape.recomputed_layers, shape.dispatches) == (5, recomputed, dispatches)
    assert shape.work.regather_in_backward is regather
    assert shape.expert_world == 4


def _dump(sampled: np.ndarray, experts: int) -> dict:
    """The keys of a loaded routing-statistics dump, from [steps, layers, tokens, top_k] expert ids."""
    counts = np.stack([[np.bincount(ids.ravel(), minlength=experts) for ids in step] for step in sampled])
    return {"steps": np.arange(1, len(sampled) + 1), "layers": np.arange(1, sampled.shape[1] + 1),
            "tokens_per_expert": counts, "top_k": np.array(sampled.shape[3]), "sampled_expert_ids": sampled}


def test_measured_uniform_routing_matches_the_uniform_expectation():
    rng = np.random.default_rng(0)
    experts, top_k = 32, 4
    sampled = np.stack([[rng.permutation(experts)[:top_k] for _ in range(4000)] for _ in range(2)])[:, None]
    routing = MeasuredRouting.from_dump(_dump(sampled, experts), "uniform", experts, top_k)
    assert routing.dispatches == 2
    for ep in (2, 4, 8):
        # the busiest of ep ranks: over the mean by sampling noise only
        assert routing.pair_share(ep) == pytest.approx(1 / ep, rel=0.05)
        expected = 1 - math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
        assert routing.reach(ep, 1) == pytest.approx(expected, abs=0.03)
        assert routing.reach(ep, ep) == 1.0


def test_measured_skew_sets_the_token_copies():
    """Every token of the debug model (8 experts, top-3) picks experts 0-2: at EP=2 all on rank 1's peer
    rank 0, so the busiest receiver gets every pair (nccl) and every token (deepep, hybridep)."""
    sampled = np.tile(np.array([0, 1, 2], dtype=np.int16), (2, 5, 64, 1))
    layouts, routing = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"), _dump(sampled, 8), "skewed")
    uniform, _ = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"))
    measured = {(layout.label, layout.ep): layout.costs for layout in layouts if layout.refused is None}
    expected = {(layout.label, layout.ep): layout.costs for layout in uniform if layout.refused is None}
    assert routing.pair_share(2) == 1.0 and routing.reach(2, 1) == 1.0
    assert measured["nccl", 2].token_copies == 3.0 and expected["nccl", 2].token_copies == 1.5
    assert measured["deepep", 2].token_copies == 1.0
    assert expected["deepep", 2].token_copies == pytest.approx(1 - math.comb(4, 3) / math.comb(8, 3))
    assert measured["nccl", 2].a2a > expected["nccl", 2].a2a
    # at EP=4 experts 0-1 are on rank 0 and 2 on rank 1: the busiest receives 2 of 3 pairs
    assert measured["nccl", 4].token_copies == pytest.approx(3 * 3 * 2 / 3)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: {**d, "top_k": np.array(2)},
         "--routing-stats dump records 8 experts, top-2; the job's model has 8, top-3: use a dump of this model"),
        (lambda d: {k: v for k, v in d.items() if k != "sampled_expert_ids"},
         "--routing-stats dump has no sampled tokens, which the layout advice needs for the copies per token: "
         "record with routing_stats.sample_tokens > 0"),
        (lambda d: {**d, "sampled_expert_ids": np.full_like(d["sampled_expert_ids"], -1)},
         "--routing-stats dump: a step and layer with no sampled token; record more steps"),
    ],
)
def test_a_dump_the_advice_cannot_use_is_named(change, message):
    sampled = np.tile(np.array([0, 1, 2], dtype=np.int16), (1, 5, 4, 1))
    with pytest.raises(ConfigError) as error:
        MeasuredRouting.from_dump(change(_dump(sampled, 8)), "dump", 8, 3)
    assert str(error.value) == message


def test_cli_uses_a_routing_dump(capsys, tmp_path):
    sampled = np.tile(np.array([0, 1, 2], dtype=np.int16), (2, 5, 64, 1))
    dump = _dump(sampled, 8)
    dump["layers"] = np.array([1, 2, 3, 4, 5])
    # the file schema: integer counts (torchtitan_ext/balancing/routing_stats.py)
    np.savez(tmp_path / "routing_step000001-000002.npz", coactivation=np.zeros((5, 8, 8), dtype=np.int64),
             transitions=np.zeros((5, 8, 8), dtype=np.int64), **dump)
    plan.main(["--topology", "hgx_h100_ib", "--world-size", "4", "--routing-stats", str(tmp_path), *DEBUG_JOB])
    out = " ".join(capsys.readouterr().out.split())  # the advice wraps its lines at 118 columns
    assert f"token bytes and rank loads from measured routing ({tmp_path}: 10 step x layer dispatches)" in out
    assert "uniform routing" not in out.split("evidence: ")[1].split(" why: ")[0]
    assert f"; routing measured ({tmp_path}) why: " in out


THIS_MACHINE = parse_topology(
    {"compute_tflops": 0.03, "overlap": False, "levels": [
        {"name": "gloo", "bandwidth_GBps": 0.6, "all_gather_bandwidth_GBps": 0.3, "reduce_scatter_bandwidth_GBps": 0.2,
         "latency_us": 2000.0}]},
    "this machine",
)


LOCAL_WORK = {"nccl": 0.004, "deepep": 0.030, "hybridep": 0.050, "ncclep": 0.060}
"""Per MoE call, seconds: the reference kernels' local work is larger than nccl's permutation here."""


def test_measured_compute_and_data_parallel_sync_make_the_step_time():
    """Compute is the measured forward-backward per microbatch plus the rank's share of the optimizer, of which
    the routed experts' measured time is what a rank's load scales; FSDP's
    traffic (25.1M parameters outside the experts, 8 units, gathered twice, once per microbatch) adds in full
    without overlap; each EP layout adds its backend's local work per MoE call. The suite trains in float32 on
    every CPU (conftest), so FSDP gathers 4 bytes a parameter."""
    compute = MeasuredCompute(forward_backward_s=1.5, optimizer_s=0.8, processes=4, dispatch_work_s=LOCAL_WORK,
                              routed_experts_s=0.3)
    layouts, _ = advise([*DEBUG_JOB, "--training.local_batch_size", "2", "--training.global_batch_size", "16"], 4,
                        THIS_MACHINE, measured_compute=compute)
    runnable = [layout for layout in layouts if layout.refused is None]
    moved = 25_149_696 * 3 / 4
    per_microbatch = 2 * (moved * 4 / 0.3e9 + 8 * 2e-3) + moved * 4 / 0.2e9 + 8 * 2e-3
    for layout in runnable:
        assert layout.dispatches == 2  # two microbatches of gradient accumulation
        assert (layout.moe_layers, layout.recomputed_layers) == (5, 0)
        local_work = 0.0 if layout.ep == 1 else 2 * 5 * LOCAL_WORK[layout.backend]
        assert layout.local_work_s == pytest.approx(local_work)
        assert layout.compute_s == pytest.approx(2 * 1.5 + 0.8 / 4)
        assert layout.expert_compute_s == pytest.approx(2 * 0.3)
        assert layout.data_parallel_s == pytest.approx(2 * per_microbatch)
        assert layout.data_parallel_exposed_s == layout.data_parallel_s
        assert layout.step_s == pytest.approx(layout.compute_s + 2 * per_microbatch + layout.exposed_s + local_work)
    # compute and data-parallel sync are the same at every layout: the step times rank as what the layout adds
    assert sorted(runnable, key=lambda layout: layout.step_s) == runnable


def test_recomputed_layers_run_the_backends_forward_again():
    """Under full activation checkpointing every MoE layer's forward (half of its dispatch and combine work)
    runs again in backward, as its two forward all-to-alls do."""
    compute = MeasuredCompute(forward_backward_s=1.5, optimizer_s=0.8, processes=4, dispatch_work_s=LOCAL_WORK,
                              routed_experts_s=0.3)
    layouts, _ = advise([*DEBUG_JOB, "--activation_checkpoint.mode", "full"], 4, THIS_MACHINE,
                        measured_compute=compute)
    runnable = [layout for layout in layouts if layout.refused is None and layout.ep > 1]
    assert runnable
    for layout in runnable:
        kept = layout.moe_layers - layout.recomputed_layers
        assert layout.recomputed_layers == 5
        assert layout.local_work_s == pytest.approx(
            layout.dispatches * (kept + 1.5 * layout.recomputed_layers) * LOCAL_WORK[layout.backend]
        )
        # every MoE layer recomputed: a third of a pass more, for the experts as for the whole model
        assert layout.expert_compute_s == pytest.approx(layout.dispatches * 4 / 3 * 0.3)


def test_measured_local_work_decides_between_backends():
    """By bytes alone deepep and hybridep (each token once per rank) beat nccl at EP=4; with the reference
    kernels' measured local work on this machine, nccl's step is the shortest, and the reason says why."""
    job = [*DEBUG_JOB, "--training.local_batch_size", "2"]
    by_bytes = [layout for layout in advise(job, 4, THIS_MACHINE)[0] if layout.refused is None]
    assert by_bytes[0].backend in ("deepep", "hybridep") and by_bytes[0].local_work_s == 0.0
    compute = MeasuredCompute(forward_backward_s=1.5, optimizer_s=0.8, processes=4, dispatch_work_s=LOCAL_WORK,
                              routed_experts_s=0.3)
    layouts, routing = advise(job, 4, THIS_MACHINE, measured_compute=compute)
    runnable = [layout for layout in layouts if layout.refused is None]
    assert (runnable[0].backend, runnable[0].ep) == ("nccl", 4)
    lines = format_advice(layouts, THIS_MACHINE, 4, "deepseek_v3 debugmodel", None, routing, compute, error=ERROR)
    recommended = headline(lines)
    found = re.match(r"  (?:recommended|first by the model): nccl at EP=4, efsdp=1: [0-9,.]+ ms per step predicted, "
                     r"[0-9,.]+ to [0-9,.]+ TFLOPS/GPU \([0-9,.]+ as priced\) "
                     r"evidence: its all-to-all rates: gloo at the topology's stated rate; compute measured on this "
                     r"machine \(--measure-compute\); uniform routing why: least exposed MoE communication plus the backend's "
                     r"local work per step, ([0-9.]+) ms: ([0-9.]+) exposed communication \+ ([0-9.]+) local work; "
                     r"(deepep|hybridep) \(best at EP=4\) takes ([0-9.]+) ms", recommended)
    assert found, recommended
    best, rival = runnable[0], next(layout for layout in runnable if layout.backend == found[4])
    shown = [float(found[index]) / 1e3 for index in (1, 2, 3, 5)]
    assert shown == pytest.approx([best.moe_s, best.exposed_s, best.local_work_s, rival.moe_s], rel=5e-3)
    assert best.exposed_s > rival.exposed_s and best.moe_s < rival.moe_s


def test_data_parallel_sync_hides_behind_compute_where_it_overlaps():
    """Hidden traffic still occupies its link: the debug model on 4 H100s computes 0.54 ms a step, and at EP=1
    its FSDP traffic (dense parameters and all experts, on NVLink) takes 0.56 ms, more than compute alone; with
    torchtitan's own sort around the experts (its passes over the rows) compute and local work set the step.
    At EP=4 the same link carries the FSDP sync and the all-to-alls, 0.52 ms."""
    runnable = {(layout.label, layout.ep): layout
                for layout in advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"))[0] if layout.refused is None}
    for layout in runnable.values():
        assert 0 < layout.data_parallel_s < layout.compute_s and layout.data_parallel_exposed_s == 0.0
        assert layout.step_s == pytest.approx(
            max(layout.compute_s + layout.exposed_s + layout.local_work_s, layout.busiest_link[1]), rel=1e-12)
        assert [link for link, _ in layout.link_busy] == ["NVLink (one node)"]
    gathered, dispatched = runnable["nccl", 1], runnable["nccl", 4]
    assert gathered.compute_s < gathered.busiest_link[1] < gathered.step_s
    assert gathered.step_s == pytest.approx(gathered.compute_s + gathered.local_work_s, rel=1e-12)
    assert gathered.busiest_link[1] == pytest.approx(
        gathered.data_parallel_s + gathered.moe_layers * (2 * gathered.costs.all_gather + gathered.costs.reduce_scatter))
    assert not dispatched.link_bound
    assert dispatched.step_s == pytest.approx(
        dispatched.compute_s + dispatched.exposed_s + dispatched.local_work_s, rel=1e-12)
    assert dispatched.busiest_link[1] == pytest.approx(dispatched.data_parallel_s + 4 * dispatched.moe_layers * dispatched.costs.a2a)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ([*DEBUG_JOB, "--parallelism.tensor_parallel_degree", "2"], 4,
         "--measure-compute times one rank's forward and backward through the whole model, which "
         "parallelism.tensor_parallel_degree = 2 splits: drop --measure-compute (FLOPs at the topology's "
         "compute_tflops), or ask about the job with tensor_parallel_degree = 1"),
        ([], 4 * runtime.max_local_world_size(),
         "--measure-compute starts one process per rank on this machine, and --world-size {world} is more than the "
         "{most} ranks it can run: it measures a job this machine runs; drop --measure-compute for another "
         "machine's job"),
        (["--job.config_file", "train_configs/llama4_debug_model.toml", "--model.flavor", "17bx16e",
          "--parallelism.expert_parallel_degree", "4"], 4,
         "--measure-compute builds the whole model (107,770M parameters) in each of 4 processes: 6,423.6 GiB of "
         "parameters and optimizer state, more than half of the {memory} GiB of memory this machine gives this process; "
         "drop --measure-compute for a model this machine cannot train"),
        ([*DEBUG_JOB, "--model.name", "llama3", "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree",
          "1"], 2,
         "--measure-compute times the routed experts of the model's MoE layers, and model.name = 'llama3' builds "
         "none: drop --measure-compute (FLOPs at the topology's compute_tflops)"),
    ],
)
def test_compute_that_cannot_be_measured_here_is_refused(overrides, world_size, message):
    from torchtitan_ext.config import load_job_config

    job_config = load_job_config(overrides or DEBUG_JOB, device_type="cpu", world_size=world_size)
    with pytest.raises(ConfigError) as error:
        check_measurable(job_config, world_size)
    assert str(error.value).startswith(message.format(world=world_size, most=runtime.max_local_world_size(),
                                                      memory=f"{memory_limit_bytes() / 2**30:,.1f}"))


def test_measure_compute_refuses_a_gpu_machine(monkeypatch):
    from torchtitan_ext.config import load_job_config

    job_config = load_job_config(DEBUG_JOB, device_type="cpu", world_size=2)
    monkeypatch.setattr(runtime, "device_type", lambda: "cuda")
    with pytest.raises(ConfigError, match=r"^--measure-compute times a CPU job, and this machine trains on CUDA"):
        check_measurable(job_config, 2)


def test_measure_compute_needs_a_topology(capsys):
    code, err = _run_cli(capsys, "--measure-compute", "--world-size", "2", *DEBUG_JOB)
    assert (code, err) == (2, "error: --measure-compute sets the layout advice's compute: add --topology\n")


@pytest.mark.slow
def test_cli_measures_the_compute(capsys):
    """Two processes train GPT-OSS's small debug flavour (attention masks, experts with biases) at 32 tokens; the
    table's compute is what they measured: one forward-backward and half of the optimizer (each rank holds half of
    the parameters), the routed experts a part of that forward-backward, and each EP layout's local work is its
    backend's measured dispatch + combine beyond torchtitan's own sort."""
    job = ["--job.config_file", "train_configs/gpt_oss_debug_model.toml", "--training.local_batch_size", "1",
           "--training.seq_len", "32"]
    plan.main(["--topology", "hgx_h100_ib", "--world-size", "2", "--measure-compute", *job])
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # the advice wraps its lines at 118 columns
    found = re.search(r"compute ([0-9.,]+) ms per step measured on this machine \(2 processes: forward \+ backward "
                      r"([0-9.]+) s, the routed experts ([0-9.]+) s of it; optimizer ([0-9.]+) s for all parameters\)",
                      out)
    assert found, out
    step_ms, forward_backward, optimizer = float(found[1].replace(",", "")), float(found[2]), float(found[4])
    assert forward_backward > 0 and optimizer > 0
    assert 0 < float(found[3]) < forward_backward
    assert step_ms == pytest.approx((forward_backward + optimizer / 2) * 1e3, abs=1.5, rel=0.01)
    # each backend's local work per MoE call, measured; an EP=2 layout adds it for each MoE layer
    moe_layers = sum(isinstance(module, MoE) for module in shared_meta_model(parse(job)).modules())
    found = re.search(r"dispatch \+ combine beyond its collectives and torchtitan's own sort \(([0-9.]+) ms\): "
                      r"nccl ([0-9.]+) ms, deepep ([0-9.]+) ms, hybridep ([0-9.]+) ms", out)
    assert found, out
    assert float(found[1]) > 0
    per_call = dict(zip(BACKENDS, (float(found[index]) for index in (2, 3, 4))))
    for backend, ms in per_call.items():
        row = re.search(rf"^ +\d+ +{backend} +2 +1 .*$", raw, re.MULTILINE)
        assert row, raw
        assert float(row[0].split()[8].replace(",", "")) == pytest.approx(moe_layers * ms, rel=0.01, abs=0.01)


def test_nvl72_racks_hold_72_and_a_job_says_how_many_it_uses():
    """World sizes of whole racks run as they are; the 671B job's 256 GPUs are 64 of each of 4 racks, which the
    topology says for a world size that is not whole racks."""
    gb200 = load_topology("gb200_nvl72")
    assert [gb200.group_sizes(world) for world in (72, 144, 288)] == [[72, 72], [72, 144], [72, 288]]
    with pytest.raises(ConfigError, match=r"has workers = 72, which does not divide the world size 256: use a world size "
                                          r"that is a multiple of 72, or say how many ranks the job places in each with "
                                          r"--ranks-per-group$"):
        gb200.group_sizes(256)
    placed = gb200.placing(64)
    assert placed.group_sizes(256) == [64, 256] and placed.name == "GB200 NVL72, 64 ranks per NVLink domain (one rack)"
    # the topology's own placement where a job is not whole racks (the shipped 671B job, without flags); a count
    # given wins; whole racks stay whole
    assert gb200.placed_for(256) == placed and gb200.placed_for(256, 32).group_sizes(256) == [32, 256]
    assert gb200.placed_for(144) is gb200
    with pytest.raises(ConfigError, match=r"^--ranks-per-group 80: topology 'GB200 NVL72''s level 'NVLink domain "
                                          r"\(one rack\)' holds 72 workers: use a count from 1 to 72$"):
        gb200.placing(80)


def test_a_kernel_domain_smaller_than_the_nvlink_group_goes_over_the_next_link():
    gb200 = load_topology("gb200_nvl72").placing(64)
    split = gb200.within_kernel_domain(8, "deepep")
    assert split.group_sizes(256) == [8, 64, 256]
    assert [level.bandwidth_GBps for level in split.levels] == [900.0, 50.0, 50.0]
    assert split.levels[1].name == ("RDMA between racks, used between deepep's 8-rank kernel domains inside NVLink "
                                    "domain (one rack)")
    assert gb200.within_kernel_domain(64, "hybridep") is gb200 and gb200.within_kernel_domain(128, "x") is gb200


def _advice_16b(*overrides: str) -> dict:
    # one sequence per rank: what is checked (links, copies, the rates' ratio) does not scale with the batch
    job = ["--job.config_file", "train_configs/deepseek_v3_16b.toml", "--training.local_batch_size", "1", *overrides]
    # the EP degrees the tests compare: within v1's 8 NVLink peers, and a whole rack
    return {(layout.label, layout.ep): layout for layout in advise(job, 64, load_topology("gb200_nvl72"),
                                                                   ep_degrees={8, 64})[0]
            if layout.refused is None}


def test_kernels_that_reach_fewer_nvlink_peers_pay_the_network_for_the_rest():
    """DeepEP's v1 kernels have at most 8 NVLink peers (LEGACY_NUM_MAX_NVL_PEERS = 8 in DeepEP main's
    csrc/kernels/legacy/compiled.cuh), and HybridEP told of 8 ranks per NVLink domain uses RDMA beyond them: on
    a GB200 rack their EP=64 all-to-all crosses the 50 GB/s link, where DeepEP V2 and HybridEP left to the
    machine stay on NVLink (the 16B model: 64 experts, on 64 ranks of one rack)."""
    hybridep = ("--parallelism.expert_parallel_comm_backend", "hybridep", "--parallelism.expert_parallel_degree", "64")
    legacy, elastic = _advice_16b("--deepep.api", "legacy"), _advice_16b("--deepep.api", "elastic")
    machine = {
        "deepep": elastic["deepep", 64],
        "hybridep": _advice_16b(*hybridep, "--hybridep.ranks_per_nvlink_domain", "64")["hybridep", 64],
    }
    limited = {
        "deepep": legacy["deepep", 64],
        "hybridep": _advice_16b(*hybridep, "--hybridep.ranks_per_nvlink_domain", "8",
                                "--hybridep.multinode_build")["hybridep", 64],
    }
    for backend, layout in limited.items():
        assert layout.a2a_level == (
            f"RDMA between racks, used between {backend}'s 8-rank kernel domains inside NVLink domain (one rack)"
        )
        assert layout.costs.a2a > 5 * machine[backend].costs.a2a
        assert machine[backend].a2a_level == "NVLink domain (one rack)"
    assert legacy["nccl", 64].costs == elastic["nccl", 64].costs
    # 8 ranks: all within v1's reach, the same bytes over the same link, each API at its own published rate
    assert legacy["deepep", 8].costs.token_copies == elastic["deepep", 8].costs.token_copies
    assert legacy["deepep", 8].a2a_level == elastic["deepep", 8].a2a_level == "NVLink domain (one rack)"


def test_an_all_to_all_beyond_the_kernels_reach_occupies_the_next_link():
    """DeepEP v1 at EP=64 in one rack: its all-to-all runs over the RDMA NICs between its 8-rank kernel domains,
    so that link carries it (the rack's NVLink carries FSDP's sync); V2's stays on NVLink."""
    legacy, elastic = _advice_16b("--deepep.api", "legacy")["deepep", 64], _advice_16b("--deepep.api", "elastic")["deepep", 64]
    assert legacy.efsdp == 1 and dict(legacy.link_busy)["RDMA between racks"] == pytest.approx(legacy.communication_s)
    assert "RDMA between racks" not in dict(elastic.link_busy)
    assert dict(elastic.link_busy)["NVLink domain (one rack)"] == pytest.approx(
        elastic.communication_s + elastic.data_parallel_s)


def test_json_lists_every_layout_considered(capsys, tmp_path):
    out = tmp_path / "layouts.json"
    plan.main(["--topology", "hgx_h100_ib", "--world-size", "4", "--json", str(out), *DEBUG_JOB])
    # nccl at EP = 1, 2 and 4; deepep, its v1 API, hybridep and ncclep at EP = 2 and 4
    assert capsys.readouterr().out.splitlines()[-1] == f"Wrote 11 layouts to {out}"
    advice = json.loads(out.read_text())
    records = advice["layouts"]
    layouts, _ = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"))
    assert [(r["backend"], r["settings"], r["ep_degree"], r["runnable"]) for r in records] == [
        (layout.backend,
         {f"{section}.{field}": value for section, field, value in (*layout.ep_settings, *layout.settings)}, layout.ep,
         layout.refused is None) for layout in layouts
    ]
    assert {"deepep.api": "legacy"} in [r["settings"] for r in records]
    runnable = [r for r in records if r["runnable"]]
    assert [r["step_s"] for r in runnable] == pytest.approx([layout.step_s for layout in layouts[:len(runnable)]])
    assert [r["rank"] for r in runnable] == list(range(1, len(runnable) + 1))
    assert runnable[0]["overrides"] == layouts[0].overrides()
    # every rate published on HGX but NCCL EP's, priced at the nominal rate: a bound
    assert {(r["pricing"], r["assumption"] is None) for r in runnable if r["backend"] != "ncclep"} == {("priced", True)}
    assert {r["pricing"] for r in runnable if r["backend"] == "ncclep"} == {"range"}
    assert advice["decision"] in ("pick", "measure") and advice["band"] == ERROR.gap_band
    assert (advice["decision"] == "pick") == (len(advice["candidates"]) == 1)
    assert advice["candidates"][0]["overrides"] == layouts[0].overrides() and advice["candidates"][0]["rank"] == 1
    assert not list(tmp_path.glob(".*partial"))


def test_json_says_which_layouts_rest_on_a_nominal_rate_and_ranks_them_after_the_priced(advice_671b):
    """On GB200, nccl's all-to-all over the rack is priced at NVLink's nominal rate (none published): those rows
    say so, come after every priced one although they predict the shortest steps, and give the range from that
    bound to the step at the rate the shipped fit gives nccl there."""
    runnable = [record for record in layouts_record(advice_671b["gb200_nvl72"]) if record["runnable"]]
    nominal = [record for record in runnable if record["pricing"] == "range"]
    assert {(record["backend"], record["ep_degree"] > 1) for record in nominal} == {("nccl", True)}
    assert all(record["assumption"] == "all-to-all over NVLink domain (one rack) at the link's nominal rate (no "
               "published figure): a lower bound of its time; the range's other end at the share of it a fit gives "
               "(docs/advisor_fit.toml)" for record in nominal)
    # at the lower rate the all-to-all takes longer, hidden under compute or not
    assert all(record["step_s_range"][0] == record["step_s"] <= record["step_s_range"][1] for record in nominal)
    assert any(record["step_s_range"][0] < record["step_s_range"][1] for record in nominal)
    assert all(record["step_s_range"] is None for record in runnable if record["pricing"] == "priced")
    assert min(record["rank"] for record in nominal) > max(record["rank"] for record in runnable
                                                          if record["pricing"] == "priced")
    assert min(record["step_s"] for record in nominal) < runnable[0]["step_s"]
    # each link's source, one entry per link the all-to-all crosses: the bound named where it is one
    assert all("NVLink domain (one rack) at the nominal rate, a bound (no published mnnvl figure)"
               in record["rate_evidence"] for record in nominal)
    priced = [record for record in runnable if record["pricing"] == "priced"]
    single = [record for record in priced if record["ep_degree"] == 1]
    multiple = [record for record in priced if record["ep_degree"] > 1]
    assert single and all(record["rate_evidence"] == [] for record in single)
    assert multiple and all(
        record["rate_evidence"] and all("docs/published_ep_figures.md" in source for source in record["rate_evidence"])
        for record in multiple)


@pytest.mark.parametrize(
    "where, topology, message",
    [
        ("missing/layouts.json", True, "not a file in a writable folder: give a path in an existing folder you can write"),
        (".", True, "not a file in a writable folder: give a path in an existing folder you can write"),
        ("layouts.json", False, "--json writes from the layout advice: add --topology"),
    ],
)
def test_a_json_file_that_cannot_be_written_is_refused_first(capsys, tmp_path, where, topology, message):
    argv = ["--world-size", "4", "--json", str(tmp_path / where), *DEBUG_JOB]
    with pytest.raises(SystemExit) as exited:
        plan.main(["--topology", "hgx_h100_ib", *argv] if topology else argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].endswith(message) and "Layout advice" not in captured.out


def test_json_with_a_mode_that_gives_no_layouts_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        plan.main(["--calibrate", "--json", str(tmp_path / "layouts.json")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --json writes from the layout advice, which --calibrate, --paper, --validate and --fit do not give: "
        "drop one of them"
    )


def test_emit_config_writes_the_recommended_layout_as_a_job_config(capsys, tmp_path, advice_671b):
    """The 671B GB200 job on the GB200 topology as shipped (64 ranks per rack, no flag): the file selects the
    recommended layout (the first priced one: nccl, faster at its nominal NVL72 rate, is not priced), and loads
    back as the config the advisor priced; its header says how it was made."""
    out = tmp_path / "advised.toml"
    job = ["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml"]
    plan.main(["--topology", "gb200_nvl72", "--world-size", "256", "--emit-config", str(out), *job])
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1] == (
        f"Wrote the recommended layout's job config to {out} (train with: ./run_train.sh --job.config_file {out})")
    assert "with those, this job config still fails its checks" not in " ".join(printed.split())
    text = out.read_text()
    assert text.startswith("# Written by python -m torchtitan_ext.plan --topology gb200_nvl72 --world-size 256 ")
    loaded = load_job_config(["--job.config_file", str(out)], device_type=None, world_size=256)
    recommended = next(layout for layout in advice_671b["gb200_nvl72"] if layout.refused is None)
    assert recommended.backend == "hybridep" and not recommended.nominal_links
    assert (loaded.parallelism.expert_parallel_comm_backend, loaded.parallelism.expert_parallel_degree) == (
        recommended.backend, recommended.ep)
    for section, field, value in (*recommended.ep_settings, *recommended.settings):
        assert getattr(getattr(loaded, section), field) == value
    # the job's 64 EP ranks per rack, at the recommended degree: all of a smaller EP group's ranks share NVLink
    assert loaded.hybridep.ranks_per_nvlink_domain == min(64, recommended.ep)
    # a layout of another backend drops the [hybridep] settings it would leave behind
    nccl = next(layout for layout in advice_671b["gb200_nvl72"] if (layout.label, layout.ep) == ("nccl", 32))
    assert advised_config(JOB_671B, 256, nccl).hybridep.ranks_per_nvlink_domain is None
    original = load_job_config(job, device_type=None, world_size=256)
    assert loaded.model.flavor == original.model.flavor and loaded.training.seq_len == original.training.seq_len
    assert not list(tmp_path.glob(".*partial"))


def test_replica_traffic_uses_the_physical_links_whatever_the_kernels_reach():
    """The replicas' weights and gradients move by torch.distributed collectives, not the backend's kernels:
    DeepEP v1 and V2 pay the same for them, on NVLink, though v1's own all-to-all crosses RDMA."""
    job = ["--job.config_file", "train_configs/deepseek_v3_16b.toml"]
    priced = {}
    for api in ("legacy", "elastic"):
        layouts, _ = advise([*job, "--deepep.api", api], 64, load_topology("gb200_nvl72"), replica_slots=[1],
                            ep_degrees={64})
        priced[api] = next(layout for layout in layouts if (layout.label, layout.ep) == ("deepep", 64))
    assert priced["legacy"].refused is None and priced["elastic"].refused is None
    assert priced["legacy"].replica_fetch_s == priced["elastic"].replica_fetch_s > 0
    assert priced["legacy"].costs.a2a > 5 * priced["elastic"].costs.a2a


def test_a_limit_that_no_ep_degree_meets_is_listed_once_with_the_degrees_it_refused(advice_671b):
    """The 671B job dispatches local_batch_size x seq_len tokens per rank at every EP degree, over NCCL EP's limit:
    one line names every degree; a reason that names the degree stays a line of its own."""
    lines = _advice_lines(advice_671b, "gb200_nvl72")
    listed = lines[next(i for i, line in enumerate(lines) if line.startswith("  not runnable")) + 1:]
    ncclep = [line for line in listed if line.startswith("    ncclep EP=")]
    assert len(ncclep) == 1
    assert ncclep[0].startswith(f"    ncclep EP={', '.join(str(ep) for ep in range(2, 257) if 256 % ep == 0)}: ")
    assert [line.split(":")[0].strip() for line in listed if line.startswith("    hybridep EP=")] == [
        "hybridep EP=128", "hybridep EP=256"]


def test_the_671b_advice_says_measure_and_its_range_holds_the_published_hybridep_run(advice_671b):
    """On GB200 the 671B job's best priced layouts lie within the advisor's measured band of each other, and nccl,
    a bound at NVL72's nominal rate, predicts a shorter step than all of them: the advice says "measure" and lists
    them, each with what to add to the job's launch, and each candidate's overrides pass the job's own checks. The
    TFLOPS range of HybridEP at EP=64 as configured holds the figure torchtitan PR #2207 published for that layout
    (the comparisons file's fit row: no held-out row, so not what the band was measured on)."""
    layouts = advice_671b["gb200_nvl72"]
    runnable = [layout for layout in layouts if layout.refused is None]
    decision = decide(runnable, ERROR)
    within = [layout for layout in runnable[1:] if layout.step_s <= runnable[0].step_s * (1 + ERROR.gap_band)]
    assert decision.kind == "measure" and list(decision.candidates) == [runnable[0], *within]
    assert {("nccl", 32), ("nccl", 64), ("hybridep", 64)} <= {(layout.label, layout.ep) for layout in within}
    assert all(overrides_problem(JOB_671B, 256, layout) is None for layout in decision.candidates)
    published = next(row for row in load_comparisons() if row.id == "torchtitan-2207-dsv3-671b-gb200-ep64")
    as_run = next(layout for layout in decision.candidates if (layout.label, layout.ep) == ("hybridep", 64))
    low, high = decision.tflops_range(as_run)
    assert low <= published.measured["hybridep"] <= high < as_run.tflops_per_gpu
    lines = _advice_lines(advice_671b, "gb200_nvl72")
    assert max(len(line) for line in lines) <= 118
    assert paragraph(lines, "  decision:").startswith(
        f"  decision: measure. {len(decision.candidates)} layouts predict steps within {ERROR.gap_band:.1%} of the "
        "first's, which the model cannot tell apart")
    listed = [paragraph(lines, f"    {index}. ") for index in range(1, 5)]
    # each backend setting's best: HybridEP at EP=32, its EP group in one rack, before the configured EP=64
    assert [entry.split(":")[0].split(". ")[1] for entry in listed] == [
        "hybridep 16/32 EP=32", "hybridep EP=32", "deepep EP=32", "nccl EP=32"]
    second = next(layout for layout in decision.candidates if (layout.label, layout.ep) == ("hybridep", 32))
    assert " ".join(measure_arguments(second)) in listed[1].replace("\\ ", "")


def test_the_routed_experts_are_timed_on_the_rows_each_layer_received():
    """--measure-compute's experts pass runs each MoE layer's grouped experts once, on exactly the rows and
    per-expert counts that layer received in a forward of the batch (every token's top-k pairs), forward and
    backward, and leaves no gradient behind."""
    from torchtitan.models.moe.moe import GroupedExperts

    from torchtitan_ext.config import model_class_and_args
    from torchtitan_ext.measuring.compute import _routed_experts_pass

    job_config = load_job_config([*DEBUG_JOB, "--model.flavor", "debugmodel_small"], device_type="cpu", world_size=2)
    model_cls, model_args = model_class_and_args(job_config)
    torch.manual_seed(0)
    model = model_cls(model_args)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    tokens = torch.randint(0, model_args.vocab_size, (2, 32))
    seen, backward = [], []

    def record(experts, args, output):
        seen.append((experts, args[0].detach().clone(), args[1].clone()))
        output.register_hook(lambda grad: backward.append(experts))

    experts_modules = [module for module in model.modules() if isinstance(module, GroupedExperts)]
    with torch.no_grad():
        forward_rows = []
        handles = [module.register_forward_hook(lambda m, args, out: forward_rows.append((args[0].clone(), args[1].clone())))
                   for module in experts_modules]
        model(tokens)
        for handle in handles:
            handle.remove()
    run = _routed_experts_pass(model, tokens, {})  # an SDPA model: no masks
    for module in experts_modules:
        module.register_forward_hook(record)
    run()
    assert len(experts_modules) == model_args.n_layers - model_args.n_dense_layers
    assert [experts for experts, _, _ in seen] == experts_modules == backward  # each backward right after its forward
    for (_, rows, counts), (expected_rows, expected_counts) in zip(seen, forward_rows, strict=True):
        assert int(counts.sum()) == tokens.numel() * model_args.moe_args.top_k
        assert torch.equal(rows, expected_rows) and torch.equal(counts, expected_counts)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_memory_counts_deepep_v2_5s_load_balancing_region_within_one_nvlink_domain(tmp_path):
    """With api = 'ep' and 2 replica slots, a DeepEP layout whose EP group is one NVLink domain (a GB200 rack:
    EP <= 64) also holds the replicas' region (671B: 504 MiB); beyond a rack the replicas move
    by all-to-all and the memory equals the elastic API's. Other backends reserve none."""
    text = Path("train_configs/deepseek_v3_671b_gb200.toml").read_text()
    hybridep = '[hybridep]\nranks_per_nvlink_domain = 64\nuse_mnnvl = true\n'
    assert hybridep in text and 'expert_parallel_comm_backend = "hybridep"' in text
    text = text.replace(hybridep, "").replace('comm_backend = "hybridep"', 'comm_backend = "deepep"')
    topology = TOPOLOGIES_671B["gb200_nvl72"]

    def memory(api):
        config = tmp_path / f"{api}.toml"
        config.write_text(text)
        # one sequence per rank: the region does not scale with the batch, and fewer rows count faster
        job = ["--job.config_file", str(config), "--expert_replication.slots_per_rank", "2",
               "--deepep.api", api, "--training.local_batch_size", "1"]
        layouts = advise(job, 256, topology, ep_degrees={32, 64, 128})[0]  # within a rack, a rack, beyond it
        return {(layout.label, layout.ep): layout.memory_bytes for layout in layouts if layout.refused is None}

    v2_5, elastic = memory("ep"), memory("elastic")
    region = 504 * 2**20
    job_config = parse(["--job.config_file", str(tmp_path / "ep.toml"),
                        "--expert_replication.slots_per_rank", "2", "--deepep.api", "ep"])
    assert {name: profile.planned_replica_region(job_config) for name, profile in PLANNING_PROFILES.items()} == {
        "nccl": 0, "deepep": region, "hybridep": 0, "ncclep": 0}
    # the kernels' conditions that hold whatever the group: deterministic algorithms move replicas by all-to-all
    job_config.debug.deterministic = True
    assert PLANNING_PROFILES["deepep"].planned_replica_region(job_config) == 0
    deepep_eps = sorted(ep for label, ep in v2_5 if label == "deepep")
    assert 64 in deepep_eps and 128 in deepep_eps
    for (label, ep), held in v2_5.items():
        if label == "deepep":
            assert held - elastic[label, ep] == (region if ep <= 64 else 0), (label, ep)
        elif (label, ep) in elastic:
            assert held == elastic[label, ep], (label, ep)


@pytest.mark.parametrize("sms, fabrics, alternative", [
    ((16, 16), ("mnnvl",), (16, 32)),  # 4c: combine 464.54 GB/s at 32 SMs against 423.19 at 16
    ((32, 32), ("mnnvl",), (16, 32)),  # dispatch 485.50 at 16 against 484.22 at 32
    ((20, 16), ("mnnvl",), (20, 32)),  # 20 dispatch SMs are priced at 16's figure, the fastest: they stay
    ((16, 16), ("nvlink",), None),  # 4d.8: 16 blocks are the fastest for both on DGX H100
    ((4, 4), ("nvlink",), (16, 16)),
    ((16, 16), ("rdma",), None),  # 4d.11: 8 blocks, the nearest published count to 16, are the fastest
    ((4, 4), ("nvlink", "rdma"), None),  # which link bounds it depends on its bytes there: not offered
    ((16, 16), (None,), None),  # a link the topology names no fabric for: nothing published to choose by
    ((16, 16), (), None),  # no all-to-all
])
def test_hybridep_is_also_priced_at_the_fastest_published_sm_counts(sms, fabrics, alternative):
    from torchtitan_ext.ep.hybridep import HybridEPPlanningProfile

    job_config = parse([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep",
                        "--hybridep.num_sms_dispatch", str(sms[0]), "--hybridep.num_sms_combine", str(sms[1])])
    expected = () if alternative is None else ({"num_sms_dispatch": alternative[0], "num_sms_combine": alternative[1]},)
    assert HybridEPPlanningProfile.advised_alternatives(job_config, fabrics) == expected
    assert HybridEPPlanningProfile.settings_label({"num_sms_dispatch": 16, "num_sms_combine": 32}) == "16/32"


def test_no_sm_alternative_beside_dualpipev_overlapped_ep():
    """There the other microbatch computes beside HybridEP's kernels: SMs they take would cost compute."""
    from torchtitan_ext.ep.hybridep import HybridEPPlanningProfile

    job_config = parse([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep"])
    assert HybridEPPlanningProfile.advised_alternatives(job_config, ("mnnvl",))
    parallelism = job_config.parallelism
    parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule = 2, "DualPipeV"
    parallelism.pipeline_parallel_expert_parallel_overlap = True
    assert HybridEPPlanningProfile.advised_alternatives(job_config, ("mnnvl",)) == ()


def test_a_measured_rate_leaves_out_an_alternative_it_would_price_alike():
    """A rate measured on the cluster for blocking HybridEP prices every SM count alike: no 16/32 row; DeepEP's
    other API keeps its own published rate, so it stays."""
    from torchtitan_ext.planning.layout_links import priced_settings

    job_config = load_job_config(["--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml"], device_type=None,
                                 world_size=256)
    topology = TOPOLOGIES_671B["gb200_nvl72"]

    def alternatives(measured):
        return {(name, tuple(settings.items())) for name, _, settings, _ in
                priced_settings(job_config, 64, [0], topology, 256, measured) if settings}

    published = alternatives(None)
    assert ("hybridep", (("num_sms_dispatch", 16), ("num_sms_combine", 32))) in published
    assert ("deepep", (("api", "legacy"),)) in published
    measured = {("hybridep", ("blocking",), 0): None, ("deepep", ("elastic",), 0): None}
    assert alternatives(measured) == {("deepep", (("api", "legacy"),))}


@pytest.mark.slow  # counts the local work of the published job (batch 8) once: about 15 s
def test_the_shipped_fit_reproduces_its_fit_row_where_the_advisor_as_shipped_ranks_it_the_other_way(advice_671b):
    """torchtitan #2207 (DeepSeek-V3 671B, 256 GB200, EP=64): hybridep 1.31x nccl published; as shipped the advisor
    prices nccl at NVL72's nominal rate and calls it faster; under docs/advisor_fit.toml both figures match."""
    fitted = load_fit(SHIPPED_FIT)
    assert fitted.count <= 3
    comparisons, shipped, under_fit = validate(SHIPPED_COMPARISONS, fitted)
    report = format_validation(comparisons, shipped, under_fit, "docs/advisor_fit.toml")
    # the advice's band and ranges are these predictions' error (plan --validate --error-output wrote the file)
    for pricing, predictions in ((AS_SHIPPED, shipped), ("docs/advisor_fit.toml", under_fit)):
        assert replace(load_error(SHIPPED_ERROR, pricing), file="") == pytest.approx(
            measured_error(pricing, comparisons, predictions))
    assert report[1].startswith("  as shipped: nccl ") and "(nominal rate: a bound)" in report[1]
    assert report[1].endswith("the faster backend disagrees")
    assert re.search(r"off the published by nccl [+-]0\.[01]%, hybridep [+-]0\.[01]%; the faster backend agrees$",
                     report[2])
    # the held-out flip (GPT-OSS 120B, nccl 4.0% faster): as shipped nccl is a bound, under the fit priced
    flip = report.index("mbridge-3561-gpt-oss-120b-gb200-ep64-bf16 (held_out): published nccl 423.60, hybridep 406.60 "
                        "TFLOPS/GPU (hybridep -4.0%)")
    assert "(nominal rate: a bound)" in report[flip + 1] and "(nominal rate: a bound)" not in report[flip + 2]


def test_the_advice_prices_under_a_fit_when_asked(capsys, advice_671b):
    """--fit-from: the topology's compute at the fitted scale, and nccl on NVL72 at its fitted rate instead of the
    nominal one (so its layouts are priced, not bounds); a fit of nothing on the topology is refused in one line."""
    fitted = load_fit(SHIPPED_FIT)
    plan.main(["--topology", "gb200_nvl72", "--world-size", "256", "--fit-from", str(SHIPPED_FIT), *JOB_671B])
    out = " ".join(capsys.readouterr().out.split())
    # the topology's compute at the fitted scale, printed as the report prints any topology's (:g)
    assert f"at {1000 * fitted.compute_scale['GB200 NVL72']:g} TFLOP/s, its 44% in MXFP8 GEMMs" in out
    assert (f"nccl: NVLink domain (one rack): {fitted.link_fractions[0].fraction:.2f} of nominal, fitted (on "
            f"{', '.join(fitted.fitted_on)})") in out
    assert "ranked below every priced layout" not in out
    # the recommendation names what its price rests on: published kernel rows, the fit's scale and its row
    assert ("evidence: its all-to-all rates: NVLink domain (one rack) docs/published_ep_figures.md 4c; compute at "
            f"{fitted.compute_scale['GB200 NVL72']:.3f} of the topology's, fitted on {', '.join(fitted.fitted_on)}; "
            "uniform routing") in out
    with pytest.raises(SystemExit):
        plan.main(["--topology", "cross_dc", "--world-size", "256", "--fit-from", str(SHIPPED_FIT), *JOB_671B])
    assert capsys.readouterr().err.strip() == (
        f"error: --fit-from {SHIPPED_FIT}: it fits nothing of topology '{load_topology('cross_dc').name}' (its "
        f"compute scales: {', '.join(fitted.compute_scale)}): fit on a comparison run on it, or drop --fit-from")


def test_a_job_overlapping_its_all_to_alls_pays_only_the_sms_its_kernels_take():
    """DualPipeV with overlapped EP on HGX H100 (132 SMs): the debug model's all-to-alls are far shorter than the
    other microbatch's compute per layer, so each layout's exposed time drops by its all-to-alls less the SMs'
    share of them: HybridEP 16/132, DeepEP v1 20/132; NCCL's and DeepEP V2's SMs are not priced (run-time picks)."""
    args = ["--job.config_file", "train_configs/debug_model.toml", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--parallelism.pipeline_parallel_expert_parallel_overlap",
            "--activation_checkpoint.mode", "none", "--parallelism.expert_parallel_degree", "4"]
    topology = load_topology("hgx_h100_ib")
    overlapped, plain = ({layout.label: layout for layout in advise(args, 8, topology, ep_degrees={4}, a2a_overlap=overlap)[0]}
                         for overlap in (None, False))
    shares = {"hybridep": 16 / 132, "deepep legacy": 20 / 132, "nccl": 0.0, "deepep": 0.0, "ncclep": 0.0}
    assert set(overlapped) == set(shares)
    for label, share in shares.items():
        layout, alone = overlapped[label], plain[label]
        assert layout.a2a_overlap and not alone.a2a_overlap
        assert layout.communication_sm_share == pytest.approx(share) and bool(layout.sm_note) == (share == 0.0)
        all_to_alls = alone.communication_s - layout._per_step(lambda _: layout.costs.all_gather * layout.costs.all_gathers
                                                                + layout.costs.reduce_scatter)
        assert layout.exposed_s == pytest.approx(alone.exposed_s - (1 - share) * all_to_alls, rel=1e-9)
