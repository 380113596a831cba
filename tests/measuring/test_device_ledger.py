"""The device-cost ledger: it counts what it claims (a known host sync, collective, copy), and every backend stays
within the budget it declares, per MoE layer and pass, under every activation-checkpointing mode."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_distributed
from tests.models.gradient_cases import Cell, ledger_worker
from torchtitan_ext.ep.backends import CPU_VARIANTS
from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter
from torchtitan_ext.measuring.device_costs import OUTSIDE

AC_MODES = {
    "ac_none": (),
    "ac_full": ("--activation_checkpoint.mode", "full"),
    "ac_selective_op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
}
VARIANTS = CPU_VARIANTS
MOE_LAYERS = {"deepseek_v3": [1, 2, 3], "gpt_oss": [0, 1]}
"""The tiny models' MoE layers (tests/models/gradient_cases.py): DeepSeek-V3's first block is dense."""
REPLICAS_UNDER_CHECKPOINTING = ("nccl",)
"""The backends whose replicated layers are counted under each checkpointing mode, as in the gradient matrix: what
replication adds (the counts' all-gather, the fetch) is the replication layer's, the same around every backend, and
every backend is counted under each mode without replicas and with replicas without checkpointing."""


def _cell(model: str, backend: str, ac: str, replicas: int) -> Cell:
    return Cell(f"ledger{'_replicas2' if replicas else ''}_{ac}", model, backend, 2,
                ("--parallelism.expert_parallel_degree", "2", *AC_MODES[ac]), grouped_mm=True, replicas=replicas)


CELLS = [
    *(_cell("deepseek_v3", backend, ac, replicas) for replicas in (0, 2) for backend in VARIANTS for ac in AC_MODES
      if not replicas or ac == "ac_none" or backend in REPLICAS_UNDER_CHECKPOINTING),
    *(_cell("gpt_oss", backend, "ac_none", replicas) for replicas in (0, 2) for backend in VARIANTS),
]


def test_a_known_sync_collective_and_copy_are_counted_once(world_of_one):
    """So that a budget cannot be met by counting nothing; and what only reads host data is not a sync."""
    device_tensor = torch.arange(4)
    with DeviceCostCounter() as counter:
        device_tensor.sum().item()
        counts = device_tensor.cpu()
        counts.tolist()  # host data: no wait
        dist.all_reduce(device_tensor)
        torch.tensor([1, 2], device="cpu")  # Python data to the device: a blocking copy
    (costs,) = counter.costs.values()
    assert sorted(kind.split(" at ")[0] for kind in costs.host_syncs.elements()) == ["Tensor.cpu", "Tensor.item"]
    assert [(kind, size) for kind, _, size, _, _ in costs.collectives] == [("allreduce", 1)]
    assert sum(costs.h2d_copies.values()) == 1 and all(kind.startswith("blocking") for kind in costs.h2d_copies)


def test_an_output_shape_read_from_device_values_is_a_sync_and_a_given_one_is_not():
    device_values = torch.tensor([0, 2, 0, 3])  # made before the count: device memory
    with DeviceCostCounter() as counter:
        device_values.nonzero()
        torch.repeat_interleave(device_values, device_values, output_size=5)
        torch.repeat_interleave(device_values, device_values)
    (costs,) = counter.costs.values()
    assert sorted(kind.split(" at ")[0] for kind in costs.host_syncs.elements()) == [
        "aten.nonzero (output shape from device values)", "aten.repeat_interleave (output shape from device values)"]


@pytest.fixture(scope="module")
def ledgers():
    return run_distributed(2, ledger_worker, CELLS)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.id)
def test_every_moe_layer_stays_within_its_backends_budget(ledgers, cell):
    ledger = ledgers[0][cell.id]
    for rank in ledgers[1:]:
        for scope, paid in rank[cell.id].costs.items():
            ledger.costs[scope] = ledger.costs[scope].merged(paid) if scope in ledger.costs else paid
    assert ledger.over_budget() == []
    # every MoE layer was counted, forward and backward, and paid the backend's collectives
    assert ledger.layers() == MOE_LAYERS[cell.model]
    for layer in ledger.layers():
        for phase in ("forward", "backward"):
            paid = ledger.costs[layer, phase].collective_count(ledger.ep_group)
            assert paid == ledger.budget.of(phase).collectives, (layer, phase)
        recompute = ledger.costs.get((layer, "recompute"))
        assert (recompute is not None) == ("ac_none" not in cell.name), layer
    assert (OUTSIDE, "step") in ledger.costs


@pytest.mark.slow
def test_the_clis_step_with_replicas_chosen_by_the_trainer_stays_within_budget(tmp_path):
    """count_step (``python -m torchtitan_ext.ledger``'s path): the trainer's own chooser picks the replicas, so the
    first replicated step is counted with its plan just chosen. Its index tables are copied between steps, never
    inside a layer (a layer building them in its first replicated forward, two blocking copies, was found by hand
    with the CLI), and every layer fetches replicas (the counts' all-gather: not set aside), ahead of its dispatch,
    and waits for them after it. The first MoE layer fetches its own; each later one's fetch is issued by the layer
    before (double buffering) and charged to it, ahead of its own counts. The counted steps leave the job's dump
    folder alone (they truncated its metrics.jsonl)."""
    from torchtitan_ext.measuring.device_ledger import count_step

    job_folder = tmp_path / "the_jobs_own"
    ledger = count_step(["--job.config_file", "train_configs/debug_model.toml",
                         "--model.flavor", "debugmodel_small_3layers", "--training.seq_len", "64",
                         "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
                         "--expert_replication.slots_per_rank", "2",
                         "--expert_replication.adapt_every", "1", "--expert_replication.min_gain", "0",
                         "--job.dump_folder", str(job_folder)], 2)
    assert not job_folder.exists()
    assert ledger.over_budget() == []
    forwards = {layer: costs for (layer, phase), costs in ledger.costs.items() if layer != OUTSIDE and phase == "forward"}
    assert forwards == {layer: forwards[layer] for layer in (1, 2)}
    transport = "torchtitan_ext/ep/replication/transport.py"
    for layer, costs in forwards.items():
        assert not costs.h2d_copies and [kind for kind, *_ in costs.collectives].count("allgather") == 1
        issued = [(kind, caller.split(":")[0]) for kind, *_, caller in costs.collectives]
        # the counts' all-gather and the replicas' fetch (issued during the layer before, from layer 2 on), both
        # before the backend's dispatch
        counts, fetch = ("allgather", transport), ("alltoall_base", transport)
        assert issued[:2] == ([counts, fetch] if layer == 1 else [fetch, counts]), issued
        assert all(caller != transport for _, caller in issued[2:]), issued
        # and lands right before the experts: waited for once the dispatch (issued[2]) is issued, before the combine
        landed = [before for before, caller in costs.waits if caller.startswith("torchtitan_ext/ep/replication/")]
        assert landed == [3] and issued[3][1] == issued[2][1], (costs.waits, issued)
        assert costs.collective_count(ledger.ep_group) == ledger.budget.forward.collectives
    between_steps = ledger.costs[OUTSIDE, "step"].h2d_copies
    assert all(kind.startswith("non-blocking") for kind in between_steps if "torchtitan_ext/ep/" in kind)
    assert any("torchtitan_ext/ep/replica" in kind for kind in between_steps)


@pytest.mark.parametrize("backend", ["nccl", "hybridep"])
def test_a_moe_call_at_a_jobs_shape_counts_what_replication_adds(backend):
    """``ledger --moe-call`` of a job with replica slots counts, at its per-rank shape, the split (the backend is
    handed every rank's counts) and the replica weights: exactly the backend's budget less its counts' exchange
    plus replication's (which copies nothing to the device within a layer), and the largest weight copy one
    projection's L + S experts at the job's hidden sizes (extended from the two counted ones)."""
    from torchtitan_ext.config import parse
    from torchtitan_ext.config.job import meta_model
    from torchtitan_ext.measuring.device_ledger import EVERY_LAYER, moe_call_ledger

    job = ["--job.config_file", "train_configs/debug_model.toml", "--parallelism.expert_parallel_degree", "2",
           "--parallelism.expert_parallel_comm_backend", backend, "--training.mixed_precision_param", "float32"]
    replicated = parse([*job, "--expert_replication.slots_per_rank", "1"])
    if backend == "hybridep":
        replicated.hybridep.implementation = "reference"
    ledger = moe_call_ledger(replicated)
    assert ledger.over_budget() == []
    for phase in ("forward", "backward"):
        costs = ledger.costs[EVERY_LAYER, phase]
        assert costs.collective_count(ledger.ep_group) == ledger.budget.of(phase).collectives, phase
        assert sum(costs.h2d_copies.values()) == ledger.budget.of(phase).h2d_copies, phase
    forward = ledger.costs[EVERY_LAYER, "forward"]
    assert [kind for kind, *_ in forward.collectives].count("allgather") == 1
    experts = next(block.moe.experts for block in meta_model(replicated).layers.values() if block.moe_enabled)
    home, expert_bytes = experts.w1.shape[0] // 2, experts.w1[0].numel() * 4
    # one slot: the concatenation [L + 1, ...] of a projection outweighs the fetch's one expert of three
    assert forward.largest_weight_copy == (home + 1) * expert_bytes
