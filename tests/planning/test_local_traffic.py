"""Each backend's passes over the token rows outside its kernels: what the counter counts, and what the advisor
makes of it."""

import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_ext.config import ConfigError, MoEShape, parse
from torchtitan_ext.ep import BACKENDS, PLANNING_PROFILES
from torchtitan_ext.ep.base import token_group_alignment
from torchtitan_ext.ep.hybridep import non_blocking_rows
from torchtitan_ext.ep.in_flight import in_flight, Landing
from tests.planning.advice_text import ERROR, paragraph
from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter
from torchtitan_ext.planning.advice_report import format_advice
from torchtitan_ext.planning.layout_advisor import advise, advised_config
from torchtitan_ext.planning.measured_rates import MeasuredRate
from torchtitan_ext.planning.local_traffic import (
    _counted, backend_forward, count_local_traffic, counted_hidden_sizes, LocalTraffic, LocalTrafficCounter, MoECall,
    tensors_in, torchtitan_sort_forward,
)
from torchtitan_ext.planning.topology import load_topology, parse_topology
from torchtitan_ext.training import prepare

DEBUG_JOB = ["--job.config_file", "train_configs/debug_model.toml"]

prepare()


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _TensorsAsPytreeFindsThem(TorchDispatchMode):
    """Every operator's arguments and outputs: the tensors :func:`tensors_in` finds, against torch's pytree."""

    def __init__(self):
        super().__init__()
        self.operators = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tree in ((args, kwargs or {}), out):
            expected = [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]
            assert [id(t) for t in tensors_in(tree)] == [id(t) for t in expected], func
        self.operators.add(func.overloadpacket.__name__)
        return out


def test_an_operators_tensors_are_found_in_order_as_torchs_pytree_finds_them():
    """Lists with None (indexing), a named tuple of outputs, kwargs with out=, a list of tensors, sizes and
    scalars, and a module's forward and backward."""
    x = torch.randn(6, 4, requires_grad=True)
    with _TensorsAsPytreeFindsThem() as mode:
        rows = x[:, torch.tensor([0, 2])]
        torch.max(x, dim=1)
        torch.cat([x, x * 2.0]).expand(2, 12, 4).sum()
        torch.zeros(6, 4)[:, torch.tensor([1])] = torch.ones(1)
        torch.mul(x.detach(), 3, out=torch.empty(6, 4))
        torch.nn.functional.layer_norm(rows, (2,)).pow(2).sum().backward()
    assert {"index", "max", "cat", "index_put_", "mul", "native_layer_norm_backward"} <= mode.operators


def test_counter_counts_each_argument_and_output_once_and_no_views():
    x, index = torch.randn(6, 4), torch.tensor([0, 2, 2, 5])
    with LocalTrafficCounter() as counter:
        rows = x.index_select(0, index)
        rows.view(2, 8).t().detach()
        torch.empty_like(x)
        doubled = torch.zeros_like(rows)
    assert counter.bytes == x.nbytes + index.nbytes + rows.nbytes + doubled.nbytes
    with LocalTrafficCounter() as counter:
        total = torch.zeros(6, 4).index_add_(0, index, rows)
    # zeros writes its output; index_add_ reads index and rows, and reads and writes the rows of self it adds to
    assert counter.bytes == total.nbytes + (index.nbytes + rows.nbytes + 2 * rows.nbytes)
    with LocalTrafficCounter() as counter:
        total.index_copy_(0, index[:2], rows[:2]).index_fill_(0, index[:1], 0.0)
    # each writes only the rows it indexes
    assert counter.bytes == (index[:2].nbytes + rows[:2].nbytes + rows[:2].nbytes) + (index[:1].nbytes + rows[:1].nbytes)
    scores, product = torch.rand(4, 1), torch.empty_like(rows)
    with LocalTrafficCounter() as counter:
        torch.mul(rows, scores, out=product)
    # an out= destination is written, not read
    assert counter.bytes == rows.nbytes + scores.nbytes + product.nbytes


def test_a_backends_operator_is_counted_with_its_body(world_of_one):
    """A dispatch mode sees a backend's operator as one call; the counter runs its body under itself, so the passes
    the nccl dispatch makes around its all-to-all are counted (the all-to-all stays the link's). By hand: the
    received rows and the group index read, the groups written, the pad index read and the pad rows written."""
    import torchtitan_ext.ep.ops.nccl  # noqa: F401  (registers the op)

    rows, group_sources, pad_rows = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 3, 4, 5, 0]), torch.tensor([3, 7])
    destinations = torch.arange(6)
    with LocalTrafficCounter() as counter:
        groups = torch.ops.torchtitan_ext.nccl_dispatch(rows, destinations, group_sources, pad_rows, [6], [6],
                                                        dist.group.WORLD.group_name)
    assert groups.shape == (8, 4) and not groups[pad_rows].any()
    assert counter.bytes == rows.nbytes + group_sources.nbytes + groups.nbytes + pad_rows.nbytes + 2 * 4 * 4


def test_counter_skips_collectives_and_counts_a_landing_sum(world_of_one):
    """An all-to-all's copy is the link's cost, not a local pass; a combine that sums its rows when it lands does so
    inside the wait for its result, and that sum is counted."""
    x = torch.randn(8, 4)
    with LocalTrafficCounter() as counter:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
    assert counter.bytes == 0  # empty_like allocates without writing
    rows = torch.randn(8, 4)
    combined = torch.empty(8, 4)
    Landing(combined, lambda: combined.copy_(rows * 2))
    pending = in_flight(combined)
    with LocalTrafficCounter() as counter:
        pending.trigger_wait()
    # rows * 2 reads rows, writes a product; copy_ reads it and writes combined (without reading it)
    assert counter.bytes == rows.nbytes * 2 + rows.nbytes + combined.nbytes
    assert torch.equal(combined, rows * 2)


@pytest.mark.parametrize("counter", [LocalTrafficCounter, DeviceCostCounter])
def test_a_functional_collectives_wait_under_a_counter_returns_the_landed_tensor(counter, world_of_one):
    """What the wait returns outside the counters: the landed tensor, not the pending wrapper, whose storage is no
    data (on CUDA a kernel that reads it, as torchtitan's Triton permute does, reads out of bounds)."""
    from torch.distributed._functional_collectives import all_to_all_single, AsyncCollectiveTensor

    counts = torch.arange(4.0)
    with counter():
        landed = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, dist.group.WORLD))
    assert type(landed) is torch.Tensor and not isinstance(landed, AsyncCollectiveTensor)
    assert torch.equal(landed, counts)


@pytest.mark.parametrize("backend_name", [None, *BACKENDS])
def test_the_count_is_the_line_through_the_two_small_hidden_sizes(backend_name, world_of_one):
    """Every tensor grows with the hidden size or does not depend on it, so the count at any hidden size lies on
    the line the advisor extends: checked against a direct count at a third size."""
    job_config = parse(DEBUG_JOB if backend_name is None else
                       [*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", backend_name])
    shape, tokens = MoEShape(72, 8, 3, 64), 64
    assert counted_hidden_sizes(shape) == (24, 40)
    extended = count_local_traffic(backend_name, job_config, shape, tokens, torch.bfloat16, False)
    call = MoECall.random(shape, tokens, torch.bfloat16)
    if backend_name is None:
        alignment = token_group_alignment(job_config)
        direct = _counted(lambda: torchtitan_sort_forward(call, shape, False, alignment), tokens, 72)
    else:
        style = BACKENDS[backend_name].layer_factory(job_config, shape)(score_before_experts=False)
        direct = _counted(lambda: backend_forward(style, call, shape), tokens, 72)
    assert dataclasses.astuple(extended) == pytest.approx(direct, rel=1e-12)
    # at least one write of each (token, expert) row in the forward (the gather, or weighting by the scores)
    assert extended.forward_bytes >= tokens * 3 * 72 * 2
    assert 0 < extended.forward_share < 1
    # DeepEP's adapter expands and sums received token vectors itself; HybridEP's kernels hand it rows, and its
    # operators touch token vectors only in backward (once each way)
    if backend_name == "deepep":
        assert extended.forward_token_bytes > tokens * 72 * 2 * 4
    if backend_name == "hybridep":
        assert extended.forward_token_bytes == 0 and extended.backward_token_bytes == tokens * 72 * 2 * 2


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_what_the_counts_key_leaves_out_does_not_change_a_group_of_ones_count(backend_name, world_of_one):
    """The count is cached without the job's replica slots (a group of one has no replicas) and without what the
    backend's traffic settings leave out (HybridEP: the SMs of its kernels, its NVLink domain): counted directly,
    a job that differs only there moves the same bytes, and its key is the same."""
    shape, tokens = MoEShape(72, 8, 3, 64), 64
    call = MoECall.random(shape, tokens, torch.bfloat16)
    job = [*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", backend_name]
    left_out = ["--expert_replication.slots_per_rank", "2"]
    if backend_name == "hybridep":
        left_out += ["--hybridep.num_sms_dispatch", "32", "--hybridep.num_sms_combine", "32",
                     "--hybridep.ranks_per_nvlink_domain", "8"]
    section = BACKENDS[backend_name].config_section
    counts, keys = [], []
    for args in (job, [*job, *left_out]):
        job_config = parse(args)
        style = BACKENDS[backend_name].layer_factory(job_config, shape)(score_before_experts=False)
        counts.append(_counted(lambda: backend_forward(style, call, shape), tokens, 72))
        keys.append(PLANNING_PROFILES[backend_name].traffic_settings(getattr(job_config, section)) if section else None)
    assert counts[0] == counts[1] and keys[0] == keys[1]
    if backend_name == "hybridep":  # its mode does shape the count
        non_blocking = parse([*job, "--hybridep.non_blocking_capacity_factor", "0.5"]).hybridep
        assert PLANNING_PROFILES["hybridep"].traffic_settings(non_blocking) != keys[0]


def test_received_token_vectors_grow_with_the_ranks_a_token_reaches():
    traffic = LocalTraffic(forward_bytes=100.0, backward_bytes=50.0, forward_token_bytes=40.0, backward_token_bytes=10.0)
    grown = traffic.receiving(3.0)
    assert grown == LocalTraffic(180.0, 70.0, 120.0, 30.0)
    assert traffic.receiving(1.0) == traffic


@pytest.mark.parametrize("world_size", [4, 1])
def test_a_group_other_than_a_gloo_group_of_one_is_refused_in_one_line(world_size):
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        with pytest.raises(ConfigError) as refused:
            count_local_traffic("nccl", parse(DEBUG_JOB), MoEShape(64, 8, 3, 32), 32, torch.float32, False)
        assert str(refused.value) == (
            "counting a backend's local traffic needs a gloo process group of this process alone (or none): run "
            "the layout advisor outside a multi-process job")
    finally:
        dist.destroy_process_group()


def test_a_landing_that_finishes_a_library_kernel_is_not_counted(world_of_one):
    """DeepEP's combine lands the library's work (the reference kernels sum there on a CPU): the all-to-all's
    price holds it."""
    from torchtitan_ext.ep.kernels.calls import library_work

    rows, combined = torch.randn(8, 4), torch.empty(8, 4)

    def land():
        with library_work():
            combined.copy_(rows * 2)

    Landing(combined, land)
    with LocalTrafficCounter() as counter:
        in_flight(combined).trigger_wait()
        after = rows + 1  # counted again once the landing is over
    assert torch.equal(combined, rows * 2)
    assert counter.bytes == rows.nbytes + after.nbytes


def test_torchtitans_padding_for_grouped_gemms_is_counted_at_ep_1(world_of_one):
    """Without EP torchtitan pads each expert's rows for its grouped GEMMs: a gather of the rows into padded
    groups and a scatter back, each reading and writing at least every (token, expert) row."""
    shape, tokens = MoEShape(72, 8, 3, 64), 64
    call = MoECall.random(shape, tokens, torch.bfloat16)
    plain = sum(_counted(lambda: torchtitan_sort_forward(call, shape, False), tokens, 72)[:2])
    padded = sum(_counted(lambda: torchtitan_sort_forward(call, shape, False, 16), tokens, 72)[:2])
    rows = tokens * 3 * 72 * 2
    assert padded - plain >= 4 * rows


def test_counting_leaves_the_process_environment_as_it_was(world_of_one, monkeypatch):
    """HybridEP's buffer exports its library's environment (ranks per NVLink domain), as a training rank's must;
    the advisor's process, and every later job it starts, keeps its own."""
    monkeypatch.delenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", raising=False)
    job_config = parse([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep",
                        "--hybridep.ranks_per_nvlink_domain", "8"])
    count_local_traffic("hybridep", job_config, MoEShape(64, 8, 3, 32), 32, torch.float32, False)
    assert "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN" not in os.environ


def test_non_blocking_hybridep_is_counted_at_the_rows_a_rank_of_the_ep_group_allocates():
    """HybridEP's non-blocking dispatch allocates N x R x min(L, K) x factor rows at EP = R: the count in a
    group of one runs at the factor that allocates as many."""
    job_config = parse([*DEBUG_JOB, "--parallelism.expert_parallel_comm_backend", "hybridep",
                        "--hybridep.non_blocking_capacity_factor", "0.5"])
    shape = MoEShape(256, 64, 8, 4096)
    for ep in (2, 8, 32):
        factor = PLANNING_PROFILES["hybridep"].counted_settings(job_config, shape, ep)["non_blocking_capacity_factor"]
        assert non_blocking_rows(4096, 1, 64, 8, factor, 8) == non_blocking_rows(4096, ep, 64 // ep, 8, 0.5, 8)
    assert PLANNING_PROFILES["hybridep"].counted_settings(parse(DEBUG_JOB), shape, 8) == {}
    assert PLANNING_PROFILES["deepep"].counted_settings(job_config, shape, 8) == {}


def test_the_advisor_prices_the_counted_bytes_at_the_memory_bandwidth():
    topology = load_topology("hgx_h100_ib")
    layouts = [layout for layout in advise([*DEBUG_JOB, "--activation_checkpoint.mode", "full"], 4, topology)[0]
               if layout.refused is None]
    assert {layout.ep for layout in layouts} == {1, 2, 4}
    # the debug model: hidden 256, 8 experts, top-3, no expert groups; 4 x 256 tokens per rank, bf16 rows
    shape = MoEShape(256, 8, 3, 1024)
    for layout in layouts:
        if layout.ep > 1:
            counted = count_local_traffic(layout.backend, advised_config(
                [*DEBUG_JOB, "--activation_checkpoint.mode", "full"], 4, layout), shape, 1024, torch.bfloat16, False)
            assert layout.local_traffic == counted
        # DeepEP's received token vectors: one for each EP rank a token reaches (uniform routing, 8 experts)
        reached = layout.ep * (1 - math.comb(8 - 8 // layout.ep, 3) / math.comb(8, 3))
        once_per_rank = PLANNING_PROFILES[layout.backend].sends_each_token_once_per_rank and layout.ep > 1
        assert layout.received_tokens == pytest.approx(reached if once_per_rank else 1)
        traffic = layout.local_traffic.receiving(layout.received_tokens)
        assert layout.dispatch_work_s == pytest.approx(traffic.bytes / 3350e9)
        assert layout.dispatch_forward_share == traffic.forward_share
        # every MoE layer recomputed: its forward's passes run twice
        assert layout.local_work_s == pytest.approx(
            layout.moe_layers * layout.dispatches * layout.dispatch_work_s * (1 + traffic.forward_share))
    # at EP = 1 no backend runs: a layout there is priced at torchtitan's own sort around the experts and its
    # padding of each expert's rows (to token_group_alignment's multiple), counted here at the job's shape
    call = MoECall.random(shape, 1024, torch.bfloat16)
    alignment = token_group_alignment(parse(DEBUG_JOB))
    sort = _counted(lambda: torchtitan_sort_forward(call, shape, False, alignment), 1024, 256)
    at_ep_1 = [layout.local_traffic for layout in layouts if layout.ep == 1]
    assert at_ep_1
    for traffic in at_ep_1:
        assert dataclasses.astuple(traffic) == pytest.approx(sort, rel=1e-12)


def test_without_a_memory_bandwidth_nothing_is_priced():
    data = {"compute_tflops": 400.0, "overlap": True,
            "levels": [{"name": "node", "workers": 8, "bandwidth_GBps": 450.0, "latency_us": 3.0},
                       {"name": "net", "bandwidth_GBps": 50.0, "latency_us": 8.0}]}
    layouts = advise(DEBUG_JOB, 4, parse_topology(data, "test"))[0]
    assert all(layout.dispatch_work_s == 0 and layout.local_traffic is None for layout in layouts)


@pytest.mark.parametrize("holds_local_work", [True, False])
def test_a_rate_measured_with_the_local_work_is_not_priced_twice(holds_local_work):
    """bench_ep's rows time each backend's permutes with its all-to-alls: with such a measured rate the counted
    local work is not added again (an nccl-tests log times NCCL's all-to-all alone, and it is)."""
    topology = load_topology("hgx_h100_ib")
    job_config = parse(DEBUG_JOB)
    settings = PLANNING_PROFILES["nccl"].rate_settings(job_config)
    measured = {("nccl", settings, 0): MeasuredRate("nccl", settings, 0, 0.5, "test row", holds_local_work)}
    layouts = [layout for layout in advise(DEBUG_JOB, 4, topology, measured_rates=measured)[0] if layout.refused is None]
    for layout in layouts:
        held = holds_local_work and layout.backend == "nccl" and layout.ep > 1
        assert (layout.dispatch_work_s == 0 and layout.local_traffic is None) is held
    lines = format_advice(layouts, topology, 4, "debug", None, error=ERROR)
    said = paragraph(lines, "  local:")
    assert ("not counted for nccl: the rate measured on the cluster (--calibrate-from, bench_ep) holds it"
            in said) is holds_local_work
