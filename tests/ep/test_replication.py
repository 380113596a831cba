"""Expert replication's mechanics: the per-step split, the plan, the replica weights' way out and back.

The split must give every copy an integer share summing to the expert's pairs and reach the least
possible busiest-rank load for its expert given the others (checked against brute force); every rank
must send each pair to a copy of its expert, with the copies taking exactly their quotas over all
ranks; replica weights must equal their home weights, and a replica's gradient must arrive home,
summed with the home's own.
"""

import itertools
import os
import random
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT, run_distributed, run_job
from torchtitan_ext.ep.replication.experts import exchange_arguments, redundancy_mapping, ReplicaExchange
from torchtitan_ext.ep.replication.plan import ReplicaPlan
from torchtitan_ext.ep.replication.split import split_quotas, SplitTables, SWEEPS, UNREACHABLE, water_fill

EP = 2


def _best_max(loads: list[int], amount: int) -> int:
    """The least max(loads + q) over all integer q >= 0 summing to amount (brute force)."""
    best = None
    for split in itertools.product(range(amount + 1), repeat=len(loads)):
        if sum(split) == amount:
            worst = max(load + share for load, share in zip(loads, split))
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_water_fill_is_optimal_and_exact(seed):
    generator = random.Random(seed)
    loads = [generator.randint(0, 9) for _ in range(generator.randint(1, 4))]
    amount = generator.randint(0, 12)
    shares = water_fill(torch.tensor(loads), torch.tensor(amount)).tolist()
    assert sum(shares) == amount and min(shares) >= 0, (loads, amount, shares)
    assert max(load + share for load, share in zip(loads, shares)) == _best_max(loads, amount), (loads, amount, shares)


def test_water_fill_breaks_ties_by_copy_order():
    assert water_fill(torch.tensor([5, 5, 5]), torch.tensor(2)).tolist() == [1, 1, 0]


def _loads(quotas: torch.Tensor, tables: SplitTables) -> list[int]:
    loads = [0] * tables.plan.expert_parallel_degree
    for home, ranks in enumerate(tables.copy_ranks):
        for copy, rank in enumerate(ranks):
            loads[rank] += int(quotas[home, copy])
    return loads


@pytest.mark.parametrize("seed", range(20))
def test_split_never_loads_a_rank_more_than_without_replicas(seed):
    generator = random.Random(seed)
    ranks, per_rank, slots = 4, 2, 2
    experts = ranks * per_rank
    counts = torch.tensor([generator.randint(0, 100) for _ in range(experts)])
    replicas = []
    for rank in range(ranks):
        others = [home for home in range(experts) if home // per_rank != rank]
        replicas.append(tuple(sorted(generator.sample(others, slots))))
    tables = SplitTables(ReplicaPlan(experts, ranks, tuple(replicas)), torch.device("cpu"))
    quotas = split_quotas(counts, tables)
    assert quotas.sum(1).tolist() == counts.tolist()
    assert (quotas >= 0).all()
    home_only = [int(counts[rank * per_rank:(rank + 1) * per_rank].sum()) for rank in range(ranks)]
    assert max(_loads(quotas, tables)) <= max(home_only)


def test_water_fill_fills_each_row_alone_and_never_a_padded_copy():
    generator = random.Random(0)
    loads = torch.tensor([[generator.randint(0, 50) for _ in range(4)] for _ in range(6)])
    loads[:, 3] = UNREACHABLE
    amounts = torch.tensor([generator.randint(0, 90) for _ in range(6)])
    batched = water_fill(loads, amounts)
    assert batched.tolist() == [water_fill(row, amount).tolist() for row, amount in zip(loads, amounts)]
    assert (batched[:, 3] == 0).all() and batched.sum(1).tolist() == amounts.tolist()


def _split_one_expert_at_a_time(counts: torch.Tensor, tables: SplitTables, order: list[int]) -> torch.Tensor:
    """The split's rule read literally: each replicated expert in ``order``, its copies water-filled alone."""
    quotas = torch.zeros(counts.shape[0], tables.width, dtype=torch.int64)
    quotas[:, 0] = counts
    loads = [0] * tables.plan.expert_parallel_degree
    for home, count in enumerate(counts.tolist()):
        loads[tables.copy_ranks[home][0]] += count
    for _ in range(SWEEPS):
        for home in order:
            ranks = tables.copy_ranks[home]
            others = [loads[rank] - int(quotas[home, copy]) for copy, rank in enumerate(ranks)]
            share = water_fill(torch.tensor(others), counts[home]).tolist()
            for copy, rank in enumerate(ranks):
                loads[rank] = others[copy] + share[copy]
                quotas[home, copy] = share[copy]
    return quotas


@pytest.mark.parametrize("seed", range(20))
def test_rounds_fill_disjoint_copies_at_once_as_one_at_a_time_would(seed):
    """A round's experts have copies on disjoint ranks, every replicated expert is in one round, and the
    batched split equals filling the experts one after another in the rounds' order."""
    generator = random.Random(seed)
    ranks, per_rank = generator.choice([(4, 2), (8, 2), (8, 4)])
    slots = generator.randint(1, 3)
    experts = ranks * per_rank
    replicas = []
    for rank in range(ranks):
        others = [home for home in range(experts) if home // per_rank != rank]
        replicas.append(tuple(sorted(generator.sample(others, slots))))
    tables = SplitTables(ReplicaPlan(experts, ranks, tuple(replicas)), torch.device("cpu"))
    order = [int(home) for homes, _, _ in tables.rounds for home in homes]
    assert sorted(order) == tables.replicated
    for homes, at, real in tables.rounds:
        used = [int(rank) for rank in at[real]]
        assert len(used) == len(set(used))
    counts = torch.tensor([generator.randint(0, 500) for _ in range(experts)])
    assert split_quotas(counts, tables).tolist() == _split_one_expert_at_a_time(counts, tables, order).tolist()


def _one_kernel_against_rounds() -> None:
    """Run under ``TRITON_INTERPRET=1``: the split in one Triton kernel (a GPU's) equals the rounds' operators on
    random plans (EP 2-16, zero counts among them) and at DeepSeek-V3's EP=64 with 2 slots, in as many operators at
    every EP degree."""
    from torchtitan_ext.bench.replica_split import OperatorCount
    from torchtitan_ext.ep.replication.choice import choose_replicas

    generator = random.Random(0)
    operators = set()
    cases = [(ranks, per_rank, generator.randint(1, 3)) for ranks, per_rank in ((2, 4), (4, 2), (8, 2), (8, 4), (16, 2))
             ] + [(64, 4, 2)]
    for ranks, per_rank, slots in cases:
        experts = ranks * per_rank
        counts = torch.tensor([generator.randint(0, 500) * generator.choice([0, 1, 1]) for _ in range(experts)])
        counts[0] = 4000  # one hot expert, so the choice copies it widely
        tables = SplitTables(choose_replicas(counts.tolist(), ranks, slots), torch.device("cpu"))
        step = counts[torch.randperm(experts, generator=torch.Generator().manual_seed(ranks))]  # a later step's
        with OperatorCount() as counted:
            in_one_kernel = split_quotas(step, tables, in_one_kernel=True)
        operators.add(counted.count)
        assert torch.equal(in_one_kernel, split_quotas(step, tables, in_one_kernel=False)), (ranks, per_rank, slots)
    assert len(operators) == 1, operators


@pytest.mark.slow
def test_the_split_in_one_kernel_equals_the_rounds():
    """Triton's interpreter runs the kernel on the CPU, in a process of its own: it must be chosen before Triton is
    imported."""
    run_job([sys.executable, "-c", f"from {__name__} import _one_kernel_against_rounds as check; check()"],
            timeout_s=300, cwd=REPO_ROOT, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)})


def test_split_of_one_hot_expert_over_two_ranks():
    """Expert 0 (rank 0) takes 100 pairs, the others 10 each; with a copy on rank 1 the two ranks even out."""
    plan = ReplicaPlan(4, 2, ((-1,), (0,)))
    tables = SplitTables(plan, torch.device("cpu"))
    quotas = split_quotas(torch.tensor([100, 10, 10, 10]), tables)
    assert _loads(quotas, tables) == [65, 65]


@pytest.mark.parametrize("replicas, message", [
    (((0,), (-1,)), "rank 0's replicas (0,): each another"),
    (((2, 2), (-1, -1)), "rank 0's replicas (2, 2): each another"),
    (((9,), (-1,)), "rank 0's replicas (9,): each another"),
    (((3, 2), (-1, 0)), "rank 0's replicas (3, 2): in ascending home slot, the unused (-1) last: (2, 3)"),
    (((2, 3), (-1, 0)), "rank 1's replicas (-1, 0): in ascending home slot, the unused (-1) last: (0, -1)"),
])
def test_a_plan_copies_other_ranks_experts_once_each_in_the_order_received(replicas, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplicaPlan(4, 2, replicas)


def test_exchange_arguments_pair_up_across_ranks():
    """What rank s sends to rank d, in order, is what d's replica slots hold from s, in the slots where the
    all-to-all lands it (the sources' in rank order); each rank's experts sent are listed once, ascending (their
    gradients' sums)."""
    plan = ReplicaPlan(8, 4, ((2, 5), (0, -1), (1, 7), (3, -1)))
    per_rank = plan.experts_per_rank
    arguments = [exchange_arguments(plan, rank) for rank in range(4)]
    assert [arguments[rank][3].tolist() for rank in range(4)] == [[0, 1], [0, 1], [1], [1]]
    for source in range(4):
        send_local, send_counts, *_ = arguments[source]
        offsets = [sum(send_counts[:d]) for d in range(4)]
        for destination in range(4):
            sent = send_local[offsets[destination]:offsets[destination] + send_counts[destination]]
            recv_counts = arguments[destination][2]
            start = sum(recv_counts[:source])
            landed = plan.replicas[destination][start:start + recv_counts[source]]
            assert list(landed) == [source * per_rank + s for s in sent]


def _assign_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from torchtitan_ext.ep.replication.split import ReplicaRouter

    plan = ReplicaPlan(4, world_size, ((2,), (0,)))
    router = ReplicaRouter(plan, dist.group.WORLD)
    generator = torch.Generator().manual_seed(rank)
    home_slots = torch.multinomial(torch.tensor([8.0, 1.0, 2.0, 1.0]), 60, replacement=True, generator=generator)
    home_slots = home_slots.view(20, 3)
    router.closes_window = True
    dispatched, sent = router.assign(home_slots, counting=True)
    window, _ = router.take_copied_window()
    return {"home": home_slots, "dispatched": dispatched, "quotas": router.last_quotas,
            "window": window, "copies": plan.copies(), "sent": sent, "dispatched_experts": plan.dispatched_experts}


@pytest.mark.slow
def test_every_pair_goes_to_a_copy_of_its_expert_and_every_rank_knows_what_each_copy_receives():
    results = run_distributed(EP, _assign_worker)
    copies = results[0]["copies"]
    quotas = results[0]["quotas"]
    taken = {}
    for result in results:
        assert torch.equal(result["quotas"], quotas), "every rank computes the same split"
        for home, dispatched in zip(result["home"].reshape(-1).tolist(), result["dispatched"].reshape(-1).tolist()):
            slots = [slot for _, slot in copies[home]]
            assert dispatched in slots, (home, dispatched)
            taken[home, slots.index(dispatched)] = taken.get((home, slots.index(dispatched)), 0) + 1
    for home, home_copies in enumerate(copies):
        for copy in range(len(home_copies)):
            assert taken.get((home, copy), 0) == int(quotas[home, copy]), (home, copy)
    totals = sum(torch.bincount(result["home"].reshape(-1), minlength=4) for result in results)
    assert torch.equal(results[0]["window"], totals)
    assert int(quotas[0, 1]) > 0, "the hot expert's copy takes pairs"
    # what every rank sends each copy, known on every rank without an exchange (nccl skips its counts' all-to-all)
    sent = torch.stack([torch.bincount(result["dispatched"].reshape(-1), minlength=results[0]["dispatched_experts"])
                        for result in results])
    for result in results:
        assert torch.equal(result["sent"], sent)


def _two_weights(rank: int) -> list[torch.Tensor]:
    """Two experts per rank, in two bf16 weights of different shapes (as w1, w2, w3 are), integers that bf16 holds
    exactly."""
    return [torch.arange(2 * 3, dtype=torch.bfloat16).view(2, 3).add(100 * rank),
            torch.arange(2 * 2, dtype=torch.bfloat16).view(2, 2, 1).add(100 * rank).neg()]


FETCH_PLAN = ((4, 5), (0, 4), (1, 3))
"""3 ranks of 2 experts, 2 slots each: ranks 1 and 2 receive from two ranks each; rank 2's expert 4 has two
copies, and the gradients arriving at rank 2 (experts 4, 5, 4) are more rows than its 2 slots."""


def _weights_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_process_group_name

    from torchtitan_ext.ep.replication.experts import with_replicas

    plan = ReplicaPlan(6, world_size, FETCH_PLAN)
    home = [weight.requires_grad_() for weight in _two_weights(rank)]
    weights = with_replicas(home, exchange_arguments(plan, rank), redundancy_mapping(plan), 2,
                            _get_process_group_name(dist.group.WORLD))
    fetched = torch.cat([projection[2:].reshape(2, -1) for projection in weights], dim=1)
    per_slot = torch.tensor([[1.0], [10.0]], dtype=torch.bfloat16)
    ((fetched * per_slot).sum() + 3 * sum(projection[:2].sum() for projection in weights)).backward()
    return {"weights": [weight.detach() for weight in weights], "fetched": fetched.detach(),
            "grads": [weight.grad for weight in home]}


@pytest.mark.slow
def test_replica_weights_equal_home_and_gradients_return_home():
    """Each projection's weights are its home experts' followed by the fetched ones, each fetched row its expert's
    weights flattened one after the other (read from the home weights where they lie, received from two ranks into
    the slots themselves); each home weight gets its own gradient plus its copies', summed in fp32 a slot's count
    of rows at a time."""
    ranks = len(FETCH_PLAN)
    results = run_distributed(ranks, _weights_worker)
    home = [_two_weights(rank) for rank in range(ranks)]

    def expert(rank: int, local: int) -> torch.Tensor:
        return torch.cat([weight[local].reshape(-1) for weight in home[rank]])

    assert torch.equal(results[0]["fetched"], torch.stack([expert(2, 0), expert(2, 1)]))
    assert torch.equal(results[1]["fetched"], torch.stack([expert(0, 0), expert(2, 0)]))
    assert torch.equal(results[2]["fetched"], torch.stack([expert(0, 1), expert(1, 1)]))
    for rank in range(ranks):
        for weights, own in zip(results[rank]["weights"], home[rank]):
            assert torch.equal(weights[:2], own)
    # each home expert's own gradient is 3, and 1 more from a copy in a slot 0, 10 from one in a slot 1: experts 0
    # and 1 are in slots 0, expert 2 nowhere, experts 3 and 5 in slots 1, expert 4 in a slot 0 and a slot 1
    for rank, per_expert in ((0, [4.0, 4.0]), (1, [3.0, 13.0]), (2, [14.0, 13.0])):
        for grad, weight in zip(results[rank]["grads"], home[rank]):
            expected = torch.tensor(per_expert, dtype=weight.dtype).view(2, *[1] * (weight.dim() - 1))
            assert torch.equal(grad, expected.expand_as(weight))


def _host_sync_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_process_group_name

    from tests.ep.double_cases import waits_and_collectives
    from torchtitan_ext.ep.replication.split import ReplicaRouter
    from torchtitan_ext.ep.replication.experts import with_replicas
    from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter

    plan = ReplicaPlan(4, world_size, ((2,), (0,)))
    router = ReplicaRouter(plan, dist.group.WORLD)
    home_slots = torch.tensor([[0, 1], [0, 2], [3, 0]])
    home = torch.randn(2, 6, requires_grad=True)
    router.assign(home_slots, counting=True)  # builds the plan's tables outside the count
    counter = DeviceCostCounter()
    with counter:
        router.assign(home_slots, counting=True)
        weights = with_replicas([home], exchange_arguments(plan, rank), redundancy_mapping(plan), 1,
                                _get_process_group_name(dist.group.WORLD))
        weights[0].sum().backward()
    return waits_and_collectives(counter)


@pytest.mark.slow
def test_the_split_and_the_replica_weights_never_make_the_host_wait():
    """The per-step split and the weights' way out and back issue their collectives and nothing that
    reads the device from the host (the count exchange is one all-gather)."""
    for events in run_distributed(EP, _host_sync_worker):
        assert events == {"allgather": 1, "alltoall_base": 2}, events


def test_the_gradients_of_four_copies_are_summed_in_fp32_and_rounded_once(world_of_one):
    """On a GPU index_add_ adds one copy at a time in the tensor's dtype (atomics): in bf16, 1 + 2**-8 rounds to 1,
    and small gradients vanish beside a large one. The copies' gradients come home summed into an fp32 tensor (on a
    CPU index_add_ accumulates in fp32 whatever the dtype, so the sums' dtype is what is checked) and are added to
    the expert's own gradient in fp32, rounded once: 1 + 2**-8 + 2**-16 rounds to 1 + 2**-7, where rounding the
    copies' sum to bf16 first (2**-8) or adding them one at a time gives 1. Copies sent in any order sum into their
    own expert's gradient; an expert not sent keeps its own."""
    from torch.distributed.distributed_c10d import _get_process_group_name
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_ext.ep.replication.experts import with_replicas

    class SumDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.torchtitan_ext.replica_gradients:
                self.dtypes.append(out.dtype)
            return out

    home = torch.zeros(3, 1, dtype=torch.bfloat16, requires_grad=True)
    send_local = torch.tensor([2, 0, 2, 2, 2])  # four copies of expert 2, one of expert 0, none of expert 1
    copies = len(send_local)
    exchange = ReplicaExchange(send_local, [copies], [copies], torch.tensor([0, 2]))
    mapping = torch.zeros(1, copies, dtype=torch.int32)
    (weights,) = with_replicas([home], exchange, mapping, copies, _get_process_group_name(world_of_one))
    with SumDtypes() as sums:
        # the home experts' own gradients (7, 3, 1), then the five copies' (expert 2, 0, 2, 2, 2)
        weights.backward(torch.tensor([[7.0], [3.0], [1.0], [2**-9], [5.0], [2**-9], [2**-16], [0.0]],
                                      dtype=torch.bfloat16))
    assert sums.dtypes == [torch.float32]
    assert home.grad[:, 0].tolist() == [12.0, 3.0, 1 + 2**-7]


def test_the_gradients_of_fp64_copies_are_summed_in_fp64(world_of_one):
    """Copies' fp64 gradients come home summed in fp64: 2**-40 beside 1 survives, where an fp32 sum drops it."""
    from torch.distributed.distributed_c10d import _get_process_group_name

    from torchtitan_ext.ep.replication.experts import with_replicas

    home = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    exchange = ReplicaExchange(torch.tensor([0, 0]), [2], [2], torch.tensor([0]))
    (weights,) = with_replicas([home], exchange, torch.zeros(1, 2, dtype=torch.int32), 2,
                               _get_process_group_name(world_of_one))
    weights.backward(torch.tensor([[0.0], [1.0], [2**-40]], dtype=torch.float64))
    assert home.grad.dtype == torch.float64 and home.grad.item() == 1 + 2**-40


def test_a_layer_without_replicas_computes_its_home_experts_alone(world_of_one):
    """Before the first choice, or when the choice is set aside, no slot holds a replica: the layer fetches
    nothing and returns no gradient (no collective at all), and its output is its home experts' on their pairs
    (the slots' zero rows are padding)."""
    from torchtitan.models.moe.moe import _run_experts_for_loop, GroupedExperts

    from torchtitan_ext.ep.replication.experts import ExpertsWithReplicas
    from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter

    torch.manual_seed(0)
    experts = GroupedExperts(dim=4, hidden_dim=6, num_experts=2, use_grouped_mm=False)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight)
    expected = _run_experts_for_loop(experts.w1, experts.w2, experts.w3, torch.ones(5, 4), torch.tensor([3, 2]))
    ExpertsWithReplicas.adopt(experts, ReplicaPlan.empty(4, EP, 1), world_of_one)
    counter = DeviceCostCounter()
    with counter:
        out = experts(torch.ones(5, 4), torch.tensor([3, 2, 0]))
        out.sum().backward()
    assert torch.equal(out, expected)
    assert [costs.collectives for costs in counter.costs.values()] == [[]]
    assert experts.w1.grad is not None


def _two_replicated_layers(group) -> list:
    """Two layers of 2 experts in a group of one, each with slot 0 a copy of its expert 1 (set by hand: no plan
    copies a rank's own), linked so that the first fetches the second's replicas ahead."""
    from torchtitan.models.moe.moe import GroupedExperts

    from torchtitan_ext.ep.replication.experts import ExpertsWithReplicas

    layers = []
    for _ in range(2):
        experts = GroupedExperts(dim=4, hidden_dim=6, num_experts=2, use_grouped_mm=False)
        for weight in (experts.w1, experts.w2, experts.w3):
            torch.nn.init.normal_(weight)
        ExpertsWithReplicas.adopt(experts, ReplicaPlan.empty(2, 1, 1), group)
        experts.exchange = ReplicaExchange(torch.tensor([1]), [1], [1], torch.tensor([1]))
        experts.redundancy_mapping, experts.holds_replicas = torch.tensor([[1]], dtype=torch.int32), True
        layers.append(experts)
    return layers


@pytest.mark.parametrize("after_experts", [False, True], ids=["after_the_dispatch", "after_the_combine"])
def test_the_next_layers_fetch_is_issued_where_the_link_says(world_of_one, after_experts):
    """Once the dispatch is issued, or once the combine is (where the next experts are gathered by FSDP across
    ranks), and only then, the first layer issues the second's fetch, which the second then does not repeat."""
    from torchtitan_ext.ep.replication.experts import link_fetch_ahead

    first, second = _two_replicated_layers(world_of_one)
    link_fetch_ahead([first, second], after_experts=after_experts)
    first.queue_replica_fetch()
    first.fetch_following_ahead(experts_queued=not after_experts)
    assert second.fetched is None
    first.fetch_following_ahead(experts_queued=after_experts)
    ahead = second.fetched
    second.queue_replica_fetch()
    assert second.fetched is ahead
    landed = torch.ops._c10d_functional.wait_tensor(ahead)
    assert torch.equal(landed[0, :second.w1[1].numel()], second.w1[1].flatten())
    torch.ops._c10d_functional.wait_tensor(first.fetched)


def test_a_fetch_left_in_flight_by_a_stopped_forward_is_never_used(world_of_one):
    """A forward stopped between the first layer's dispatch and the second layer's experts (an exception its caller
    caught) leaves the second's replicas in flight, fetched from weights the optimizer step then changes: the next
    forward's first layer lands and drops them, and the second layer's fetch reads its weights as they are."""
    from torchtitan_ext.ep.replication.experts import link_fetch_ahead

    first, second = _two_replicated_layers(world_of_one)
    link_fetch_ahead([first, second], after_experts=False)
    first.queue_replica_fetch()
    first.fetch_following_ahead(experts_queued=False)
    stale = second.fetched
    with torch.no_grad():
        second.w1.add_(1.0)
    first.queue_replica_fetch()
    first.fetch_following_ahead(experts_queued=False)
    assert second.fetched is not stale
    landed = torch.ops._c10d_functional.wait_tensor(second.fetched)
    assert torch.equal(landed[0, :second.w1[1].numel()], second.w1[1].flatten())
    torch.ops._c10d_functional.wait_tensor(first.fetched)


@pytest.mark.parametrize("form", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("converter", ["quantize.grouped_mm.mx", "quantize.grouped_mm.float8"])
def test_a_replica_computes_its_home_experts_low_precision_gemms(world_of_one, converter, form):
    """Low-precision experts (the converter's recipe, emulated on a CPU), torchtitan's bias-free SwiGLU ones and
    GPT-OSS's (two weights, their biases, the clamped SwiGLU): the home experts and a replica slot compute the
    quantized GEMMs on the concatenated weights, as one model holding the copy would (the recipe's independent
    reference, tests/models/), and the replica's gradients, its biases' too, arrive home, summed with the home
    expert's own."""
    from torchtitan.models.moe.moe import GroupedExperts

    from tests.models.test_low_precision_experts import _recipe, REFERENCES, SWIGLU_LIMIT
    from torchtitan_ext.ep.experts import GptOssExperts
    from torchtitan_ext.ep.replication.experts import ExpertsWithReplicas, GptOssExpertsWithReplicas

    torch.manual_seed(0)
    if form == "swiglu":
        experts = GroupedExperts(dim=64, hidden_dim=64, num_experts=2, use_grouped_mm=False)
        replica_class = ExpertsWithReplicas
        plain = {name: torch.randn(2, 64, 64) * 0.1 for name in ("w1", "w2", "w3")}
        reference = REFERENCES[converter].experts
    else:
        experts = GptOssExperts(dim=64, hidden_dim=64, num_experts=2, swiglu_limit=SWIGLU_LIMIT, use_grouped_mm=True)
        replica_class = GptOssExpertsWithReplicas
        shapes = {"mlp1_weight": (2, 128, 64), "mlp1_bias": (2, 128), "mlp2_weight": (2, 64, 64), "mlp2_bias": (2, 64)}
        plain = {name: torch.randn(shape) * 0.1 for name, shape in shapes.items()}

        def reference(*leaves):
            return REFERENCES[converter].gpt_oss_experts(*leaves[:4], SWIGLU_LIMIT, *leaves[4:])
    for name, weight in plain.items():
        setattr(experts, name, torch.nn.Parameter(weight.clone()))
    experts.low_precision = _recipe(converter)
    replica_class.adopt(experts, ReplicaPlan.empty(2, 1, 1), world_of_one)
    # in a group of one, slot 0 holds a copy of the rank's own expert 1 (no plan copies its own: set by hand)
    experts.exchange = ReplicaExchange(torch.tensor([1]), [1], [1], torch.tensor([1]))
    experts.redundancy_mapping, experts.holds_replicas = torch.tensor([[1]], dtype=torch.int32), True
    x = torch.randn(96, 64)
    per_group = torch.tensor([32, 32, 32])
    out = experts(x, per_group)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    one_model = {name: torch.cat([weight, weight[1:]]).requires_grad_() for name, weight in plain.items()}
    expected = reference(*one_model.values(), x, per_group)
    expected.backward(grad_out)
    assert torch.allclose(out, expected, rtol=0, atol=1e-3 * float(expected.abs().max()))
    for name, copy in one_model.items():
        grad = copy.grad
        home = torch.stack([grad[0], grad[1] + grad[2]])
        assert torch.allclose(getattr(experts, name).grad, home, rtol=0, atol=1e-3 * float(home.abs().max())), name
