"""The advisor prices expert replication: the busiest rank's rows after training's split, and the replicas' traffic."""

import numpy as np
import pytest

from tests.planning.advice_text import ERROR, headline, paragraph
from torchtitan_ext import plan
from torchtitan_ext.config import ConfigError, load_job_config
from torchtitan_ext.planning.cost_model import MeasuredRouting, MoEWorkload
from torchtitan_ext.planning.advice_report import format_advice
from torchtitan_ext.planning.job_shape import job_shape
from torchtitan_ext.planning.layout_advisor import advise
from torchtitan_ext.planning.replica_cost import replay, replica_traffic
from torchtitan_ext.planning.topology import load_topology, parse_topology
from torchtitan_ext.training import prepare

DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]
prepare()  # as the advisor's process: our train specs (every backend builds torchtitan's standard MoE) and flavours
EXPERTS, TOP_K = 8, 3
COLLAPSED = [2045, 2045, 2045, 3, 1, 1, 1, 2]
"""Routing near collapse, as in the default job: 3 of 8 experts take almost all of a step's pairs (here all
three on rank 0 at EP = 2)."""
ONE_LINK = parse_topology(
    {"compute_tflops": 100.0, "overlap": False, "levels": [
        {"name": "link", "bandwidth_GBps": 10.0, "all_gather_bandwidth_GBps": 5.0, "latency_us": 100.0}]},
    "one link",
)


def _routing(counts: np.ndarray, first_step: int = 1) -> MeasuredRouting:
    """A measured routing from [steps, layers, E] counts (sampled tokens: one per dispatch, unused here)."""
    steps, layers, experts = counts.shape
    sampled = tuple(np.array([[0, 1, 2]]) for _ in range(steps * layers))
    return MeasuredRouting("counts", counts.reshape(-1, experts).astype(np.float64), sampled, layers,
                           tuple(range(first_step, first_step + steps)))


def _rows(routing: MeasuredRouting, ep: int, slots: int, adapt_every: int) -> np.ndarray:
    return replay(routing, ep, slots, adapt_every).rows


def _dump(counts: np.ndarray) -> dict:
    """A loaded dump's keys with these [steps, layers, E] counts (every sampled token picks experts 0-2)."""
    steps, layers, _ = counts.shape
    return {"steps": np.arange(1, steps + 1), "layers": np.arange(1, layers + 1), "tokens_per_expert": counts,
            "top_k": np.array(TOP_K), "sampled_expert_ids": np.tile(np.array([0, 1, 2], dtype=np.int16),
                                                                     (steps, layers, 4, 1))}


def test_without_slots_a_rank_computes_its_own_experts():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 100, size=(4, 2, EXPERTS))
    rows = _rows(_routing(counts), ep=4, slots=0, adapt_every=1)
    # steps 2-4 of both layers, step-major; each rank holds two consecutive experts
    assert np.array_equal(rows, counts[1:].reshape(6, 4, 2).sum(axis=2))


def test_replicas_chosen_from_the_previous_step_split_the_next():
    """A collapsed layer that stays collapsed: 2 slots per rank bring the busiest rank to the mean (plus one
    pair of rounding); 1 slot cannot (rank 0 keeps two hot experts whole): 4,093 of 6,143 pairs, 1.33x the
    mean; every pair is computed once."""
    counts = np.array([[COLLAPSED]] * 3)
    routing = _routing(counts)
    total = sum(COLLAPSED)
    for slots in (0, 1, 2):
        rows = _rows(routing, ep=2, slots=slots, adapt_every=1)
        assert rows.shape == (2, 2) and (rows.sum(axis=1) == total).all()
    assert _rows(routing, 2, 2, 1).max() == -(-total // 2)
    ratios = [replay(routing, 2, slots, 1).rows_ratio for slots in (0, 1, 2)]
    assert ratios == pytest.approx([(3 * 2045 + 3) / (total / 2), 4093 / (total / 2), 3072 / (total / 2)])


def _hot(expert: int, pairs: int) -> list[int]:
    return [pairs if e == expert else 1 for e in range(EXPERTS)]


@pytest.mark.parametrize(
    "first, second, misses_every_two",
    [
        # steps 1-2 together favour expert 0 (6,001 pairs to 3,001): chosen every 2 steps, step 3 keeps expert 0's
        # replica and rank 0 computes all of expert 1
        (_hot(0, 6000), _hot(1, 3000), True),
        # expert 1 leads over steps 1-2 (6,001 to 3,001): step 3's choice made from both steps splits it
        (_hot(0, 3000), _hot(1, 6000), False),
    ],
)
def test_replicas_come_from_the_window_before_each_choice(first, second, misses_every_two):
    """Step 3 is hot on expert 1 (both experts are homed on rank 0; one slot per rank). Re-chosen every step,
    step 3's replica comes from step 2 alone and splits expert 1; chosen every 2 steps, from steps 1-2."""
    routing = _routing(np.array([[first], [second], [_hot(1, 6000)]]))
    every_step = _rows(routing, 2, 1, adapt_every=1)
    every_two = _rows(routing, 2, 1, adapt_every=2)
    assert every_step.shape == (2, 2) and every_two.shape == (1, 2)  # steps 2-3 and step 3 are priced
    balanced = -(-(6000 + 7) // 2) + 1
    assert every_step[1].max() <= balanced
    assert bool(every_two[0].max() >= 6000) == misses_every_two
    assert bool(every_two[0].max() <= balanced) != misses_every_two


def test_a_dump_that_starts_later_is_priced_from_its_first_full_window():
    """Steps 3-6, a choice every 2 steps: the choices before steps 3 and 5 use steps 1-2 (not recorded) and 3-4,
    so steps 5 and 6 are priced, both from steps 3-4."""
    routing = _routing(np.array([[_hot(0, 10)], [_hot(0, 6000)], [_hot(0, 6000)], [_hot(1, 6000)]]), first_step=3)
    rows = _rows(routing, 2, 1, adapt_every=2)
    assert rows.shape == (2, 2)
    assert rows[0].max() <= -(-(6000 + 7) // 2) + 1 and rows[1].max() >= 6000


def test_a_dump_with_a_gap_is_refused():
    routing = _routing(np.array([[COLLAPSED]] * 3))
    routing = MeasuredRouting(routing.source, routing.tokens_per_expert, routing.sampled_expert_ids, 1, (1, 2, 4))
    with pytest.raises(ConfigError) as error:
        replay(routing, 2, 1, adapt_every=1)
    assert str(error.value) == (
        "--routing-stats counts records steps 1..4 with gaps: replaying replica choices needs consecutive steps; "
        "use the files of one uninterrupted run"
    )


def test_a_dump_without_a_step_after_the_first_choice_is_named():
    with pytest.raises(ConfigError) as error:
        replay(_routing(np.array([[COLLAPSED]] * 2)), 2, 1, adapt_every=2)
    assert str(error.value) == (
        "--routing-stats counts records steps 1..2; pricing replicas chosen every 2 step(s) needs a step whose "
        "choice's 2 step(s) before it are recorded too: record more steps, or lower expert_replication.adapt_every"
    )


def test_the_advice_refuses_such_a_dump_even_where_every_layout_with_replicas_is_refused():
    """8 slots per rank are more than any EP degree of the 8-expert model leaves a rank to copy, so every layout
    with them is refused before its replay; the dump still cannot price replicas chosen every 2 steps from 2
    recorded steps, and the advice says so instead of printing only refusals."""
    job = [*DEBUG_JOB, "--expert_replication.adapt_every", "2"]
    with pytest.raises(ConfigError, match=r"records steps 1\.\.2; pricing replicas chosen every 2 step\(s\)"):
        advise(job, 2, ONE_LINK, _dump(np.array([[COLLAPSED] * 5] * 2)), "collapsed", replica_slots=[8])


def test_the_busiest_sender_sets_the_replica_traffic():
    """Three hot experts homed on ranks 0 and 1 of 4, two slots each: rank 0, home of two of them, sends 5 experts
    per fetch, more than the 2 each rank receives, and the layout's fetch is priced at those 5."""
    # EP = 4 of 8 experts: rank r homes experts 2r and 2r + 1, so the hot experts 0 and 1 (2,045 pairs each) live
    # on rank 0 and the hot expert 2 on rank 1; 4 x 2 = 8 replica slots. The choice gives a slot, round after
    # round, to the expert with the most pairs per copy, on the least-loaded rank with a free slot that has no copy
    # of it; rank 0 can hold neither 0 nor 1, rank 1 not 2:
    # - 2,045 pairs per copy: expert 0 to rank 2 (2 pairs), expert 1 to rank 3 (3 pairs), expert 2 to rank 3
    #   (1,024 pairs then, under rank 0's 1,025);
    # - 1,022.5: expert 0 to rank 1 (the one rank with a free slot and no copy: rank 3 is full), expert 1 to
    #   rank 1 (tied with rank 2 at 1,536 pairs: the lower rank), expert 2 to rank 0 (tied with rank 2);
    # - 681.7: expert 0 finds no free rank without a copy (rank 3 is full), expert 1 takes rank 2's last slot,
    #   expert 2 finds none; the last free slot (rank 0's) goes to the cold expert 3 (homed on rank 1).
    # Rank 0 sends experts 0 and 1 to ranks 1 and 2 and expert 1 to rank 3: 5; rank 1 sends 3; no rank receives
    # more than its 2 slots. The busiest rank moves 5 experts per fetch.
    moved = replay(_routing(np.array([[COLLAPSED]] * 2)), 4, 2, 1).experts_moved
    assert moved == 5
    topology = load_topology("hgx_h100_ib")
    dump = _dump(np.array([[COLLAPSED] * 5] * 2))
    layouts, _ = advise(DEBUG_JOB, 4, topology, dump, "collapsed", replica_slots=[0, 2])
    layout = next(layout for layout in layouts if layout.refused is None and (layout.ep, layout.replica_slots) == (4, 2))
    work = job_shape(load_job_config(DEBUG_JOB, device_type=None, world_size=4), 4).work
    assert layout.replica_fetch_s == pytest.approx(replica_traffic(work, topology, 4, 4, 5)[0])


def test_replica_traffic_is_whole_experts_out_and_their_gradients_back():
    work = MoEWorkload(tokens=1024, hidden=256, top_k=2, experts=8, expert_parameters=3 * 256 * 512,
                       activation_bytes=2, gather_bytes=2, reduce_bytes=4, pre_expert_flops=1e9,
                       regather_in_backward=True)
    fetch, back = replica_traffic(work, ONE_LINK, world_size=4, ep=4, experts_moved=2)
    weights = 2 * 3 * 256 * 512 * 2 / 10e9 + 100e-6
    counts = 8 * 8 * 3 / 5e9 + 100e-6
    assert fetch == pytest.approx(weights + counts) and back == pytest.approx(weights)
    assert replica_traffic(work, ONE_LINK, world_size=4, ep=4, experts_moved=0) == (0.0, 0.0)


def test_replicas_win_where_the_busiest_rank_sets_the_step():
    """Collapsed routing on a slow-compute machine with fast all-to-alls (and a slow all-gather, so that EP=1,
    where FSDP gathers every expert and each rank computes its own tokens, does not win): the busiest rank's
    extra expert compute outweighs the replicas' traffic, so the advice adds slots and the overrides name them."""
    slow = parse_topology({"compute_tflops": 0.01, "overlap": False, "levels": [
        {"name": "link", "bandwidth_GBps": 1000.0, "all_gather_bandwidth_GBps": 0.01, "latency_us": 1.0}]},
        "slow compute")
    dump = _dump(np.array([[COLLAPSED] * 5] * 3))
    layouts, routing = advise(DEBUG_JOB, 2, slow, dump, "collapsed", replica_slots=[0, 1, 2])
    runnable = [layout for layout in layouts if layout.refused is None]
    best = runnable[0]
    assert (best.ep, best.replica_slots) == (2, 2), best
    without = next(layout for layout in runnable if (layout.label, layout.ep, layout.replica_slots) ==
                   (best.label, 2, 0))
    assert best.rows_ratio < 1.01 < 1.9 < without.rows_ratio
    assert best.imbalance_s < without.imbalance_s and best.replica_s > 0 == without.replica_s
    assert best.moe_s == pytest.approx(best.exposed_s + best.imbalance_s + best.replica_s)
    assert not any(layout.ep == 1 and layout.replica_slots for layout in layouts)  # EP=1 is priced without only
    assert best.overrides()[-2:] == ["--expert_replication.slots_per_rank", "2"]
    lines = format_advice(layouts, slow, 2, "debug", None, routing, error=ERROR)
    recommended = headline(lines)
    assert f"with 2 replica slot(s) the busiest rank computes {best.rows_ratio:.3f}x the mean rank's" in recommended


def test_under_uniform_routing_replicas_only_cost():
    layouts, routing = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"), replica_slots=[0, 1])
    runnable = [layout for layout in layouts if layout.refused is None]
    assert runnable[0].replica_slots == 0 and all(layout.rows_ratio == 1.0 for layout in runnable)
    assert all(layout.replica_s > 0 for layout in runnable if layout.replica_slots)
    lines = format_advice(layouts, load_topology("hgx_h100_ib"), 4, "debug", None, routing, error=ERROR)
    assert any("replica slots priced under uniform routing" in line for line in lines)
    inputs = paragraph(lines, "  replicas' inputs:")
    assert "expert time from their FLOPs at 400 TFLOP/s, taken as proportional to the rows" in inputs
    assert "not priced: the host's choice of replicas" in inputs
    # the memory bound adds the copy each MoE layer computes from: its 8 / EP home experts beside the slot, kept
    # by every saved layer (the debug job recomputes none: 5), and the last layer's fetched slot, alive while it
    # computes, at the gathered dtype (nccl: no buffer, whose size would follow the dispatched slots too)
    nccl = {(layout.ep, layout.replica_slots): layout for layout in runnable if layout.label == "nccl"}
    work = job_shape(load_job_config(DEBUG_JOB, device_type=None, world_size=4), 4).work
    for ep in (2, 4):
        copies = ((8 // ep + 1) * 5 + 1) * work.expert_parameters * work.gather_bytes
        assert nccl[ep, 1].memory_bytes - nccl[ep, 0].memory_bytes == copies, ep


def test_the_jobs_own_slots_are_priced_by_default():
    layouts, _ = advise([*DEBUG_JOB, "--expert_replication.slots_per_rank", "1"], 4, load_topology("hgx_h100_ib"))
    assert {layout.replica_slots for layout in layouts} == {1}
    refused = {(layout.label, layout.ep) for layout in layouts if layout.refused is not None}
    assert ("nccl", 1) in refused  # replication needs EP > 1
    runnable = [layout for layout in layouts if layout.refused is None]
    assert all(layout.overrides()[-2:] != ["--expert_replication.slots_per_rank", "1"] for layout in runnable)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "hgx_h100_ib", "--replica-slots", "1,x"],
         "argument --replica-slots: '1,x': use comma-separated slot counts >= 0, e.g. 0,1,2"),
        (["--topology", "hgx_h100_ib", "--replica-slots", "-1"],
         "argument --replica-slots: '-1': use comma-separated slot counts >= 0, e.g. 0,1,2"),
        (["--replica-slots", "1"], "--replica-slots prices the layout advice's layouts: add --topology"),
    ],
)
def test_bad_replica_slots_are_one_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        plan.main([*argv, "--world-size", "4", *DEBUG_JOB])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_per_rank_backends_are_priced_per_pair_under_replicas():
    """Which ranks a token reaches through replicas is not replayed: with slots DeepEP and HybridEP are priced as
    all-to-all (once per pair, at the split's busiest share), without slots by their own model."""
    dump = _dump(np.array([[COLLAPSED] * 5] * 3))
    layouts, _ = advise(DEBUG_JOB, 4, load_topology("hgx_h100_ib"), dump, "collapsed", replica_slots=[0, 2])
    costs = {(layout.label, layout.ep, layout.replica_slots): layout.costs for layout in layouts if layout.refused is None}
    for ep in (2, 4):
        # the same copies; each backend's all-to-all at its own published rate
        assert costs["deepep", ep, 2].token_copies == costs["nccl", ep, 2].token_copies
        assert costs["deepep", ep, 0].token_copies < costs["nccl", ep, 0].token_copies


def _flops_per_token(args, seq_len: int) -> tuple[int, int]:
    """(the routed experts', the whole model's) training FLOPs per token of DeepSeek-V3 ``args``, from its
    dimensions, as torchtitan counts them: 6 x the parameters a token passes through (the embedding is a lookup,
    not counted; the output layer is), plus attention's 6 x layers x heads x (q/k + v head dims) x seq_len."""
    moe = args.moe_args
    assert args.q_lora_rank == 0  # the debug flavours project q directly
    attention = (args.dim * args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim)  # wq
                 + args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank  # wkv_a, kv_norm
                 + args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_b
                 + args.n_heads * args.v_head_dim * args.dim)  # wo
    expert = 3 * args.dim * args.moe_inter_dim  # w1, w2, w3
    moe_layers = args.n_layers - args.n_dense_layers
    active = (args.n_layers * (attention + 2 * args.dim)  # and the two norms of each block
              + args.n_dense_layers * 3 * args.dim * args.inter_dim
              # the router's gate, the shared experts and the top-k routed experts of each MoE layer
              + moe_layers * (args.dim * moe.num_experts + (moe.num_shared_experts + moe.top_k) * expert)
              + args.dim + args.dim * args.vocab_size)  # the final norm and the output layer
    head_dims = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    total = 6 * active + 6 * args.n_layers * args.n_heads * head_dims * seq_len
    return 6 * moe_layers * moe.top_k * expert, total


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_small", "debugmodel_wide_experts"])
def test_the_routed_experts_share_of_the_flops(flavor):
    """The share the advisor scales by the busiest rank's load: the routed experts' FLOPs per token over the whole
    model's, both counted here from the flavour's dimensions (about 8%, 38% and 53%, as the flavours' docstrings
    say)."""
    from torchtitan_ext.models.deepseek_v3 import flavors

    job_config = load_job_config([*DEBUG_JOB, "--model.flavor", flavor], device_type=None, world_size=2)
    routed, total = _flops_per_token(flavors()[flavor], job_config.training.seq_len)
    assert job_shape(job_config, 2).expert_flop_share == pytest.approx(routed / total, rel=1e-12)
