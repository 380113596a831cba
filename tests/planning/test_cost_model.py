"""The layout advisor's cost model reproduces the seed paper (HybridEP, hybrid expert/data transmission).

Its equations 3-12 (one level, bandwidth-only links), the pair counts of its
Table VII and of its 4 x 4 two-level example (Algorithm 1), and the case
classification of its Table IV modelling rows.
"""

import itertools
from dataclasses import replace

import pytest

from torchtitan_ext.planning import cost_model as cm
from torchtitan_ext.planning import expert_reach
from torchtitan_ext.planning import paper_model as paper
from torchtitan_ext.planning.topology import Level, Topology

MB = 1e6
GBPS_128 = 128e9 / 8  # the paper's PCIe 3.0 x16, 128 Gbit/s, in bytes/s

TABLE_VII = {  # G: {S: (A2A pairs, AG pairs)}
    8: {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)},
    16: {1: (240, 0), 2: (112, 16), 4: (48, 48), 8: (16, 112), 16: (0, 240)},
    32: {1: (992, 0), 2: (480, 32), 4: (224, 96), 8: (96, 224), 16: (32, 480)},
}


@pytest.mark.parametrize("G, S", [(G, S) for G, row in TABLE_VII.items() for S in row])
def test_table_vii_pair_counts(G, S):
    counts = paper.pair_counts([G], [S])
    assert (counts["A2A"], counts["AG"]) == TABLE_VII[G][S]


def test_two_level_example_pair_counts():
    """Fig. 8b: 4 data centres x 4 GPUs, domains of 2 data centres and of all 4 GPUs in one. The paper
    gives no counts for it; these follow from Algorithm 1 as read here (paper_model's docstring), and they
    equal the one-level formulas summed over levels: AG 16 x ((2-1) + (4-1)), A2A 16 x (4/2 - 1)."""
    assert paper.pair_counts([4, 4], [2, 4]) == {"AG": 64, "A2A": 16}


def test_eq13_renumbers_outermost_first():
    assert paper.eq13_coordinates(13, [4, 4]) == [3, 1]
    assert paper.eq13_coordinates(13, [2, 2, 4]) == [1, 1, 1]
    assert [paper.eq13_coordinates(rank, [2, 3]) for rank in range(6)] == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


SETTINGS = [  # (G, D, P_E, pre_expert seconds): both cases of eq. 10, both signs of eq. 12's slope
    (G, D * MB, P_E * MB, pre_expert)
    for G, D, P_E, pre_expert in itertools.product([8, 16, 32], [3, 8, 48], [0.047, 2.35, 4.7], [0.049e-3, 0.5e-3, 5e-3])
]


@pytest.mark.parametrize("G, D, P_E, pre_expert", SETTINGS)
def test_stream_model_equals_the_closed_form(G, D, P_E, pre_expert):
    """Eqs. 2, 3, 4, 5, 7 substituted in eq. 8 give eq. 10 (eq. 11 or 12 by case) at every feasible
    domain size, with p = (G - S) / (G - 1); and the latency is max(PE, AG) + 2 A2A."""
    setting = paper.PaperSetting(G, D, P_E, GBPS_128, pre_expert)
    for S in setting.domain_sizes():
        p = paper.p_of_domain_size(G, S)
        assert setting.latency(S) == pytest.approx(paper.eq10_latency(p, G, D, P_E, GBPS_128, pre_expert), rel=1e-12)
        a2a = D * (G - S) / G / GBPS_128
        ag = P_E * (S - 1) / GBPS_128
        assert setting.latency(S) == pytest.approx(max(pre_expert, ag) + 2 * a2a, rel=1e-12)


def test_eq3_volume_tends_to_d_and_eq4_grows_linearly():
    assert paper.eq3_a2a_volume(8 * MB, 8) == pytest.approx(7 * MB)
    assert paper.eq3_a2a_volume(8 * MB, 1000) == pytest.approx(8 * MB * 999 / 1000)
    assert [paper.eq4_ag_volume(2.0, g) for g in (1, 2, 4, 8)] == [0.0, 2.0, 6.0, 14.0]


@pytest.mark.parametrize("G, D, P_E, pre_expert", SETTINGS)
def test_optimal_p_is_the_continuous_minimum(G, D, P_E, pre_expert):
    """The summary's p* minimises eq. 10 over p in [0, 1] (checked on a fine grid)."""
    p_star = paper.optimal_p(G, D, P_E, GBPS_128, pre_expert)
    best = min(paper.eq10_latency(i / 1000, G, D, P_E, GBPS_128, pre_expert) for i in range(1001))
    assert paper.eq10_latency(p_star, G, D, P_E, GBPS_128, pre_expert) == pytest.approx(best, rel=1e-3)


@pytest.mark.parametrize(
    "row, D, P_E, pre_expert, all_gather_only",
    [
        ("Mix-1", 8, 4.7, 0.049e-3, False),
        ("Mix-2", 8, 2.35, 0.049e-3, False),
        ("AG-only-1", 3, 0.094, 0.099e-3, True),
        ("AG-only-2", 3, 0.047, 0.099e-3, True),
    ],
)
def test_table_iv_cases(row, D, P_E, pre_expert, all_gather_only):
    """Table IV (G = 8): the Mix rows are case 2.1 (2D < G P_E: both transfers), the AG-only rows case
    2.2 (p* = 0). The table's absolute p values do not follow from its own numbers at 128 Gbit/s
    (paper_model's docstring), so the checks are the classification and the Mix rows' ratio
    (1 - p) proportional to 1 / P_E."""
    p_star = paper.optimal_p(8, D * MB, P_E * MB, GBPS_128, pre_expert)
    if all_gather_only:
        assert p_star == 0.0
    else:
        assert 0 < p_star < 1
        other = paper.optimal_p(8, D * MB, (2.35 if P_E == 4.7 else 4.7) * MB, GBPS_128, pre_expert)
        assert (1 - p_star) / (1 - other) == pytest.approx((2.35 if P_E == 4.7 else 4.7) / P_E)


def _level(name: str, workers: int | None, bandwidth_GBps: float, latency_us: float = 0.0) -> Level:
    """A level whose collectives all reach ``bandwidth_GBps``."""
    return Level(name, workers, bandwidth_GBps, latency_us, bandwidth_GBps, bandwidth_GBps)


def _one_level(bandwidth_GBps=10.0, latency_us=0.0, overlap=True, compute_tflops=1.0):
    return Topology("test", compute_tflops, overlap, (_level("link", None, bandwidth_GBps, latency_us),))


WORK = cm.MoEWorkload(
    tokens=1024, hidden=256, top_k=2, experts=8, expert_parameters=3 * 256 * 512,
    activation_bytes=2, gather_bytes=2, reduce_bytes=4, pre_expert_flops=1e9, regather_in_backward=True,
)


def test_one_level_job_is_the_papers_model():
    """At one level, one expert per rank and no latency, the job model's exposed forward per layer
    (the all-gather hidden up to pre-expert compute, dispatch + combine) plus the pre-expert compute
    is the paper's eq. 10 at S = G / EP."""
    topology = _one_level()
    work = cm.MoEWorkload(**{**WORK.__dict__, "experts": 8, "top_k": 1, "regather_in_backward": False})
    G, B = 8, 10e9
    D = work.tokens * work.top_k * work.hidden * work.activation_bytes
    P_E = work.expert_parameters * work.gather_bytes
    for ep in (1, 2, 4, 8):
        S = G // ep
        costs = cm.layer_costs(work, topology, G, ep=ep, efsdp=S, copies_per_rank=False)
        pre_expert = costs.pre_expert_forward
        backward = 2 * costs.a2a + max(0.0, costs.reduce_scatter - 2 * pre_expert)
        forward = costs.exposed(overlap=True) - backward + pre_expert
        # E = G experts: a rank gathers the (S - 1)/S it lacks of its E/ep = S experts, the paper's P_E (S - 1)
        setting = paper.PaperSetting(G, D, P_E, B, pre_expert)
        assert forward == pytest.approx(setting.latency(S), rel=1e-9), ep


def test_deduplicating_backends_send_fewer_copies():
    topology = _one_level()
    per_pair = cm.layer_costs(WORK, topology, 4, ep=4, efsdp=1, copies_per_rank=False)
    per_rank = cm.layer_costs(WORK, topology, 4, ep=4, efsdp=1, copies_per_rank=True)
    # top-2 of 8 experts, 2 per rank: P(a given other rank holds none of the two) = C(6,2)/C(8,2) = 15/28
    assert per_pair.token_copies == pytest.approx(2 * 3 / 4)
    assert per_rank.token_copies == pytest.approx(3 * (1 - 15 / 28))
    assert per_rank.a2a < per_pair.a2a


def test_outer_level_carries_one_copy_per_domain():
    """Two nodes of 2 ranks, EP = 4: a deduplicating backend sends a token once to the other node
    when any of its experts is there, and the rank it lands on forwards it to the other one."""
    topology = Topology("two nodes", 1.0, True, (_level("node", 2, 100.0), _level("network", None, 1.0)))
    sizes = topology.group_sizes(4)
    volume, _ = cm.token_bytes_per_level(WORK, topology, sizes, 4, copies_per_rank=True)
    row = WORK.hidden * WORK.activation_bytes
    # the other node holds 4 of the 8 experts: C(4,2)/C(8,2) = 6/28 of tokens miss it;
    # a rank holds 2: C(6,2)/C(8,2) = 15/28 miss it
    assert volume[1] == pytest.approx(WORK.tokens * (1 - 6 / 28) * row)
    assert volume[0] == pytest.approx(2 * WORK.tokens * (1 - 15 / 28) * row)  # the node's peer + one forward
    per_pair, _ = cm.token_bytes_per_level(WORK, topology, sizes, 4, copies_per_rank=False)
    assert per_pair[1] == pytest.approx(WORK.tokens * WORK.top_k * 2 / 4 * row)


def test_a_partial_domain_is_still_reached():
    """EP = 12 on nodes of 8: rank 0's EP group has 4 ranks on the second node, which are reached over
    the network (not rounded away)."""
    topology = Topology("nodes of 8", 1.0, True, (_level("node", 8, 100.0), _level("network", None, 1.0)))
    work = cm.MoEWorkload(**{**WORK.__dict__, "experts": 24})
    volume, _ = cm.token_bytes_per_level(work, topology, topology.group_sizes(24), 12, copies_per_rank=True)
    row = work.hidden * work.activation_bytes
    # the 4 remote ranks hold 8 of the 24 experts: C(16,2)/C(24,2) of tokens miss them
    assert volume[1] == pytest.approx(work.tokens * (1 - 120 / 276) * row)


def test_backward_gathers_and_reduce_scatters_share_one_window():
    """Re-gather (10 ms) + reduce-scatter (20 ms) against a 24 ms pre-expert backward: 6 ms exposed;
    the forward gather (10 ms) hides behind 12 ms; four all-to-alls, six when recomputed."""
    costs = cm.LayerCosts(a2a=1e-3, all_gather=10e-3, reduce_scatter=20e-3, pre_expert_forward=12e-3,
                          token_copies=1.0, all_gathers=2)
    assert costs.exposed(overlap=True) == pytest.approx(4e-3 + 6e-3)
    assert costs.exposed(overlap=True, recomputed=True) == pytest.approx(6e-3 + 6e-3)
    assert costs.communication() == pytest.approx(4e-3 + 2 * 10e-3 + 20e-3)
    assert costs.exposed(overlap=False) == pytest.approx(costs.communication())
    assert costs.exposed(overlap=False, recomputed=True) == pytest.approx(6e-3 + 2 * 10e-3 + 20e-3)


def test_without_overlap_everything_is_exposed():
    costs = cm.layer_costs(WORK, _one_level(overlap=False), 4, ep=2, efsdp=2, copies_per_rank=False)
    assert costs.all_gathers == 2
    by_hand = 4 * costs.a2a + 2 * costs.all_gather + costs.reduce_scatter
    assert costs.exposed(overlap=False) == pytest.approx(by_hand)
    assert costs.exposed(overlap=True) < by_hand


def test_data_parallel_sync_gathers_per_unit_and_reduce_scatters_once():
    """8M dense parameters over 4 ranks: each rank gathers the 6M it lacks (bf16) in forward and again in backward,
    and reduce-scatters their gradients (fp32), one start-up per unit and collective, at each collective's
    bandwidth; all of it once per accumulation step."""
    link = Level("link", None, 10.0, 100.0, 2.0, 1.0)
    topology = Topology("test", 1.0, False, (link,))
    sync = cm.DataParallelSync(
        dense_parameters=8_000_000, units=4, fsdp_degree=4, fsdp_stride=1, replicas=1, replica_stride=4,
        shard_parameters=3_000_000, gather_bytes=2, reduce_bytes=4, regather_in_backward=True, accumulation_steps=1,
    )
    gather, scatter = 6e6 * 2 / 2e9 + 4 * 1e-4, 6e6 * 4 / 1e9 + 4 * 1e-4
    assert sync.communication(topology, 4) == pytest.approx(2 * gather + scatter)
    assert replace(sync, regather_in_backward=False).communication(topology, 4) == pytest.approx(gather + scatter)
    assert replace(sync, accumulation_steps=3).communication(topology, 4) == pytest.approx(3 * (2 * gather + scatter))
    assert replace(sync, fsdp_degree=1).communication(topology, 4) == 0.0
    # with tensor parallel inside, FSDP's peers are 2 ranks apart: on nodes of 2 they talk over the network
    nodes = Topology("nodes of 2", 1.0, False, (_level("node", 2, 100.0), _level("network", None, 1.0)))
    across = replace(sync, fsdp_degree=2, fsdp_stride=2).communication(nodes, 4)
    assert across == pytest.approx(2 * 4e6 * 2 / 1e9 + 4e6 * 4 / 1e9)


def test_replicas_all_reduce_each_gradient_shard():
    """HSDP with 2 replicas of an FSDP group of 4 (8 ranks, replicas 4 apart, over the network): each rank
    all-reduces its 3M-parameter gradient shard with its replica, a reduce-scatter and an all-gather of half."""
    nodes = Topology("nodes of 4", 1.0, False, (Level("node", 4, 100.0, 0.0, 100.0, 100.0),
                                                  Level("network", None, 8.0, 10.0, 4.0, 2.0)))
    sync = cm.DataParallelSync(
        dense_parameters=8_000_000, units=5, fsdp_degree=4, fsdp_stride=1, replicas=2, replica_stride=4,
        shard_parameters=3_000_000, gather_bytes=2, reduce_bytes=4, regather_in_backward=False, accumulation_steps=1,
    )
    fsdp = 6e6 * 2 / 100e9 + 6e6 * 4 / 100e9
    all_reduce = 1.5e6 * 4 / 2e9 + 1.5e6 * 4 / 4e9 + 2 * 5 * 10e-6
    assert sync.communication(nodes, 8) == pytest.approx(fsdp + all_reduce)
    # DDP: no FSDP group, every rank holds all parameters and all-reduces them
    ddp = replace(sync, fsdp_degree=1, replica_stride=1, shard_parameters=11_000_000)
    two = Topology("two ranks", 1.0, False, (Level("network", None, 8.0, 10.0, 4.0, 2.0),))
    assert ddp.communication(two, 2) == pytest.approx(5.5e6 * 4 / 2e9 + 5.5e6 * 4 / 4e9 + 2 * 5 * 10e-6)


def test_group_limited_choice_is_torchtitans_gate():
    """The same scores through torchtitan 0.2.2's router (its group mask, then top-k) pick the same experts."""
    import types

    import numpy as np
    import torch
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    scores = np.random.default_rng(3).random((512, 256))
    ours = np.sort(expert_reach.group_limited_choice(scores, 8, 8, 4), axis=1)
    router = types.SimpleNamespace(num_experts=256, num_expert_groups=8, num_limited_groups=4)
    masked = TokenChoiceTopKRouter._get_node_limited_routing_scores(router, torch.from_numpy(scores))
    theirs = np.sort(torch.topk(masked, k=8, dim=-1).indices.numpy(), axis=1)
    assert (ours == theirs).all()


def test_group_limited_reach_is_the_uniform_one_without_a_limit():
    """Drawn through torchtitan's gate with every group kept, the reach is the closed form's (top_k distinct
    experts, uniform) within the draw's noise."""
    for held in (4, 32, 64):
        drawn = expert_reach.group_limited_reach(256, 8, 8, 8, held)
        assert drawn == pytest.approx(1 - expert_reach.uniform_miss(256, 8, held), abs=0.005)


def test_group_limited_routing_sends_fewer_copies_across_nodes():
    """DeepSeek-V3 671B's gate (8 groups of 32 experts, 4 kept per token) at EP=64 on HGX nodes of 8: a node
    holds one group, so a token reaches at most 4 of the 8 nodes; DeepEP's copies per token drop by about a
    fifth, all of it across nodes, and the per-pair all-to-all's do not change."""
    hgx = Topology("hgx", 400.0, True, (_level("NVLink", 8, 360.0), _level("IB", None, 50.0)))
    work = cm.MoEWorkload(**{**WORK.__dict__, "experts": 256, "top_k": 8})
    limited = replace(work, expert_groups=8, limited_groups=4)
    sizes = hgx.group_sizes(256)
    free_volume, free_copies = cm.token_bytes_per_level(work, hgx, sizes, 64, copies_per_rank=True)
    limited_volume, limited_copies = cm.token_bytes_per_level(limited, hgx, sizes, 64, copies_per_rank=True)
    assert round(free_copies, 2) == 5.47
    assert 0.70 * free_copies < limited_copies < 0.85 * free_copies
    assert limited_volume[1] < 0.8 * free_volume[1]
    # within the node a token's copies barely change (a rank holds 4 experts of one group)
    assert limited_volume[0] == pytest.approx(free_volume[0], rel=0.1)
    assert cm.token_bytes_per_level(limited, hgx, sizes, 64, False) == cm.token_bytes_per_level(work, hgx, sizes, 64, False)


@pytest.mark.parametrize("communication, compute, sm_share, exposed", [
    (4.0, 10.0, 0.0, 0.0),   # hidden whole, the SMs not priced
    (4.0, 10.0, 0.2, 0.8),   # the GEMMs lose a fifth of the SMs for 4 s: 10 + 0.8
    (10.0, 4.0, 0.2, 6.0),   # 4 s of compute at 0.8 of the SMs fits in the 10 s: the excess alone
    (5.0, 4.0, 0.25, 1.25),  # 4 s of compute needs 5.33 s at 0.75 of the SMs: 4 + 1.25 over the compute
])
def test_overlapped_all_to_alls_expose_their_excess_or_the_sms_they_take(communication, compute, sm_share, exposed):
    """By hand: the pair takes max(c, C + s x c); exposed is that minus C."""
    assert cm.overlapped_exposure(communication, compute, sm_share) == pytest.approx(exposed)


def test_a_layers_all_to_alls_beside_another_microbatch_are_exposed_only_past_its_compute():
    """Four 1 ms all-to-alls beside 3 ms of another microbatch, the kernels holding a tenth of the SMs: 1 ms
    exposed (no FSDP traffic here); without the other microbatch, all 4 ms."""
    costs = cm.LayerCosts(a2a=1e-3, all_gather=0.0, reduce_scatter=0.0, pre_expert_forward=1e-3, token_copies=1.0,
                          all_gathers=1)
    assert costs.exposed(overlap=True, a2a_beside=3e-3, sm_share=0.1) == pytest.approx(1e-3)
    assert costs.exposed(overlap=True, a2a_beside=30e-3, sm_share=0.1) == pytest.approx(0.4e-3)
    assert costs.exposed(overlap=True) == pytest.approx(4e-3)
