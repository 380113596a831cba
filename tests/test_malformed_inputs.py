"""Every file and flag the harness reads, malformed: one line naming it and the fix, exit 2, no traceback.

The corpus covers each format the tools read (placement files, routing-statistics dumps, topologies, the placement
record in a checkpoint) and each command line (the launcher's pre-flight, plan, placement, routing_report,
supervise), through the tool a user runs, in this process; the job configs' own table is config validation's
(tests/config/test_config_validation.py), with one case here. Every case states the text its one line must hold,
and the line is all the tool writes to stderr.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO_ROOT

DEBUG = ["--job.config_file", str(REPO_ROOT / "train_configs/debug_model.toml")]
MOE_LAYERS, EXPERTS, TOP_K = [1, 2, 3, 4, 5], 8, 3
GOOD_PLACEMENT = {"num_experts": 8, "expert_parallel_degree": 2,
                  "layers": {str(layer): list(range(8)) for layer in MOE_LAYERS}}


def _dump_arrays(steps=(1, 2), layers=MOE_LAYERS, experts=EXPERTS, top_k=TOP_K, samples=4) -> dict:
    generator = np.random.default_rng(0)
    return {
        "steps": np.array(steps, dtype=np.int64),
        "layers": np.array(layers, dtype=np.int64),
        "tokens_per_expert": generator.integers(1, 50, (len(steps), len(layers), experts)),
        "coactivation": generator.integers(0, 20, (len(layers), experts, experts)),
        "transitions": generator.integers(0, 20, (len(layers), experts, experts)),
        "top_k": np.array(top_k, dtype=np.int64),
        "sampled_expert_ids": generator.integers(0, experts, (len(steps), len(layers), samples, top_k)).astype(np.int16),
    }


def _write_dump(folder: Path, **changes) -> Path:
    """A routing-statistics folder with one file, ``changes`` applied (None removes an array)."""
    arrays = _dump_arrays()
    for key, value in changes.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "routing_step000001-000002.npz", **arrays)
    return folder


# ---- how each tool is run -------------------------------------------------------------------------


def _preflight(args):
    from torchtitan_ext.launch import preflight

    return preflight.main(["--ngpu", "2", "--", *args])


def _preflight_flags(args):
    from torchtitan_ext.launch import preflight

    return preflight.main(args)


def _plan(args):
    from torchtitan_ext import plan

    return plan.main(args)


def _bench(args):
    from torchtitan_ext.bench.__main__ import main

    sys.exit(main(args))  # as python -m torchtitan_ext.bench ends


def _placement(args):
    from torchtitan_ext import placement

    return placement.main(args)


def _routing_report(args):
    from torchtitan_ext import routing_report

    return routing_report.main(args)


def _supervise(args):
    from torchtitan_ext import supervise

    sys.exit(supervise.main(args))  # as python -m torchtitan_ext.supervise ends


# ---- the corpus: (id, tool, argv builder taking tmp_path, text the line holds) ------------------------

CASES = []


def case(name, tool, argv, expected):
    CASES.append(pytest.param(tool, argv, expected, id=name))


def _file(name: str, content) -> callable:
    def write(tmp_path: Path) -> str:
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    return write


# job configs: their table is tests/config/test_config_validation.py's (config validation owns them); one here
# shows the launcher's pre-flight ending on the validation's one line
case("config_cli_unknown_key", _preflight, lambda tmp: [*DEBUG, "--training.stepz", "3"],
     "unknown config key 'training.stepz' in the command line: did you mean 'steps'?")
case("ngpu_beyond_the_machine", _preflight_flags,
     lambda tmp: ["--ngpu", "999", "--", *DEBUG], "NGPU=999 but this machine")
case("ngpu_not_a_number", _preflight_flags,
     lambda tmp: ["--ngpu", "two", "--", *DEBUG], "NGPU='two' is not an integer")
case("ngpu_zero", _preflight_flags,
     lambda tmp: ["--ngpu", "0", "--", *DEBUG], "NGPU=0: set NGPU to at least 1")
case("master_port_not_a_port", _preflight_flags,
     lambda tmp: ["--ngpu", "2", "--port", "99999", "--", *DEBUG], "MASTER_PORT='99999' is not a port number")

# placement files, through the pre-flight of a job that trains with one
for name, content, expected in [
    ("null", "null", "holds a JSON NoneType, not an object"),
    ("number", "5", "holds a JSON int, not an object"),
    ("string", '"placement"', "holds a JSON str, not an object"),
    ("list", "[1, 2]", "holds a JSON list, not an object"),
    ("empty_object", "{}", "lacks num_experts, expert_parallel_degree, layers"),
    ("no_layers", json.dumps({"num_experts": 8, "expert_parallel_degree": 2}), "lacks layers"),
    ("layers_list", json.dumps({**GOOD_PLACEMENT, "layers": [list(range(8))] * 5}), "layers must be an object"),
    ("layers_empty", json.dumps({**GOOD_PLACEMENT, "layers": {}}), "layers must be an object"),
    ("experts_text", json.dumps({**GOOD_PLACEMENT, "num_experts": "8"}), "num_experts = '8' and expert_parallel_degree = 2 must be positive"),
    ("experts_zero", json.dumps({**GOOD_PLACEMENT, "num_experts": 0}), "num_experts = 0"),
    ("experts_bool", json.dumps({**GOOD_PLACEMENT, "num_experts": True}), "num_experts = True"),
    ("ep_not_dividing", json.dumps({**GOOD_PLACEMENT, "expert_parallel_degree": 3}), "the second dividing the first"),
    ("layer_id_text", json.dumps({**GOOD_PLACEMENT, "layers": {"one": list(range(8))}}), "layer id 'one' is not a model layer number"),
    ("slots_number", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "1": 5}}), "layer 1 is not a permutation of the experts 0..7 (int, not a list)"),
    ("slots_floats", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "1": [float(s) for s in range(8)]}}), "(0.0 is not an expert id)"),
    ("slot_out_of_range", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "2": [*range(7), 8]}}), "(8 is not an expert id)"),
    ("slot_negative", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "2": [-1, *range(1, 8)]}}), "(-1 is not an expert id)"),
    ("slot_twice", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "3": [0, 0, *range(2, 8)]}}), "(expert 0 appears twice)"),
    ("too_few_slots", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "4": list(range(4))}}), "(4 slots for 8 experts)"),
    ("slots_bool", json.dumps({**GOOD_PLACEMENT, "layers": {**GOOD_PLACEMENT["layers"], "5": [True, *range(1, 8)]}}), "(True is not an expert id)"),
    ("truncated", json.dumps(GOOD_PLACEMENT)[:40], "is not a JSON placement file (JSONDecodeError"),
    ("empty_file", "", "is not a JSON placement file (JSONDecodeError"),
    ("non_utf8", b"\xff\xfe{}", "is not a JSON placement file (UnicodeDecodeError"),
    ("other_ep", json.dumps({**GOOD_PLACEMENT, "expert_parallel_degree": 4}), "placement made for expert_parallel_degree = 4 but the job runs 2"),
    ("other_expert_count", json.dumps({"num_experts": 16, "expert_parallel_degree": 2,
                                       "layers": {str(layer): list(range(16)) for layer in MOE_LAYERS}}),
     "placement for 16 experts but the model has 8"),
    ("other_layers", json.dumps({**GOOD_PLACEMENT, "layers": {"1": list(range(8))}}), "placement layers [1] are not the model's MoE layers [1, 2, 3, 4, 5]"),
]:
    case(f"placement_file_{name}", _preflight,
         lambda tmp, name=name, content=content: [*DEBUG, "--expert_placement.file", _file(f"{name}.json", content)(tmp)], expected)
case("placement_file_missing", _preflight, lambda tmp: [*DEBUG, "--expert_placement.file", str(tmp / "none.json")],
     "does not exist: make one with python -m torchtitan_ext.placement")
case("placement_file_is_a_folder", _preflight, lambda tmp: [*DEBUG, "--expert_placement.file", str(tmp)],
     "is not a JSON placement file (IsADirectoryError")
case("placement_without_ep", _preflight, lambda tmp: [*DEBUG, "--parallelism.expert_parallel_degree", "1",
                                                       "--expert_placement.file", _file("p.json", json.dumps(GOOD_PLACEMENT))(tmp)],
     "a placement needs expert parallelism")


def _npz_file(tmp: Path, content: bytes) -> str:
    folder = tmp / "dump"
    folder.mkdir()
    (folder / "routing_step000001-000002.npz").write_bytes(content)
    return str(folder)


def _good_npz_bytes(tmp: Path) -> bytes:
    return (Path(_write_dump(tmp / "good")) / "routing_step000001-000002.npz").read_bytes()


# routing-statistics dumps, through the routing report (and a few through plan and placement)
for name, build, expected in [
    ("empty_file", lambda tmp: _npz_file(tmp, b""), "cannot be read ("),
    ("truncated", lambda tmp: _npz_file(tmp, _good_npz_bytes(tmp)[:300]), "cannot be read ("),
    ("random_bytes", lambda tmp: _npz_file(tmp, bytes(range(256)) * 4), "cannot be read ("),
    ("single_array", lambda tmp: (np.save(tmp / "one.npy", np.zeros(3)), _npz_file(tmp, (tmp / "one.npy").read_bytes()))[1],
     "a single array, not an .npz archive"),
    ("no_steps", lambda tmp: str(_write_dump(tmp / "d", steps=None)), "has no 'steps' array"),
    ("no_counts", lambda tmp: str(_write_dump(tmp / "d", tokens_per_expert=None)), "has no 'tokens_per_expert' array"),
    ("no_top_k", lambda tmp: str(_write_dump(tmp / "d", top_k=None)), "has no 'top_k' array"),
    ("float_counts", lambda tmp: str(_write_dump(tmp / "d", tokens_per_expert=np.ones((2, 5, 8)))),
     "'tokens_per_expert' is float64 with 3 dimensions, expected integers with 3"),
    ("counts_2d", lambda tmp: str(_write_dump(tmp / "d", tokens_per_expert=np.ones((2, 40), dtype=np.int64))),
     "'tokens_per_expert' is int64 with 2 dimensions"),
    ("negative_counts", lambda tmp: str(_write_dump(tmp / "d", coactivation=-np.ones((5, 8, 8), dtype=np.int64))),
     "'coactivation' has negative counts"),
    ("all_zero", lambda tmp: str(_write_dump(tmp / "d", tokens_per_expert=np.zeros((2, 5, 8), dtype=np.int64))),
     "every count is 0"),
    ("steps_unordered", lambda tmp: str(_write_dump(tmp / "d", steps=np.array([2, 1]))), "steps [2, 1] are not increasing"),
    ("step_zero", lambda tmp: str(_write_dump(tmp / "d", steps=np.array([0, 1]))), "steps [0, 1] are not increasing training steps >= 1"),
    ("top_k_zero", lambda tmp: str(_write_dump(tmp / "d", top_k=np.array(0), sampled_expert_ids=None)), "top_k 0"),
    ("top_k_over_experts", lambda tmp: str(_write_dump(tmp / "d", top_k=np.array(9), sampled_expert_ids=None)), "top_k 9"),
    ("coactivation_shape", lambda tmp: str(_write_dump(tmp / "d", coactivation=np.ones((5, 8, 7), dtype=np.int64))),
     "'coactivation' has shape (5, 8, 7), expected (5, 8, 8)"),
    ("transitions_shape", lambda tmp: str(_write_dump(tmp / "d", transitions=np.ones((4, 8, 8), dtype=np.int64))),
     "'transitions' has shape (4, 8, 8), expected (5, 8, 8)"),
    ("steps_counts_mismatch", lambda tmp: str(_write_dump(tmp / "d", steps=np.array([1, 2, 3]))),
     "'tokens_per_expert' has shape (2, 5, 8), expected (3, 5, 8)"),
    ("sample_out_of_range", lambda tmp: str(_write_dump(tmp / "d", sampled_expert_ids=np.full((2, 5, 4, 3), 8, dtype=np.int16))),
     "'sampled_expert_ids' holds ids outside -1 .. 7"),
    ("sample_shape", lambda tmp: str(_write_dump(tmp / "d", sampled_expert_ids=np.zeros((2, 5, 4), dtype=np.int16))),
     "'sampled_expert_ids' has 3 dimensions, expected 4"),
    ("object_array", lambda tmp: str(_write_dump(tmp / "d", layers=np.array([{"a": 1}], dtype=object))), "cannot be read (ValueError"),
    ("missing_folder", lambda tmp: str(tmp / "nothing"), "do not exist: pass <dump_folder>/routing_stats"),
    ("empty_folder", lambda tmp: (tmp / "empty").mkdir() or str(tmp / "empty"), "no routing_step*.npz files in"),
]:
    case(f"routing_stats_{name}", _routing_report, lambda tmp, build=build: [build(tmp)], expected)


def _two_files(tmp: Path, second: dict) -> str:
    folder = _write_dump(tmp / "d")
    np.savez(folder / "routing_step000002-000003.npz", **{**_dump_arrays(), **second})
    return str(folder)


case("routing_stats_overlapping_files", _routing_report,
     lambda tmp: [_two_files(tmp, {"steps": np.array([2, 3])})], "overlap: two runs recorded into one folder")
case("routing_stats_files_of_two_models", _routing_report,
     lambda tmp: [_two_files(tmp, {"steps": np.array([3, 4]), "layers": np.array([1, 2, 3, 4, 6])})],
     "record different layers, experts or top_k")
case("routing_stats_not_a_moe_layer", _routing_report, lambda tmp: [str(_write_dump(tmp / "d")), "--layer", "9"],
     "--layer 9 is not a MoE layer of")
case("routing_stats_other_model_in_plan", _plan,
     lambda tmp: ["--world-size", "2", "--routing-stats", str(_write_dump(tmp / "d", **_dump_arrays(experts=16))), *DEBUG],
     "records 16 experts on layers [1, 2, 3, 4, 5], but the job's model has 8")
case("routing_stats_damaged_in_plan", _plan, lambda tmp: ["--world-size", "2", "--routing-stats",
                                                            _npz_file(tmp, b"PK\x03\x04"), *DEBUG], "cannot be read (")
case("routing_stats_damaged_in_placement", _placement,
     lambda tmp: ["--routing-stats", _npz_file(tmp, b"PK\x03\x04"), "--world-size", "2", *DEBUG], "cannot be read (")
case("routing_stats_other_model_in_placement", _placement,
     lambda tmp: ["--routing-stats", str(_write_dump(tmp / "d", **_dump_arrays(experts=16))), "--world-size", "2", *DEBUG],
     "records 16 experts on layers [1, 2, 3, 4, 5], but the job's model has 8")

# topologies, through the planner's layout advice
LEVEL = '[[levels]]\nname = "node"\nworkers = 2\nbandwidth_GBps = 10.0\nlatency_us = 1.0\n'
OUTER = '[[levels]]\nname = "net"\nbandwidth_GBps = 1.0\nlatency_us = 5.0\n'
TOPOLOGY = f'name = "t"\ncompute_tflops = 1.0\noverlap = false\n{LEVEL}{OUTER}'
for name, content, expected in [
    ("levels_numbers", 'compute_tflops = 1.0\noverlap = false\nlevels = [1, 2]\n', "t.levels[0] = 1: each level is a [[levels]] table"),
    ("non_utf8", TOPOLOGY.encode() + b"# \xff\n", "not a valid UTF-8 TOML file (UnicodeDecodeError"),
    ("invalid_toml", TOPOLOGY + "[[levels]\n", "not a valid UTF-8 TOML file (TOMLDecodeError"),
    ("nan_bandwidth", TOPOLOGY.replace("bandwidth_GBps = 10.0", "bandwidth_GBps = nan"), "t.levels[0].bandwidth_GBps = nan: use a finite number"),
    ("inf_bandwidth", TOPOLOGY.replace("bandwidth_GBps = 10.0", "bandwidth_GBps = inf"), "t.levels[0].bandwidth_GBps = inf: use a finite number"),
    ("zero_bandwidth", TOPOLOGY.replace("bandwidth_GBps = 10.0", "bandwidth_GBps = 0.0"), "t.levels[0].bandwidth_GBps = 0.0: use a bandwidth > 0"),
    ("negative_bandwidth", TOPOLOGY.replace("bandwidth_GBps = 1.0", "bandwidth_GBps = -1.0"), "t.levels[1].bandwidth_GBps = -1.0"),
    ("nan_compute", TOPOLOGY.replace("compute_tflops = 1.0", "compute_tflops = nan"), "t.compute_tflops = nan: use a finite number"),
    ("zero_compute", TOPOLOGY.replace("compute_tflops = 1.0", "compute_tflops = 0.0"), "t.compute_tflops = 0.0: use a throughput > 0"),
    ("no_compute", TOPOLOGY.replace("compute_tflops = 1.0\n", ""), "t.compute_tflops is missing"),
    ("overlap_text", TOPOLOGY.replace("overlap = false", 'overlap = "no"'), "t.overlap = 'no': expected a bool"),
    ("no_levels", 'compute_tflops = 1.0\noverlap = false\n', "t.levels is missing or empty"),
    ("workers_zero", TOPOLOGY.replace("workers = 2", "workers = 0"), "t.levels[0].workers = 0: use a count >= 1"),
    ("workers_text", TOPOLOGY.replace("workers = 2", 'workers = "2"'), "t.levels[0].workers = '2': expected a int"),
    ("workers_bool", TOPOLOGY.replace("workers = 2", "workers = true"), "t.levels[0].workers = True: expected a int"),
    ("inner_without_workers", TOPOLOGY.replace("workers = 2\n", ""), "t.levels[0].workers is missing: only the outermost level may omit it"),
    ("negative_latency", TOPOLOGY.replace("latency_us = 1.0", "latency_us = -1.0"), "t.levels[0].latency_us = -1.0: use a latency >= 0"),
    ("nan_latency", TOPOLOGY.replace("latency_us = 1.0", "latency_us = nan"), "t.levels[0].latency_us = nan: use a finite number"),
    ("level_key_typo", TOPOLOGY.replace("latency_us = 1.0\n", "latency_us = 1.0\nall_gather_bandwith_GBps = 5.0\n"),
     "t.levels[0].all_gather_bandwith_GBps is not a topology key: did you mean 'all_gather_bandwidth_GBps'?"),
    ("top_key_typo", TOPOLOGY.replace("overlap = false", "overlap = false\ncompute_tflop = 2.0"),
     "t.compute_tflop is not a topology key: did you mean 'compute_tflops'?"),
    ("name_table", TOPOLOGY.replace('name = "t"\n', "") + "[name]\nx = 1\n", "t.name = {'x': 1}: expected a str"),
    ("outer_smaller", TOPOLOGY.replace(OUTER, OUTER.replace('name = "net"\n', 'name = "net"\nworkers = 1\n') + OUTER),
     "t.levels[1].workers = 1: an outer level holds fewer workers"),
    ("workers_not_dividing", TOPOLOGY.replace("workers = 2", "workers = 3"),
     "level 'node' has workers = 3, which does not divide the world size 4"),
]:
    case(f"topology_{name}", _plan,
         lambda tmp, content=content: ["--topology", _file("t.toml", content)(tmp), "--world-size", "4", *DEBUG,
                                       "--parallelism.expert_parallel_degree", "2"], expected)
case("topology_missing", _plan, lambda tmp: ["--topology", "no_such_topology", "--world-size", "2", *DEBUG],
     "--topology no_such_topology: no such file, and not a shipped topology")

# command-line flags of the tools
for name, tool, args, expected in [
    ("plan_world_size_zero", _plan, ["--world-size", "0", *DEBUG], "world size 0: set NGPU (or --world-size) to a rank count >= 1"),
    ("plan_world_size_negative", _plan, ["--world-size", "-2", *DEBUG], "world size -2: set NGPU (or --world-size)"),
    ("plan_measure_without_topology", _plan, ["--world-size", "2", "--measure-compute", *DEBUG],
     "--measure-compute sets the layout advice's compute: add --topology"),
    ("plan_fit_from_without_topology", _plan, ["--world-size", "2", "--fit-from", "docs/advisor_fit.toml", *DEBUG],
     "--fit-from prices the layout advice under fitted parameters: add --topology"),
    ("plan_calibrate_from_without_topology", _plan, ["--world-size", "2", "--calibrate-from", "x.json", *DEBUG],
     "--calibrate-from prices the layout advice's layouts: add --topology"),
    ("plan_ranks_per_group_without_topology", _plan, ["--world-size", "2", "--ranks-per-group", "8", *DEBUG],
     "--ranks-per-group places ranks in the topology's groups: add --topology"),
    ("plan_emit_config_without_topology", _plan, ["--world-size", "2", "--emit-config", "x.toml", *DEBUG],
     "--emit-config writes from the layout advice: add --topology"),
    ("plan_emit_config_another_models_tokenizer", _plan,
     ["--hf-config", str(REPO_ROOT / "docs/hf_configs/qwen3-30b-a3b.json"), "--job.config_file",
      str(REPO_ROOT / "train_configs/gpt_oss_120b_gb200.toml"), "--world-size", "64", "--topology", "gb200_nvl72",
      "--emit-config", "x.toml"],
     "--emit-config x.toml: the job config's tokenizer, model.hf_assets_path = './assets/hf/gpt-oss-120b', is that of "
     "gpt_oss flavour '120b' (201,088 tokens), not the --hf-config model's (151,936)"),
    ("plan_error_from_without_topology", _plan, ["--world-size", "2", "--error-from", "e.toml", *DEBUG],
     "--error-from sets the layout advice's decision: add --topology"),
    ("plan_error_output_without_validate", _plan, ["--fit", "--error-output", "e.toml"],
     "--error-output writes the error --validate measures: add --validate"),
    ("plan_error_from_missing", _plan, ["--world-size", "2", "--topology", "hgx_h100_ib", "--error-from", "no.toml", *DEBUG],
     "no.toml: cannot read the advisor's error"),
    ("bench_campaign_misnamed", _bench, ["ep", "--campaign", "ep.jsonl"], "--campaign ep.jsonl: name it THEME_HARDWARE_DATE.jsonl"),
    ("bench_campaign_no_folder", _bench, ["step", "--campaign", "benchmark/step_cpu_2026-11-29.jsonl"],
     "benchmark is not a folder you can write: create it or give another"),
    ("plan_validate_and_fit", _plan, ["--validate", "--fit"],
     "--validate and --fit: run --fit first (it writes the parameters), then --validate"),
    ("plan_paper_missing_flags", _plan, ["--paper", "--topology", "cross_dc"], "--paper needs --world-size, --paper-data-mb"),
    ("plan_paper_nan", _plan, ["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "nan",
                               "--paper-expert-mb", "1", "--paper-pre-expert-ms", "1"], "--paper-data-mb nan: use a finite value > 0"),
    ("plan_paper_negative_time", _plan, ["--paper", "--topology", "cross_dc", "--world-size", "8", "--paper-data-mb", "1",
                                         "--paper-expert-mb", "1", "--paper-pre-expert-ms", "-1"],
     "--paper-pre-expert-ms -1.0: use a finite time >= 0"),
    ("plan_calibrate_one_process", _plan, ["--calibrate", "--nproc", "1"], "--nproc 1: an all-to-all needs at least 2 processes"),
    ("plan_dense_shard_open", _plan, [*DEBUG, "--parallelism.data_parallel_shard_degree", "-1"],
     "the world size is open (parallelism.data_parallel_shard_degree = -1): set NGPU=N (the python -m tools also take --world-size N)"),
    ("placement_holdout_over_one", _placement, ["--routing-stats", "x", "--holdout", "2", *DEBUG], "--holdout 2.0: use a fraction between 0 and 1"),
    ("placement_holdout_nan", _placement, ["--routing-stats", "x", "--holdout", "nan", *DEBUG], "--holdout nan"),
    ("placement_tolerance_nan", _placement, ["--routing-stats", "x", "--load-tolerance", "nan", *DEBUG],
     "--load-tolerance nan: use a finite fraction >= 0"),
    ("placement_tolerance_negative", _placement, ["--routing-stats", "x", "--load-tolerance", "-1", *DEBUG],
     "--load-tolerance -1.0: use a finite fraction >= 0"),
    ("placement_first_step_zero", _placement, ["--routing-stats", "x", "--first-step", "0", *DEBUG], "--first-step 0: use a training step >= 1"),
    ("placement_domain_zero", _placement, ["--routing-stats", "x", "--ranks-per-domain", "0", *DEBUG],
     "--ranks-per-domain 0: use a rank count >= 1"),
    ("placement_world_zero", _placement, ["--routing-stats", "x", "--world-size", "0", *DEBUG], "world size 0: set NGPU (or --world-size)"),
    ("supervise_no_command", _supervise, [], "no command to supervise"),
]:
    case(f"flag_{name}", tool, lambda tmp, args=args: list(args), expected)


def _checkpoint(tmp: Path, layers, expert_at_slot) -> list[str]:
    """A job folder whose latest checkpoint records ``expert_at_slot`` for ``layers``."""
    import torch.distributed.checkpoint as dcp

    folder = tmp / "job" / "checkpoint" / "step-2"
    dcp.save({"expert_placement": {"layers": torch.tensor(layers), "expert_at_slot": torch.tensor(expert_at_slot)}},
             checkpoint_id=str(folder), no_dist=True)
    return [*DEBUG, "--checkpoint.enable", "--job.dump_folder", str(tmp / "job")]


IDENTITY = [list(range(8))] * 5
for name, build, expected in [
    ("record_not_a_permutation", lambda tmp: _checkpoint(tmp, MOE_LAYERS, [[0] * 8] + IDENTITY[1:]),
     "the expert placement record for MoE layer 1 is [0, 0, 0, 0, 0, 0, 0, 0], not a permutation"),
    ("record_other_layers", lambda tmp: _checkpoint(tmp, [1, 2, 3], IDENTITY[:3]),
     "the expert placement record covers MoE layers [1, 2, 3], this model's are [1, 2, 3, 4, 5]"),
    ("record_other_expert_count", lambda tmp: _checkpoint(tmp, MOE_LAYERS, [list(range(16))] * 5),
     "the expert placement record has shape (5, 16), not 5 layers x 8 experts"),
    ("record_metadata_damaged", lambda tmp: (_checkpoint(tmp, MOE_LAYERS, IDENTITY),
                                             (tmp / "job/checkpoint/step-2/.metadata").write_bytes(b"not a pickle"))[0],
     "its expert placement record cannot be read ("),
]:
    case(f"checkpoint_{name}", _preflight, build, expected)


@pytest.mark.parametrize("tool, argv, expected", CASES)
def test_a_malformed_input_is_one_line(tool, argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as exit_info:
        tool(argv(tmp_path))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err[-2000:]
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-2000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in captured.out
