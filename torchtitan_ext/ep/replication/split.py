"""The per-step split: which copy of a replicated expert each (token, expert) pair goes to.

Every step and MoE layer, the EP ranks exchange their pair counts per home
slot (one all-gather of E integers, on the device). From those global counts
each rank computes the same quotas: how many of an expert's pairs each copy
takes, so that the busiest rank's pairs are as few as the copies allow
(:func:`split_quotas`). The pairs of an expert are then taken in one global
order (source rank, then the source's own order) and cut at the quotas, so
every rank knows, without further exchange, which copy each of its pairs goes
to. No host sync: everything stays on the device.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_process_group_name

from torchtitan_ext.ep.base import to_device, to_host
from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.replication import transport_ops
from torchtitan_ext.ep.replication.plan import ReplicaPlan

SWEEPS = 2
"""Passes of water-filling over the replicated experts (each pass never raises the busiest rank's load)."""

UNREACHABLE = 2**40
"""The load a padded copy is given, so that water-filling never gives it a pair: above any step's pairs,
and a row's sum of them stays far inside int64."""


def water_fill(loads: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """Integer quotas q (summing to ``amount``) over ranks with ``loads``, minimising max(loads + q).

    ``loads`` [..., C] and ``amount`` [...]: one fill per row. The lowest-loaded ranks are filled to a
    common level; the remainder goes one pair each to the lowest-loaded of them (ties: the earlier copy).
    All on the device.
    """
    amount = amount.unsqueeze(-1)
    ordered, order = torch.sort(loads, dim=-1, stable=True)
    prefix = ordered.cumsum(-1)
    participants = torch.ones_like(ordered).cumsum(-1)  # 1 .. C, made from loads: host counts stay on the host
    levels = torch.div(amount + prefix, participants, rounding_mode="floor")
    # the levels that reach the next-lowest load form a prefix: its length is how many ranks fill
    filled = (levels >= ordered).sum(-1, keepdim=True).clamp(min=1)
    level = levels.gather(-1, filled - 1)
    remainder = amount + prefix.gather(-1, filled - 1) - level * filled
    quotas_ordered = (level - ordered).clamp(min=0) + (participants - 1 < remainder).to(loads.dtype)
    return torch.empty_like(quotas_ordered).scatter_(-1, order, quotas_ordered)


class SplitTables:
    """A plan's copies as tensors on the device, built once per plan (copied from the host without making it wait).

    The split fills the replicated experts in rounds: the experts of one round have copies on disjoint
    ranks, so one batched water-fill serves them all, exactly as filling them one after another in the
    rounds' order would (a few rounds per pass, where one expert at a time would take up to EP x S)."""

    def __init__(self, plan: ReplicaPlan, device: torch.device):
        copies = plan.copies()
        width = max(len(c) for c in copies)
        self.plan = plan
        self.copy_ranks = [[rank for rank, _ in c] for c in copies]
        """Host: for each home slot, the ranks of its copies (home first)."""
        self.replicated = [home for home, c in enumerate(copies) if len(c) > 1]
        self.dispatched = to_device(torch.tensor(
            [[slot for _, slot in c] + [c[0][1]] * (width - len(c)) for c in copies], dtype=torch.int64), device)
        """[E, C] dispatched id of each copy (padded with the home's)."""
        self.home_rank = to_device(torch.tensor([c[0][0] for c in copies], dtype=torch.int64), device)
        self.width = width
        self.rounds = [self._round_tensors(homes, device) for homes in self._rounds()]
        """Per round: (home slots [R], their copies' ranks [R, C] padded with EP, which copies are real [R, C])."""
        self.sequence = torch.cat([homes for homes, _, _ in self.rounds]) if self.rounds else None
        """The rounds' home slots one after another [replicated], for the split in one kernel (a GPU's)."""
        self.sequence_ranks = torch.cat([at for _, at, _ in self.rounds]) if self.rounds else None
        """Their copies' ranks [replicated, C], padded with EP."""

    def _rounds(self) -> list[list[int]]:
        """The replicated experts, in order, each in the first round whose ranks it does not share."""
        rounds: list[tuple[list[int], set[int]]] = []
        for home in self.replicated:
            ranks = set(self.copy_ranks[home])
            target = next((r for r in rounds if not r[1] & ranks), None)
            if target is None:
                rounds.append(([home], ranks))
            else:
                target[0].append(home)
                target[1].update(ranks)
        return [homes for homes, _ in rounds]

    def _round_tensors(self, homes: list[int], device: torch.device):
        sink = self.plan.expert_parallel_degree
        ranks = [self.copy_ranks[home] + [sink] * (self.width - len(self.copy_ranks[home])) for home in homes]
        at = to_device(torch.tensor(ranks, dtype=torch.int64), device)
        return to_device(torch.tensor(homes, dtype=torch.int64), device), at, at != sink


def split_quotas(counts: torch.Tensor, tables: SplitTables, in_one_kernel: bool | None = None) -> torch.Tensor:
    """[E, C] pairs each copy of each home slot takes, from the global ``counts`` [E] of this step.

    ``in_one_kernel`` (default: on a CUDA device) runs the rounds inside one Triton kernel
    (:mod:`.split_kernel`): the same quotas in 5 launches at any EP degree, where the rounds' operators take a
    few hundred at EP=64; on the host, where an operator launches nothing, the operators run."""
    experts, ranks = counts.shape[0], tables.plan.expert_parallel_degree
    quotas = torch.zeros(experts, tables.width, dtype=torch.int64, device=counts.device)
    quotas[:, 0] = counts
    # one more entry: the padded copies' rank, read and written but never a real rank's
    loads = torch.zeros(ranks + 1, dtype=torch.int64, device=counts.device).index_add_(0, tables.home_rank, counts)
    if not tables.rounds:
        return quotas
    if (counts.is_cuda if in_one_kernel is None else in_one_kernel):
        from torchtitan_ext.ep.replication import split_kernel  # Triton's import: only where it runs

        split_kernel.launch(counts, quotas, loads, tables.sequence, tables.sequence_ranks, SWEEPS, UNREACHABLE)
        return quotas
    for _ in range(SWEEPS):
        for homes, at, real in tables.rounds:
            others = torch.where(real, loads[at] - quotas.index_select(0, homes), UNREACHABLE)
            share = water_fill(others, counts.index_select(0, homes))
            loads.index_copy_(0, at.flatten(), (others + share).flatten())
            quotas.index_copy_(0, homes, share)
    return quotas


def _passed(device: torch.device) -> torch.Event | None:
    """An event the device passes after the work queued so far (None where the host is the device)."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


class ReplicaRouter:
    """One MoE layer's per-step split, and the counts the next choice of replicas is made from."""

    def __init__(self, plan: ReplicaPlan, group):
        self.group = group
        self.plan = plan
        self._tables: SplitTables | None = None
        self.window: torch.Tensor | None = None
        """Global pairs per home slot over the steps since the plan was last chosen (training forwards)."""
        self.closes_window = False
        """Set for a step whose counts end the window: each of its counted forwards queues a copy of the window to
        host memory, which the next choice reads once the device has passed it (``copied_window``)."""
        self.copied_window: tuple[torch.Tensor, torch.Event | None] | None = None
        """The closed window in host memory, and the event the device passes after copying it (None on a CPU)."""
        self.last_quotas: torch.Tensor | None = None
        """[E, C] the last split (for reports and tests)."""

    def set_plan(self, plan: ReplicaPlan) -> None:
        """Split by ``plan`` from the next forward on; an unchanged plan keeps its tables, a new one has them
        copied now (between steps, without making the host wait), where the last ones live."""
        if plan != self.plan:
            self.plan = plan
            self._tables = None if self._tables is None else SplitTables(plan, self._tables.dispatched.device)

    def take_copied_window(self) -> tuple[torch.Tensor, torch.Event | None] | None:
        """The closed window's host copy and its event (None: no counted forward since the last choice); the next
        window starts empty."""
        copied, self.copied_window, self.window = self.copied_window, None, None
        return copied

    def assign(self, home_slots: torch.Tensor, counting: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(dispatched ids for ``home_slots`` [N, K] (home slot of each pair): each pair's copy; [EP, dispatched
        experts] the pairs every rank sends to each copy, which spares a backend its exchange of counts)."""
        if self._tables is None or self._tables.dispatched.device != home_slots.device:
            # built on first use: the model is parallelized on the meta device
            self._tables = SplitTables(self.plan, home_slots.device)
        tables = self._tables
        with torch.no_grad():
            flat = home_slots.reshape(-1)
            experts = tables.plan.num_experts
            # scatter-add, not bincount: bincount reads the largest id back to size its output
            local = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
            counts = transport_ops().replica_counts(local, _get_process_group_name(self.group))
            total = counts.sum(0)
            if counting and not recomputing():
                self.window = total.clone() if self.window is None else self.window.add_(total)
                if self.closes_window:
                    self.copied_window = to_host(self.window), _passed(self.window.device)
            if not tables.replicated:
                self.last_quotas = None
                sent = torch.zeros(counts.shape[0], tables.plan.dispatched_experts, dtype=counts.dtype, device=counts.device)
                sent.index_add_(1, tables.dispatched[:, 0], counts)
                return tables.dispatched[flat, 0].view_as(home_slots), sent
            quotas = split_quotas(total, tables)
            self.last_quotas = quotas
            rank = dist.get_rank(self.group)
            earlier = counts[:rank].sum(0)
            order = torch.argsort(flat, stable=True)
            starts = local.cumsum(0) - local
            within = torch.empty_like(flat)
            within[order] = torch.arange(flat.shape[0], device=flat.device) - starts[flat[order]]
            position = earlier[flat] + within
            copy_ends = quotas.cumsum(1)
            copy = (position.unsqueeze(1) >= copy_ends[flat]).sum(1)
            return tables.dispatched[flat, copy].view_as(home_slots), self._sent(counts, quotas, copy_ends, tables)

    def _sent(self, counts: torch.Tensor, quotas: torch.Tensor, copy_ends: torch.Tensor, tables: SplitTables):
        """[EP, dispatched experts] from every rank's ``counts`` [EP, E]: rank s holds the positions
        [sum of counts[:s], sum of counts[:s + 1]) of each expert's pairs, and copy c takes [ends[c] - quotas[c],
        ends[c]); what rank s sends copy c is where the two meet."""
        ends = counts.cumsum(0).unsqueeze(-1)
        met = torch.minimum(ends, copy_ends) - torch.maximum(ends - counts.unsqueeze(-1), copy_ends - quotas)
        sent = torch.zeros(counts.shape[0], tables.plan.dispatched_experts, dtype=counts.dtype, device=counts.device)
        return sent.index_add_(1, tables.dispatched.flatten(), met.clamp(min=0).flatten(1))
