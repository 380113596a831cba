"""Expert placement contract: the placement tool, its file, and moving expert state between slots.

- the tool balances rank loads, keeps co-activated experts on one rank, ends
  on skewed loads (where seed 002's replica loop does not), and is never worse
  than the identity on the steps it fits;
- a bad placement file is one line naming the problem, before anything runs;
- moving rows (weights and optimizer state) under EP, EP x expert FSDP
  (dim-0 and dim-1 shards) gives exactly the permuted tensors.
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from torchtitan_ext import placement as placement_cli
from torchtitan_ext.bench.placement import layer_model, layer_routing
from tests.helpers import REPO_ROOT, run_distributed
from torchtitan_ext.config import ConfigError
from torchtitan_ext.balancing.placement import load_placement, Placement
from torchtitan_ext.balancing.placement_search import (
    balance_loads,
    format_results,
    from_step,
    group_by_affinity,
    LayerResult,
    measure,
    Measures,
    place,
    ranks_from_slots,
    slots_from_ranks,
    what_to_do,
)

DEBUG_CONFIG = str(REPO_ROOT / "train_configs/debug_model.toml")
DEBUG_MOE_LAYERS = [1, 2, 3, 4, 5]


def routing_steps(seed: int, steps: int, layers: int, experts: int, top_k: int, tokens: int, skew: float, group: int):
    """[step][layer] routing arrays: each layer's popularity and co-activated groups fixed over the steps."""
    rng = np.random.default_rng(seed)
    models = [layer_model(rng, experts, group, skew) for _ in range(layers)]
    return [[layer_routing(rng, tokens, top_k, *model) for model in models] for _ in range(steps)]


def dump_from(routing_per_step: list[list[np.ndarray]], files: int, experts: int) -> dict:
    """A loaded dump (the keys :func:`placement.place` reads) from [step][layer] routing arrays."""
    steps, layers = len(routing_per_step), len(routing_per_step[0])
    counts = np.array([[np.bincount(ids.ravel(), minlength=experts) for ids in step] for step in routing_per_step])
    per_file = np.array_split(np.arange(steps), files)

    def coactivation(ids):
        picks = np.zeros((len(ids), experts))
        np.put_along_axis(picks, ids, 1.0, axis=1)
        return (picks.T @ picks).astype(np.int64)

    return {
        "steps": np.arange(1, steps + 1),
        "layers": np.arange(1, layers + 1),
        "tokens_per_expert": counts,
        "top_k": np.array(routing_per_step[0][0].shape[1]),
        "file_steps": np.array([len(f) for f in per_file]),
        "file_coactivation": np.stack([
            np.stack([sum(coactivation(routing_per_step[s][layer]) for s in f) for layer in range(layers)])
            for f in per_file
        ]),
        "sampled_expert_ids": np.array([[ids for ids in step] for step in routing_per_step]).astype(np.int16),
    }


def test_balancing_reaches_the_optimum_on_small_skewed_layers():
    """8 experts on 4 ranks: the largest rank load equals the brute-force optimum over all 2520 assignments."""
    from itertools import permutations

    rng = np.random.default_rng(0)
    for trial in range(8):
        loads = rng.zipf(1.6, size=8).astype(float)
        got = np.bincount(balance_loads(loads, 4), weights=loads, minlength=4)
        assert sorted(np.bincount(balance_loads(loads, 4), minlength=4)) == [2, 2, 2, 2]
        best = min(
            max(loads[list(order[2 * r:2 * r + 2])].sum() for r in range(4))
            for order in permutations(range(8)) if all(order[2 * r] < order[2 * r + 1] for r in range(4))
        )
        assert got.max() == pytest.approx(best), (trial, loads, got)


def test_balancing_ends_on_the_loads_that_hang_seed_002s_replica_loop():
    """[100, 1, 1, 1] (and a zero-load expert): seed 002's loop 1 never ends there; this returns a split."""
    for loads, best in (([100.0, 1, 1, 1], 101.0), ([100.0, 0, 0, 0], 100.0), ([0.0, 0, 0, 0], 0.0)):
        rank_of = balance_loads(np.array(loads), 2)
        assert sorted(np.bincount(rank_of, minlength=2)) == [2, 2]
        assert np.bincount(rank_of, weights=loads, minlength=2).max() == best


def test_co_activated_experts_end_on_one_rank():
    """Four pairs, each always picked together (top-2), equal loads: every pair shares a rank, so each
    token goes to one rank instead of two."""
    pairs = [(0, 5), (1, 6), (2, 7), (3, 4)]
    routing = np.array([pairs[t % 4] for t in range(400)])
    coactivation = np.zeros((8, 8), dtype=np.int64)
    for a, b in pairs:
        coactivation[a, b] = coactivation[b, a] = 100
    loads = np.full(8, 100.0)
    identity = np.arange(8) // 2
    grouped = group_by_affinity(identity, loads, coactivation, ranks_per_domain=4, load_cap=200.0, max_rounds=32)
    for a, b in pairs:
        assert grouped[a] == grouped[b]
    counts = np.bincount(routing.ravel(), minlength=8)[None, :]
    assert measure(identity, counts, routing, 4).distinct_ranks == 2.0
    assert measure(grouped, counts, routing, 4).distinct_ranks == 1.0


def test_domains_gather_what_ranks_cannot():
    """16 experts, 8 ranks in 2 domains, groups of 4 co-activated experts (a rank holds 2): each group
    fits one domain, so its tokens stay inside one domain."""
    groups = [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    coactivation = np.zeros((16, 16), dtype=np.int64)
    for group in groups:
        for a in group:
            for b in group:
                if a != b:
                    coactivation[a, b] = 50
    grouped = group_by_affinity(np.arange(16) // 2, np.full(16, 10.0), coactivation, 4, 20.0, 64)
    for group in groups:
        assert len({grouped[e] // 4 for e in group}) == 1, grouped


def test_grouping_ends_where_no_swap_raises_the_score():
    """Brute force over every swap of the result (random affinities, 16 experts, 4 ranks in 2 domains):
    none that keeps every rank under the cap raises the score (co-activated pairs sharing a rank plus
    pairs sharing a domain) that the search's gain arithmetic tracks; the score rose from the start."""
    rng = np.random.default_rng(3)
    experts, ranks, per_domain = 16, 4, 2

    for _ in range(5):
        upper = np.triu(rng.poisson(3.0, (experts, experts)), 1)
        coactivation = upper + upper.T
        loads = rng.integers(1, 20, experts).astype(np.float64)
        start = balance_loads(loads, ranks)
        cap = np.bincount(start, weights=loads, minlength=ranks).max() * 1.1

        def score(rank_of):
            domain_of = rank_of // per_domain
            together = (rank_of[:, None] == rank_of[None, :]).astype(int) + (domain_of[:, None] == domain_of[None, :])
            return int((upper * together).sum())

        def fits(rank_of):
            return np.bincount(rank_of, weights=loads, minlength=ranks).max() <= cap

        result = group_by_affinity(start, loads, coactivation, per_domain, cap, max_rounds=10_000)
        assert np.bincount(result, minlength=ranks).tolist() == [experts // ranks] * ranks and fits(result)
        assert score(result) > score(start)
        for a in range(experts):
            for b in range(a + 1, experts):
                swapped = result.copy()
                swapped[a], swapped[b] = result[b], result[a]
                if fits(swapped):
                    assert score(swapped) <= score(result), (a, b)


def test_never_worse_than_the_identity_on_the_fit_steps():
    for seed in range(6):
        routing = routing_steps(seed, steps=6, layers=2, experts=16, top_k=3, tokens=300, skew=1.2, group=4)
        for result in place(dump_from(routing, 3, 16), 4, 2, 0.34, 0.02, progress=False):
            before, after = result.fit_before, result.fit_after
            assert after.load_max_over_mean <= before.load_max_over_mean + 1e-12
            # more distinct ranks only in exchange for a load lower beyond the tolerance
            if after.distinct_ranks > before.distinct_ranks:
                assert after.load_max_over_mean * 1.02 < before.load_max_over_mean
            assert sorted(result.slots) == list(range(16))


def test_skewed_clustered_routing_improves_on_held_out_steps():
    """Zipf-skewed, clustered routing that persists over time: held-out steps improve in both measures."""
    routing = routing_steps(7, steps=8, layers=2, experts=32, top_k=4, tokens=2000, skew=1.1, group=4)
    for result in place(dump_from(routing, 4, 32), 8, 4, 0.5, 0.02, progress=False):
        assert result.held_out_after.load_max_over_mean < result.held_out_before.load_max_over_mean - 0.1
        assert result.held_out_after.distinct_ranks < result.held_out_before.distinct_ranks - 0.2


def test_report_warns_of_layers_whose_held_out_load_got_worse():
    """Routing that moves between the fit and held-out steps: the report names the layers it hurt."""
    good, bad = Measures(1.2, 2.0, 1.0), Measures(2.5, 2.0, 1.0)
    results = [LayerResult(3, tuple(range(8)), bad, good, good, bad, False),
               LayerResult(4, tuple(range(8)), bad, good, bad, good, False)]
    lines = format_results(results, top_k=2, tokens_per_step=100, token_bytes=2)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "above the identity's on MoE layers [3]" in warnings[0]


def test_a_placement_that_changes_nothing_is_not_recommended():
    """Every layer kept the identity: the report says the file changes nothing and names replication."""
    kept = LayerResult(3, tuple(range(8)), *[Measures(1.5, 2.0, 1.0)] * 4, kept_identity=True)
    moved = replace(kept, slots=(1, 0, *range(2, 8)), kept_identity=False)
    assert what_to_do([kept, moved], "p.json") == "Wrote p.json: train with --expert_placement.file p.json"
    assert what_to_do([kept, kept], "p.json").startswith(
        "Wrote p.json, the identity in every MoE layer: training with it changes nothing.")
    assert "--expert_replication.slots_per_rank" in what_to_do([kept], "p.json")


def test_first_step_leaves_out_earlier_files():
    routing = routing_steps(5, steps=6, layers=1, experts=8, top_k=2, tokens=16, skew=1.0, group=2)
    dump = dump_from(routing, 3, 8)
    later = from_step(dump, 3)
    assert later["steps"].tolist() == [3, 4, 5, 6] and later["file_steps"].tolist() == [2, 2]
    assert np.array_equal(later["tokens_per_expert"], dump["tokens_per_expert"][2:])
    assert np.array_equal(later["file_coactivation"], dump["file_coactivation"][1:])
    assert np.array_equal(later["sampled_expert_ids"], dump["sampled_expert_ids"][2:])


def test_slots_and_ranks_round_trip():
    rank_of = np.array([1, 0, 1, 0, 3, 2, 2, 3])
    slots = slots_from_ranks(rank_of)
    assert slots == (1, 3, 0, 2, 5, 6, 4, 7)
    assert list(ranks_from_slots(slots, 4)) == list(rank_of)


def _write(tmp_path, data) -> str:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


GOOD = {"num_experts": 8, "expert_parallel_degree": 2, "layers": {str(layer): [7, 6, 5, 4, 3, 2, 1, 0] for layer in DEBUG_MOE_LAYERS}}


@pytest.mark.parametrize("change, message", [
    ({"layers": {**GOOD["layers"], "3": [0, 1, 2, 3, 4, 5, 6, 6]}}, "layer 3 is not a permutation of the experts 0..7 (expert 6 appears twice)"),
    ({"layers": {**GOOD["layers"], "3": [0, 1, 2]}}, "layer 3 is not a permutation of the experts 0..7 (3 slots for 8 experts)"),
    ({"num_experts": 4, "layers": {str(layer): [0, 1, 2, 3] for layer in DEBUG_MOE_LAYERS}}, "placement for 4 experts but the model has 8"),
    ({"layers": {str(layer): list(range(8)) for layer in (1, 2, 3)}}, "placement layers [1, 2, 3] are not the model's MoE layers [1, 2, 3, 4, 5]"),
    ({"expert_parallel_degree": 4}, "placement made for expert_parallel_degree = 4 but the job runs 2"),
    ({"layers": {**GOOD["layers"], "x": list(range(8))}}, "layer id 'x' is not a model layer number"),
    ({"expert_parallel_degree": 3}, "num_experts = 8 and expert_parallel_degree = 3 must be positive integers"),
])
def test_bad_placement_file_is_one_line_naming_the_problem(tmp_path, change, message):
    from torchtitan_ext.config import load_job_config

    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(ConfigError) as error:
        load_job_config(["--job.config_file", DEBUG_CONFIG, "--expert_placement.file", path], "cpu", 2)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"expert_placement.file = '{path}'")


def test_placement_needs_expert_parallelism_and_an_existing_json_file(tmp_path):
    from torchtitan_ext.config import load_job_config

    base = ["--job.config_file", DEBUG_CONFIG]
    with pytest.raises(ConfigError, match="a placement needs expert parallelism"):
        load_job_config([*base, "--expert_placement.file", _write(tmp_path, GOOD),
                         "--parallelism.expert_parallel_degree", "1"], "cpu", 2)
    with pytest.raises(ConfigError, match="does not exist: make one with python -m torchtitan_ext.placement"):
        load_job_config([*base, "--expert_placement.file", str(tmp_path / "missing.json")], "cpu", 2)
    with pytest.raises(ConfigError, match="is not a JSON placement file"):
        load_job_config([*base, "--expert_placement.file", _write(tmp_path, "{nope")], "cpu", 2)
    good = load_placement(_write(tmp_path, GOOD))
    assert good == Placement(8, 2, {layer: (7, 6, 5, 4, 3, 2, 1, 0) for layer in DEBUG_MOE_LAYERS})
    assert json.loads(good.to_json()) == GOOD


def test_launcher_rejects_a_bad_placement_before_starting_processes(tmp_path, capsys):
    from torchtitan_ext.launch import preflight

    path = _write(tmp_path, {**GOOD, "expert_parallel_degree": 4})
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(["--ngpu", "2", "--", "--job.config_file", DEBUG_CONFIG, "--expert_placement.file", path])
    assert exit_info.value.code == 2
    # the meta-device model build that reads the MoE layer ids prints torchtitan's grouped-mm notice
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [
        f"error: expert_placement.file = '{path}': placement made for expert_parallel_degree = 4 but the job runs 2: "
        "make it for this EP degree (python -m torchtitan_ext.placement)"
    ]


def _save_dump(folder, dump: dict) -> None:
    folder.mkdir()
    first = 0
    for index, steps in enumerate(dump["file_steps"]):
        window = slice(first, first + steps)
        np.savez(
            folder / f"routing_step{first + steps:06d}.npz",
            steps=dump["steps"][window], layers=dump["layers"], tokens_per_expert=dump["tokens_per_expert"][window],
            coactivation=dump["file_coactivation"][index], transitions=np.zeros_like(dump["file_coactivation"][index]),
            top_k=dump["top_k"], sampled_expert_ids=dump["sampled_expert_ids"][window],
        )
        first += steps


def test_placement_tool_writes_a_file_training_accepts(tmp_path, capsys):
    """The CLI on a dump of the debug model's shape (5 MoE layers, 8 experts, top-3) at EP=4."""
    routing = routing_steps(3, steps=6, layers=5, experts=8, top_k=3, tokens=256, skew=1.3, group=2)
    _save_dump(tmp_path / "dump", dump_from(routing, 2, 8))
    output = tmp_path / "placement.json"
    placement_cli.main(["--routing-stats", str(tmp_path / "dump"), "--job.config_file", DEBUG_CONFIG,
                        "--parallelism.expert_parallel_degree", "4", "--world-size", "4", "-o", str(output)])
    printed = capsys.readouterr()
    load_placement(str(output)).check_job(DEBUG_MOE_LAYERS, 8, 4, "test")
    assert "All 5 MoE layers, held-out steps: load max/mean" in printed.out
    assert f"train with --expert_placement.file {output}" in printed.out
    assert "placing layers" in printed.err  # the progress bar


def test_placement_tool_rejects_a_dump_of_another_model(tmp_path, capsys):
    routing = routing_steps(4, steps=4, layers=5, experts=16, top_k=3, tokens=64, skew=1.0, group=4)
    _save_dump(tmp_path / "dump", dump_from(routing, 2, 16))
    with pytest.raises(SystemExit) as exited:
        placement_cli.main(["--routing-stats", str(tmp_path / "dump"), "--job.config_file", DEBUG_CONFIG,
                            "--world-size", "2"])
    assert exited.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "records 16 experts" in error[0] and "has 8" in error[0], error


def _migration_worker(rank, world_size, layouts):
    return {layout: _migrate_one(layout) for layout in layouts}


def _migrate_one(layout):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor, Shard
    from torchtitan.models.moe.moe import GroupedExperts

    from torchtitan_ext.balancing.migration import move_rows

    experts, dim, hidden = 8, 4, 6
    torch.manual_seed(0)
    full = {name: torch.randn(shape) for name, shape in
            (("w1", (experts, hidden, dim)), ("w2", (experts, dim, hidden)), ("w3", (experts, hidden, dim)))}

    class Container(torch.nn.Module):
        pass

    model = Container()
    model.layers = torch.nn.ModuleDict({"1": Container()})
    model.layers["1"].moe = Container()
    module = GroupedExperts(dim, hidden, experts, use_grouped_mm=False)
    model.layers["1"].moe.experts = module
    if layout == "ep4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        for name, value in full.items():
            setattr(module, name, torch.nn.Parameter(distribute_tensor(value, mesh["ep"], [Shard(0)])))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        for name, value in full.items():
            setattr(module, name, torch.nn.Parameter(distribute_tensor(value, mesh["ep"], [Shard(0)])))
        dim_of_shard = 0 if layout == "ep2_efsdp2_dim0" else 1
        fully_shard(module, mesh=mesh["efsdp"], shard_placement_fn=lambda _: Shard(dim_of_shard))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    for parameter in module.parameters():
        # a gradient that differs per expert row: with a uniform one every row's exp_avg_sq is equal, and
        # a move that left the optimizer state behind would pass unseen
        parameter.grad = parameter.detach() * 3 + 1
    optimizer.step()

    class Optimizers:
        optimizers = [optimizer]

    before = {name: p.full_tensor().clone() for name, p in module.named_parameters()}
    moments = {name: optimizer.state[p]["exp_avg_sq"].full_tensor().clone() for name, p in module.named_parameters()}
    source = [5, 2, 7, 0, 1, 6, 3, 4]
    sent = move_rows([model], Optimizers(), {1: source})
    after = {name: p.full_tensor() for name, p in module.named_parameters()}
    moved = {name: optimizer.state[p]["exp_avg_sq"].full_tensor() for name, p in module.named_parameters()}
    assert all(not torch.equal(m[0], m[1]) for m in moments.values()), "the state must differ between experts"
    return {
        "weights": all(torch.equal(after[n], before[n][source]) for n in before),
        "state": all(torch.equal(moved[n], moments[n][source]) for n in moments),
        "changed": not all(torch.equal(after[n], before[n]) for n in before),
        "sent": sent,
    }


@pytest.mark.slow
def test_moving_rows_permutes_weights_and_optimizer_state_exactly():
    """4 ranks: EP=4; EP=2 x expert FSDP 2 sharding dim 0 (FSDP's strided shard); and sharding dim 1."""
    layouts = ["ep4", "ep2_efsdp2_dim0", "ep2_efsdp2_dim1"]
    results = run_distributed(4, _migration_worker, layouts)
    for layout in layouts:
        for rank, result in enumerate(results):
            got = result[layout]
            assert got["weights"] and got["state"] and got["changed"], (layout, rank, got)
        assert sum(result[layout]["sent"] for result in results) > 0, layout
