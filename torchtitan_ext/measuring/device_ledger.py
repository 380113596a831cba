"""The device-cost ledger: what one training step pays a GPU, counted on any device, per MoE layer and pass.

:func:`count_step` runs one training step of a job on every rank under the
:class:`~.device_cost_counter.DeviceCostCounter`; :func:`count_moe_call` counts one MoE call at a job's shape;
:func:`format_ledger` prints the table (``python -m torchtitan_ext.ledger``). The budgets the backends and features
declare are :class:`~torchtitan_ext.ep.budget.DeviceBudget` (docs/device_costs.md).
"""


import os
import tempfile
from unittest.mock import patch
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from torchtitan_ext.ep import backend_class
from torchtitan_ext.ep.budget import Budget, DeviceBudget
from torchtitan_ext.ep.experts import ROUTED_EXPERTS
from torchtitan_ext.ep.kernels import calls
from torchtitan_ext.measuring.device_cost_counter import DeviceCostCounter
from torchtitan_ext.measuring.device_costs import Costs, LayerScopes, OUTSIDE, PASSES


COUNTED_STEP = 2
"""The step counted: the first builds what a job builds once (kernel buffers, tables); the second is every step's.
Under expert replication, the first step with replicas (when its plan is chosen and its tables copied)."""


@dataclass
class Ledger:
    """One counted training step: costs per (MoE layer or :data:`OUTSIDE`, pass), the most any rank paid."""

    costs: dict[tuple, Costs]
    ep_group: str
    """The EP group's name (collectives on it are the backends'); "" without expert parallelism."""
    budget: DeviceBudget | None
    """The job's MoE layer budget: its backend's plus its features'; None without expert parallelism."""
    saves_collectives: bool
    """Whether activation checkpointing's recompute saves the backend's collectives (per-op selective)."""

    def paid_by(self, source: str) -> Budget:
        """What the code of ``source`` (a file, "torchtitan_ext/training/faults.py") paid outside the MoE layers."""
        costs = self.costs.get((OUTSIDE, "step"), Costs())
        return Budget(
            sum(count for kind, count in costs.host_syncs.items() if kind.endswith(f" at {source}") or
                f" at {source}:" in kind),
            sum(1 for *_, caller in costs.collectives if caller.startswith(f"{source}:")),
            sum(count for kind, count in costs.h2d_copies.items() if source in kind),
        )

    def layers(self) -> list[int]:
        return sorted({scope for scope, _ in self.costs if scope != OUTSIDE})

    def over_budget(self) -> list[str]:
        """One line per MoE layer and pass, and per feature outside them, that pays more than its budget allows."""
        found = []
        for source, allowed in step_budgets().items():
            paid = self.paid_by(source)
            if any(getattr(paid, f) > getattr(allowed, f) for f in ("host_syncs", "collectives", "h2d_copies")):
                found.append(f"{source}: {paid} outside the MoE layers, budget {allowed}")
        if self.budget is None:
            return found
        for (layer, phase), costs in sorted(self.costs.items(), key=str):
            if layer == OUTSIDE:
                continue
            allowed = self.budget.of(phase, self.saves_collectives)
            non_blocking = sum(count for kind, count in costs.h2d_copies.items() if kind.startswith("non-blocking"))
            paid = Budget(costs.syncs, costs.collective_count(self.ep_group), non_blocking)
            blocking = sum(count for kind, count in costs.h2d_copies.items() if kind.startswith("blocking"))
            if blocking or any(getattr(paid, f) > getattr(allowed, f) for f in ("host_syncs", "collectives", "h2d_copies")):
                found.append(f"MoE layer {layer} {phase}: {paid} and {blocking} blocking host-to-device copies, "
                             f"budget {allowed}: {dict(costs.host_syncs)}, {costs.collectives}, {dict(costs.kernel_calls)}")
        return found


def _count_worker(rank: int, world_size: int, train_args: list[str], device_type: str, dump_folder: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.data import prepare_embedded_assets
    from torchtitan_ext.training import prepare
    from torchtitan_ext.training.trainer import Trainer

    prepare()
    job_config = load_job_config(train_args, device_type, world_size)
    job_config.metrics.log_freq = 1  # the counted step is a logged one
    job_config.checkpoint.enable = False
    # the counted steps' metrics (and any trace or statistics the job records) are not the job's: its own
    # metrics.jsonl would lose its rows
    job_config.job.dump_folder = dump_folder
    prepare_embedded_assets(job_config)
    trainer = Trainer(job_config)
    chooser = trainer.replica_chooser
    counted_step = COUNTED_STEP if chooser is None else max(COUNTED_STEP, chooser.first_replicated_step)
    job_config.training.steps = counted_step
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, tuple(ROUTED_EXPERTS)):
                # as on a GPU with grouped GEMMs (SM90+): torchtitan's loop, where they are missing, reads the
                # group sizes on the host
                module.use_grouped_mm = True
    counted: dict[tuple, Costs] = {}
    train_step = trainer.train_step

    def counting_step(data_iterator):
        if trainer.step != counted_step:
            return train_step(data_iterator)
        scopes = LayerScopes(trainer.model_parts)
        counter = DeviceCostCounter(scopes, trainer.model_parts, device_type)
        try:
            with counter:
                train_step(data_iterator)
        finally:
            scopes.remove()
        counted.update(counter.costs)

    trainer.train_step = counting_step
    try:
        trainer.train()
    finally:
        trainer.close()
    ep_mesh = trainer.parallel_dims.get_optional_mesh("ep")
    return {"costs": counted, "ep_group": ep_mesh.get_group().group_name if ep_mesh is not None else ""}


def count_step(train_args: list[str], world_size: int, device_type: str = "cpu") -> Ledger:
    """The ledger of one training step of the job ``train_args`` on ``world_size`` processes of this machine; the
    steps write nothing into the job's dump folder."""
    from torchtitan_ext.config import parse
    from torchtitan_ext.runtime.workers import run_workers

    with tempfile.TemporaryDirectory() as dump_folder:
        ranks = run_workers(world_size, _count_worker, train_args, device_type, dump_folder, device=device_type)
    costs: dict[tuple, Costs] = {}
    for rank in ranks:
        for scope, paid in rank["costs"].items():
            costs[scope] = costs[scope].merged(paid) if scope in costs else paid
    job_config = parse(train_args)
    ac = job_config.activation_checkpoint
    budget = job_budget(job_config) if ranks[0]["ep_group"] else None
    return Ledger(costs, ranks[0]["ep_group"], budget,
                  saves_collectives=ac.mode == "selective" and ac.selective_ac_option == "op")


class _ReplicatedCall:
    """What expert replication adds to one MoE call at a job's per-rank shape, in a group of one.

    The split runs on the job's own plan shape (its experts, EP degree and slots; each rank copying the next
    ranks' first experts) with this process as rank 0, so its operations are a rank's at that degree; the backend
    is handed every rank's counts from it, as in training. The replica weights are one rank's: its L home experts
    and S slots, each of the model's expert parameters at its shape, fetched from this process and their gradients
    returned to it, S experts each way (what a rank sends on average)."""

    def __init__(self, job_config, shape, group, device: torch.device, dtype: torch.dtype):
        from torch.distributed.distributed_c10d import _get_process_group_name

        from torchtitan_ext.config.job import shared_meta_model
        from torchtitan_ext.ep.replication.experts import ReplicaExchange
        from torchtitan_ext.ep.replication.split import ReplicaRouter
        from torchtitan_ext.ep.replication.plan import ReplicaPlan

        slots = job_config.expert_replication.slots_per_rank
        ep = job_config.parallelism.expert_parallel_degree
        experts = shape.num_experts - ep * slots  # the shape is the one dispatched over: every rank's slots too
        home_experts = experts // ep
        plan = ReplicaPlan(experts, ep, tuple(
            tuple(sorted(((rank + 1) * home_experts + j) % experts for j in range(slots))) for rank in range(ep)))
        self.router = ReplicaRouter(plan, group)
        # one home tensor per parameter of the model's experts (w1, w2, w3; GPT-OSS's weights and biases)
        expert = next(block.moe.experts for block in shared_meta_model(job_config).layers.values() if block.moe_enabled)
        self.home = [torch.nn.Parameter(torch.randn(home_experts, *weight.shape[1:], dtype=dtype, device=device))
                     for weight in expert.parameters()]
        copies = torch.arange(slots, device=device) % home_experts
        self.exchange = ReplicaExchange(copies, [slots], [slots], copies.unique())
        self.redundancy_mapping = copies.to(torch.int32).view(1, slots)
        self.slots, self.group_name = slots, _get_process_group_name(group)

    def fetch(self) -> torch.Tensor:
        from torchtitan_ext.ep.replication.experts import fetch_replicas

        return fetch_replicas(self.home, self.exchange, self.redundancy_mapping, self.slots, self.group_name)

    def weights(self, fetched: torch.Tensor) -> list[torch.Tensor]:
        from torchtitan_ext.ep.replication.experts import with_replicas

        return with_replicas(self.home, self.exchange, self.redundancy_mapping, self.slots, self.group_name, fetched)


def count_moe_call(job_config, shape, call, group, sync_debug: bool = False) -> dict[str, Costs]:
    """{"forward": costs, "backward": costs} of one MoE call of the job's backend in ``group`` (its dispatch and
    combine, the experts as the identity, and under expert replication the split and the replica weights
    (:class:`_ReplicatedCall`)), counted after one that builds what a job builds once. ``shape``: the one the
    backend dispatches over (under replication, every rank's slots too); ``call``: a
    :class:`~torchtitan_ext.planning.local_traffic.MoECall` on the group's device, picking logical experts.

    ``sync_debug`` (CUDA): the passes whose budget has no host sync run under ``torch.cuda.set_sync_debug_mode
    ("error")`` outside the kernel library's calls, so that a sync the count missed fails them."""
    from torchtitan_ext.planning.local_traffic import backend_forward

    backend = backend_class(job_config)
    budget = job_budget(job_config)
    style = backend.layer_factory(job_config, shape)(score_before_experts=False)
    replicated = None
    if job_config.expert_replication.slots_per_rank:
        replicated = _ReplicatedCall(job_config, shape, group, call.x.device, call.x.dtype)

    def forward() -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The call's output (landed) and the replica weights the experts would compute with."""
        expert_ids, sent_counts, fetched = call.expert_ids, None, None
        if replicated is not None:
            expert_ids, sent_counts = replicated.router.assign(call.expert_ids, counting=True)
            fetched = replicated.fetch()  # ahead of the dispatch, as the experts' pre-hook queues it
        out = backend_forward(style, call, shape, group, expert_ids, sent_counts)
        if isinstance(out, AsyncCollectiveTensor):
            out = out.trigger_wait()  # an in-flight combine lands (sums its rows) inside the pass
        return out.float(), [] if replicated is None else replicated.weights(fetched)

    def backward(out: torch.Tensor, weights: list[torch.Tensor], gradients: list[torch.Tensor]) -> None:
        if replicated is not None:
            # as after the optimizer's zero_grad: autograd takes the gradient over instead of adding to one
            for weight in replicated.home:
                weight.grad = None
        torch.autograd.backward([out.sum(), *weights], [None, *gradients])

    out, weights = forward()
    gradients = [torch.ones_like(weight) for weight in weights]
    backward(out, weights, gradients)
    device_type = call.x.device.type
    costs = {}
    for phase in ("forward", "backward"):
        counter = DeviceCostCounter(device_type=device_type)
        checking = sync_debug and getattr(budget, phase).host_syncs == 0
        with counter, _sync_errors(checking):
            if phase == "forward":
                out, weights = forward()
            else:
                backward(out, weights, gradients)
        costs[phase] = counter.costs[OUTSIDE, "step"]
    return costs


def count_job_moe_call(job_config) -> dict[str, Costs]:
    """{"forward", "backward": costs} of one MoE call of the job's backend at the job's per-rank shape (tokens per
    rank, experts, top-k), in a gloo group of this process alone: for a job this machine cannot run (its model, its
    ranks). Counts of host syncs, copies, collectives and kernel calls are a group's of any size (each backend
    issues the same calls at every EP degree); bytes grow with the hidden size and the rest does not, so they are
    counted at two small hidden sizes and extended to the job's, as the local traffic is
    (:func:`~torchtitan_ext.planning.local_traffic.counted_hidden_sizes`)."""
    from dataclasses import replace

    from torchtitan.config import TORCH_DTYPE_MAP

    from torchtitan_ext.config import moe_shape
    from torchtitan_ext.ep.replication.plan import dispatched_shape
    from torchtitan_ext.planning.local_traffic import counted_hidden_sizes, MoECall

    logical = moe_shape(job_config)
    shape = dispatched_shape(job_config, logical)
    dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counted = []
        for hidden in counted_hidden_sizes(shape):
            small = replace(shape, hidden_dim=hidden)
            # tokens pick logical experts: under replication the split sends them to copies
            call = MoECall.random(replace(logical, hidden_dim=hidden), shape.max_tokens_per_rank, dtype)
            with patch.dict(os.environ):  # a buffer exports its library's environment, a rank's, not ours
                counted.append(count_moe_call(job_config, small, call, dist.group.WORLD))
    finally:
        if created:
            dist.destroy_process_group()
    (low, high), (at_low, at_high) = counted_hidden_sizes(shape), counted

    def extended(a: int, b: int) -> int:
        return round(a + (b - a) * (shape.hidden_dim - low) / (high - low))

    costs = {}
    for phase, small in at_low.items():
        large = at_high[phase]
        collectives = [(kind, group, size, extended(sent, sent_high), caller)
                       for (kind, group, size, sent, caller), (*_, sent_high, _) in zip(small.collectives,
                                                                                        large.collectives)]
        costs[phase] = Costs(small.host_syncs, small.h2d_copies, collectives, small.waits, small.kernel_calls,
                             extended(small.local_bytes, large.local_bytes),
                             extended(small.largest_weight_copy, large.largest_weight_copy))
    return costs


EVERY_LAYER = "every MoE layer"
"""The layer a per-rank-shape count stands for: every MoE layer of the job pays alike."""


def moe_call_ledger(job_config) -> Ledger:
    """:func:`count_job_moe_call` as a :class:`Ledger` of one MoE layer (:data:`EVERY_LAYER`), against the job's
    budget (no activation checkpointing's recompute: one call is counted)."""
    costs = {(EVERY_LAYER, phase): paid for phase, paid in count_job_moe_call(job_config).items()}
    group = next((c[1] for paid in costs.values() for c in paid.collectives), "0")
    return Ledger(costs, group, job_budget(job_config), saves_collectives=False)


@contextmanager
def _sync_errors(enabled: bool):
    """CUDA's sync debug mode at "error" while enabled, except inside a kernel library's calls (the reference
    kernels that stand for a library sync where the library does not)."""
    if not enabled:
        yield
        return
    work = calls.library_work

    @contextmanager
    def library_work_unchecked():
        torch.cuda.set_sync_debug_mode(0)
        try:
            with work():
                yield
        finally:
            torch.cuda.set_sync_debug_mode("error")

    calls.library_work = library_work_unchecked
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        calls.library_work = work


def step_budgets() -> dict[str, Budget]:
    """What the features outside the MoE layers declare a (logged) step costs them, by the file of their code."""
    from torchtitan_ext.training import faults, metrics

    return {"torchtitan_ext/training/faults.py": faults.STEP_BUDGET,
            "torchtitan_ext/training/metrics.py": metrics.LOG_STEP_BUDGET}


def job_budget(job_config) -> DeviceBudget:
    """One MoE layer's budget in the job: its backend's, plus what expert replication adds."""
    from torchtitan_ext.ep.replication.plan import replication_budget

    budget = backend_class(job_config).device_budget(job_config)
    if job_config.expert_replication.slots_per_rank:
        budget = budget.given_counts() + replication_budget(job_config)
    return budget


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f}" if count else "0"


def format_ledger(ledger: Ledger, title: str) -> str:
    """The ledger as a table: one row per pass of each group of MoE layers that paid alike, then the rest of the
    step; the budget under it."""
    rows = []
    layers = ledger.layers()
    groups: list[tuple[list[int], dict]] = []
    for layer in layers:
        paid = {phase: ledger.costs.get((layer, phase)) for phase in PASSES}
        signature = {phase: None if c is None else (dict(c.host_syncs), dict(c.h2d_copies),
                                                     _in_order(c), dict(c.kernel_calls))
                     for phase, c in paid.items()}
        for members, other in groups:
            if other == signature:
                members.append(layer)
                break
        else:
            groups.append(([layer], signature))
    for members, _ in groups:
        name = members[0] if isinstance(members[0], str) else (
            f"MoE layer{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}")
        for phase in PASSES:
            costs = ledger.costs.get((members[0], phase))
            if costs is not None:
                rows.append((name, phase, costs))
    for phase in ("step",):
        if (OUTSIDE, phase) in ledger.costs:
            rows.append((OUTSIDE, "forward + backward + optimizer", ledger.costs[OUTSIDE, phase]))
    header = ["where", "pass", "host syncs", "H2D", "collectives (EP group / others)", "kernel calls",
              "local MB", "weight copy MB", "in order: issued, waited for"]
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for where, phase, costs in rows:
        ep = [c for c in costs.collectives if c[1] == ledger.ep_group]
        others = [c for c in costs.collectives if c[1] != ledger.ep_group]
        syncs = ", ".join(f"{kind} x{count}" for kind, count in sorted(costs.host_syncs.items())) or "0"
        h2d = ", ".join(f"{kind} x{count}" for kind, count in sorted(costs.h2d_copies.items())) or "0"
        collectives = f"{_describe(ep)} / {_describe(others)}"
        kernel = ", ".join(f"{name} x{count}" for name, count in sorted(costs.kernel_calls.items())) or "0"
        lines.append(f"| {where} | {phase} | {syncs} | {h2d} | {collectives} | {kernel} | "
                     f"{_megabytes(costs.local_bytes)} | {_megabytes(costs.largest_weight_copy)} | "
                     f"{'' if where == OUTSIDE else _in_order(costs)} |")
    if ledger.budget is not None:
        b = ledger.budget
        lines += ["", f"Budget per MoE layer: forward {b.forward}, backward {b.backward} ({b.why})."]
        over = ledger.over_budget()
        lines.append("Within it." if not over else "Over it:\n" + "\n".join(over))
    return "\n".join(lines) + "\n"


def _in_order(costs: Costs) -> str:
    """"alltoall_base (transport.py), alltoall_base (nccl.py), wait (experts.py)": the collectives in the order the
    host issued them, each ``wait_tensor`` after the last collective issued before it (by source file). The order
    on the device may differ: collectives on one process group run in turn on its stream."""
    events = [(issued, 1, f"wait ({_file(where)})") for issued, where in costs.waits]
    events += [(issued, 0, f"{kind} ({_file(where)})")
               for issued, (kind, *_, where) in enumerate(costs.collectives, start=1)]
    # a stable sort on the position alone: waits after the same collective keep the order they were called in
    return ", ".join(event for *_, event in sorted(events, key=lambda event: event[:2])) or "0"


def _file(where: str) -> str:
    return where.split(":")[0].rsplit("/", 1)[-1]


def _describe(collectives: list) -> str:
    """"all_to_all_single x1 (0.00 MB), alltoall_base x2 (1.23 MB)": each kind, its count and bytes sent."""
    if not collectives:
        return "0"
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for kind, _, _, sent, _ in collectives:
        kinds[kind][0] += 1
        kinds[kind][1] += sent
    return ", ".join(f"{kind} x{count} ({_megabytes(sent)} MB)" for kind, (count, sent) in kinds.items())
