"""Routed experts with replica slots: home weights (parameters) plus copies fetched every forward.

:func:`adopt_replica_slots` turns a model's experts module, in place, into one
that computes L + S local slots (:class:`ReplicaSlots`): the L home experts
(this rank's shard of the parameters) and S replica slots whose weights come
from their home ranks through ``torchtitan_ext::replica_weights`` (one
all-to-all of whole experts, forward) and whose gradients go home through
``replica_gradients`` (backward), added to the home experts' own. Every
parameter of an expert moves, in the order its module holds them: torchtitan's
``GroupedExperts`` (w1, w2, w3: :class:`ExpertsWithReplicas`) and GPT-OSS's
biased experts (mlp1 and mlp2, each a weight and a bias:
:class:`GptOssExpertsWithReplicas`). Home weights
stay the only parameters, so the optimizer, FSDP and checkpoints see logical
experts only. Where the backend's library moves replicas itself (DeepEP V2.5's
load-balancing kernels), the op goes through it (:mod:`torchtitan_ext.ep.replication.transport`).

The fetch goes ahead of the dispatch and is waited for right before the
experts: the EP backend's dispatch hook, which runs after FSDP's unshard, has
its kernel buffer ready (which may carry the group's transport) and calls
:meth:`ReplicaSlots.queue_replica_fetch` before it dispatches. The
fetch's all-to-all is issued asynchronously (on a GPU on the EP group's NCCL
stream, its output allocated on the compute stream), the dispatch is issued
behind it, and :func:`with_replicas` waits for the fetch just before the
experts: grouped GEMMs read a concatenation of the home experts and the
replicas (one 3-D weight per projection), the per-expert loop views of both.

Double buffering: where block i+1 is a MoE layer too, layer i's hooks fetch
its replicas (:meth:`ReplicaSlots.fetch_following_ahead`), so that they
move while layer i computes, and layer i+1 finds them in flight. They are
fetched once layer i's dispatch is issued, or, where FSDP gathers the experts
across ranks, once its combine is: layer i+1's experts are unsharded for the
fetch first (torchtitan's explicit forward prefetch started their all-gather
at block i's pre-forward, and FSDP's ``unshard`` waits for it there instead of
in their own pre-forward), and that wait, on a GPU a wait of the compute
stream, would otherwise hold layer i's expert GEMMs. Not fetched ahead: across
a dense block (Llama4's interleaving: FSDP prefetches one block ahead), under
per-op selective checkpointing (:func:`link_fetch_ahead` is not called: it
caches each op in the region that issued it, and a fetch issued in layer i's
region would be replayed there, its op count no longer layer i+1's), while
recomputing (each layer fetches its own, landing at once), and through a
library's transport (DeepEP V2.5's region holds one layer's replicas: each
lands before the next fetch). A forward stopped early leaves a fetch in
flight; the next forward's first layer lands and drops it.

A kernel library's dispatch (DeepEP, HybridEP, NCCL EP: communicators of their
own) can run while an all-to-all fetch is in flight; the nccl backend's
all-to-all shares the group's stream, so there a fetch issued ahead queues
between layer i's dispatch and its combine, and overlaps layer i's expert
GEMMs; DeepEP V2.5's load-balancing kernels share its dispatch's stream, and
its fetch overlaps only the dispatch's local work (and the copy out of V2.5's
region leaves the path between them).
"""

from typing import NamedTuple

import torch
from torch.distributed.distributed_c10d import _get_process_group_name
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import FSDPModule
from torchtitan.models.gpt_oss.model import moe as gpt_oss_moe
from torchtitan.models.moe.moe import _run_experts_for_loop, GroupedExperts

from torchtitan_ext.config import ConfigError, shared_meta_model, ValidationContext
from torchtitan_ext.ep.base import to_device
from torchtitan_ext.ep.experts import GptOssExperts, UnboundLoopExperts
from torchtitan_ext.ep.recompute import recomputing
from torchtitan_ext.ep.replication import transport_ops, transports
from torchtitan_ext.ep.replication.plan import ReplicaPlan


class ReplicaExchange(NamedTuple):
    """One rank's side of a plan's replica exchange: the arguments of ``replica_weights`` (the first three) and of
    ``replica_gradients``. The index lists are int64 on the weights' device, the split sizes on the host."""

    send_local: torch.Tensor
    """This rank's experts sent (local index), destination by destination, each destination's ascending."""
    send_counts: list[int]
    """Experts sent to each rank."""
    recv_counts: list[int]
    """Experts received from each rank: into this rank's replica slots, in order (a plan lists them so)."""
    sent_experts: torch.Tensor
    """This rank's experts with copies elsewhere, once each, ascending: the rows their gradients' sums go to."""


def exchange_arguments(plan: ReplicaPlan, rank: int, device: torch.device = torch.device("cpu")) -> ReplicaExchange:
    """``rank``'s :class:`ReplicaExchange` under ``plan``, its index lists copied to ``device`` without making the
    host wait."""
    per_rank, ranks = plan.experts_per_rank, plan.expert_parallel_degree
    send_local, send_counts = [], []
    for destination in range(ranks):
        sent = [home % per_rank for home in plan.replicas[destination] if home >= 0 and home // per_rank == rank]
        send_local += sent
        send_counts.append(len(sent))
    sources = [home // per_rank for home in plan.replicas[rank] if home >= 0]
    recv_counts = [sources.count(source) for source in range(ranks)]
    return ReplicaExchange(to_device(torch.tensor(send_local, dtype=torch.int64), device), send_counts, recv_counts,
                           to_device(torch.tensor(sorted(set(send_local)), dtype=torch.int64), device))


def weights_with_replicas(home: list[torch.Tensor], fetched: torch.Tensor, slots: int) -> list[torch.Tensor]:
    """Each of the L home experts' parameters (w1, w2, w3, or GPT-OSS's four) followed by the ``slots`` fetched
    ones (``fetched``: one row per slot, the parameters flattened one after the other). The home experts are
    copied: a grouped GEMM takes one 3-D weight whose groups start at its first row."""
    pieces = fetched.split([w[0].numel() for w in home], dim=1)
    return [torch.cat([w, piece.view(slots, *w.shape[1:])]) for w, piece in zip(home, pieces)]


def _replica_gradients_home(ctx, own: list[torch.Tensor], replicas: torch.Tensor, own_is_fresh: bool):
    """Each projection's home gradient (``own``: [L, ...] the home experts' own) with the replicas' gradients
    (``replicas``: [S, F], one row of the expert's parameters flattened per slot) sent home (``replica_gradients``, summed per
    expert in fp32 or wider) and added to their experts' rows (for gradients narrower than fp32, in fp32 and rounded
    once); ``own`` is returned as it is on a rank that sends no expert. ``own_is_fresh``: the gradients are this
    backward's own tensors, added to in place (else a copy with those rows added)."""
    rows = own[0].shape[0]
    summed = transport_ops().replica_gradients(replicas, *ctx.exchange, ctx.redundancy_mapping, rows, ctx.group_name)
    sent_experts = ctx.exchange.sent_experts
    if sent_experts.shape[0] == 0:
        return own
    home_grads = []
    for grad, part in zip(own, summed.split([grad[0].numel() for grad in own], dim=1)):
        part = part.view(-1, *grad.shape[1:])
        if grad.dtype.itemsize >= part.dtype.itemsize:
            add = grad.index_add_ if own_is_fresh else grad.index_add
            home_grads.append(add(0, sent_experts, part.to(grad.dtype)))
        else:
            total = part.add_(grad.index_select(0, sent_experts))
            place = grad.index_copy_ if own_is_fresh else grad.index_copy
            home_grads.append(place(0, sent_experts, total.to(grad.dtype)))
    return home_grads


class _HomeAndReplicas(torch.autograd.Function):
    """The replicas fetched from their home ranks and concatenated after the home experts, per projection, for
    the grouped GEMMs.

    Backward, the replicas' gradients go home (:func:`_replica_gradients_home`) and are added to their experts' own
    gradients, which are a slice of the concatenation's: one copy of the home slice with those experts' rows added,
    and none on a rank that sends no expert. (A backward of the fetch alone would return a zero-filled gradient of
    every home weight, for autograd to add to the slice: two more passes over the home experts.)
    """

    @staticmethod
    def forward(ctx, fetched: torch.Tensor, exchange, redundancy_mapping: torch.Tensor, slots: int, group_name: str,
                *home: torch.Tensor):
        ctx.exchange, ctx.redundancy_mapping, ctx.group_name = exchange, redundancy_mapping, group_name
        ctx.home_rows, ctx.slots = home[0].shape[0], slots
        return tuple(weights_with_replicas(list(home), fetched, slots))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        rows, slots = ctx.home_rows, ctx.slots
        replicas = torch.cat([grad[rows:].reshape(slots, -1) for grad in grads], dim=1)
        own = _replica_gradients_home(ctx, [grad[:rows] for grad in grads], replicas, own_is_fresh=False)
        return None, None, None, None, None, *own


class _HomeAndReplicasUnbound(torch.autograd.Function):
    """The home experts and the fetched replicas, one tensor per expert and parameter (views, no copy), for the
    per-expert loop, which indexes its weights by expert: w1 of the L + S experts, then w2's, then w3's (GPT-OSS:
    mlp1's weight, its bias, mlp2's weight, its bias).

    Backward, each parameter's L home gradients are stacked once (what the loop's own unbind would do) and the S
    replicas' go home and are added to them in place (:func:`_replica_gradients_home`). The concatenation the
    grouped GEMMs need would copy the home experts forward and again backward.
    """

    @staticmethod
    def forward(ctx, fetched: torch.Tensor, exchange, redundancy_mapping: torch.Tensor, slots: int, group_name: str,
                *home: torch.Tensor):
        ctx.exchange, ctx.redundancy_mapping, ctx.group_name = exchange, redundancy_mapping, group_name
        ctx.home_rows, ctx.slots = home[0].shape[0], slots
        pieces = fetched.split([w[0].numel() for w in home], dim=1)
        return tuple(expert for w, piece in zip(home, pieces)
                     for expert in (*w.unbind(0), *piece.view(slots, *w.shape[1:]).unbind(0)))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        experts = ctx.home_rows + ctx.slots
        per_projection = [grads[start:start + experts] for start in range(0, len(grads), experts)]
        own = [torch.stack(projection[:ctx.home_rows]) for projection in per_projection]
        # slot by slot, w1, w2 and w3 flattened: the [S, F] rows of the fetched replicas, in one copy
        replicas = torch.cat([projection[ctx.home_rows + slot].reshape(1, -1) for slot in range(ctx.slots)
                              for projection in per_projection], dim=1).view(ctx.slots, -1)
        return None, None, None, None, None, *_replica_gradients_home(ctx, own, replicas, own_is_fresh=True)


UNNAMED_FETCH = "the replica weights' fetch"
"""What a fetch outside a parallelized model (no EP style named its layer) names in failures."""


def fetch_replicas(home: list[torch.Tensor], exchange, redundancy_mapping: torch.Tensor, slots: int,
                   group_name: str, what: str = UNNAMED_FETCH) -> torch.Tensor:
    """[slots, F] the replica weights of this rank's slots, fetched from their homes by ``exchange``
    (:func:`exchange_arguments`, :func:`redundancy_mapping`): in flight, not to be read until :func:`with_replicas`
    (or ``wait_tensor``) lands them; outside autograd: the gradients' way home is :func:`with_replicas`'s
    backward. ``what``: what a failure names."""
    with torch.no_grad():
        return transport_ops().replica_weights(home, exchange.send_local, exchange.send_counts, exchange.recv_counts,
                                                redundancy_mapping, slots, group_name, what)


def with_replicas(home: list[torch.Tensor], exchange, redundancy_mapping: torch.Tensor, slots: int,
                  group_name: str, fetched: torch.Tensor | None = None, stacked: bool = True) -> list:
    """The ``slots`` replicas ``fetched`` (None: fetched now, :func:`fetch_replicas`), which it waits for first,
    after the L home experts, each replica's gradient added to its home expert's: ``stacked``, each parameter (w1,
    w2, w3; GPT-OSS's weights and biases) of the L + S experts, the home experts copied (:class:`_HomeAndReplicas`,
    for grouped GEMMs); else one list per parameter of the L + S experts' views (:class:`_HomeAndReplicasUnbound`,
    for the per-expert loop)."""
    if fetched is None:
        fetched = fetch_replicas(home, exchange, redundancy_mapping, slots, group_name)
    torch.ops._c10d_functional.wait_tensor(fetched)
    if stacked:
        return list(_HomeAndReplicas.apply(fetched, exchange, redundancy_mapping, slots, group_name, *home))
    experts = _HomeAndReplicasUnbound.apply(fetched, exchange, redundancy_mapping, slots, group_name, *home)
    count = home[0].shape[0] + slots
    return [list(experts[start:start + count]) for start in range(0, len(experts), count)]


def link_fetch_ahead(blocks: list["ReplicaSlots | None"], after_experts: bool) -> None:
    """Each MoE layer fetches the next block's replicas ahead where that block is a MoE layer too
    (:meth:`ReplicaSlots.fetch_following_ahead`). ``blocks``: a model part's blocks in forward order, each its
    experts (None for a dense block: torchtitan's FSDP prefetches one block ahead, and a fetch two blocks ahead would
    unshard experts a block early); ``after_experts``: :attr:`ReplicaSlots.after_experts`. Not for per-op
    selective checkpointing (the module docstring)."""
    for layer, following in zip(blocks, blocks[1:]):
        if layer is not None and following is not None:
            # a plain attribute, not a submodule: the next layer's parameters belong to its own layer alone
            object.__setattr__(layer, "following", following)
            layer.after_experts, following.preceded = after_experts, True


def redundancy_mapping(plan: ReplicaPlan, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """[EP, S] int32 on ``device``: each rank's replica slots' home slots, -1 when unused. Built once per plan
    (copied without making the host wait), so that no fetch or return copies it within a layer."""
    return to_device(torch.tensor(plan.replicas, dtype=torch.int32), device)


class ReplicaSlots(torch.nn.Module):
    """An experts module computing its home experts and replica slots (adopted in place,
    :func:`adopt_replica_slots`). It mixes into one of :mod:`torchtitan_ext.ep.experts`'s classes, whose
    ``local_weights`` are an expert's weights (:meth:`_home`); a subclass says how its experts compute on them:
    stacked (:meth:`_run`), and as a per-expert loop on views (:meth:`_run_loop`, where
    :meth:`_loops_over_experts`)."""

    slots: int
    group = None
    plan: ReplicaPlan
    exchange: ReplicaExchange | None
    redundancy_mapping: torch.Tensor | None
    """[EP, S] the plan's table (:func:`redundancy_mapping`) where the weights live; None until then."""
    holds_replicas: bool
    """Whether some rank's slot holds a replica under the plan (else the layer runs its home experts alone)."""
    bytes_per_expert: int = 0
    """One expert's weights as the last forward fetched them (its compute dtype), for reports."""
    fetched: torch.Tensor | None = None
    """The replicas queued for this forward (by :meth:`queue_replica_fetch`, or ahead by the layer before), in flight
    until its forward lands them."""
    fetch_name: str = UNNAMED_FETCH
    """What a failure of this layer's fetch names, also when the layer before issues it: the name its EP style gives
    its collectives ("MoE layer 3 replica fetch (NcclExpertParallel)"), set by the parallelize plan."""
    following: "ReplicaSlots | None" = None
    """The next block's experts in this model part, whose fetch this layer issues ahead (:func:`link_fetch_ahead`);
    None for the last MoE layer, one before a dense block, and where nothing is fetched ahead."""
    preceded: bool = False
    """Whether the layer before fetches this one's replicas ahead (else it fetches its own, and first lands any fetch
    an aborted forward left in flight down its chain)."""
    after_experts: bool = False
    """Whether the next layer's fetch waits until this layer's experts are queued (issued after the combine), not
    only its dispatch: where the next experts' weights come from an FSDP all-gather across ranks, whose wait,
    earlier, would hold this layer's expert GEMMs."""

    @classmethod
    def adopt(cls, experts: torch.nn.Module, plan: ReplicaPlan, group) -> "ReplicaSlots":
        experts.__class__ = cls
        experts.slots = plan.slots
        experts.group = group
        experts.dispatched_experts = plan.dispatched_experts
        experts.set_plan(plan)
        return experts

    def set_plan(self, plan: ReplicaPlan) -> None:
        """Fetch ``plan``'s replicas from the next forward on. Its index tensors are copied now (between steps,
        without making the host wait) where the weights live, or at the first forward after the meta device."""
        if plan == getattr(self, "plan", None):
            return
        self.plan = plan
        self.fetched = None
        self.holds_replicas = plan.replicated() > 0
        built = getattr(self, "exchange", None)
        # where the weights live (none yet while the model is parallelized on the meta device: first use builds)
        device = self._home()[0].device if built is None else built.send_local.device
        self.exchange = self.redundancy_mapping = None
        if device.type != "meta":
            self._build_tables(device)

    def _build_tables(self, device: torch.device) -> None:
        self.exchange = exchange_arguments(self.plan, torch.distributed.get_rank(self.group), device)
        self.redundancy_mapping = redundancy_mapping(self.plan, device)

    def _home(self) -> list[torch.Tensor]:
        """This rank's home experts' weights, each [L, ...] and local, in the order a fetched row holds them: the
        experts class's ``local_weights`` (:mod:`torchtitan_ext.ep.experts`)."""
        return self.local_weights()

    def _run(self, weights: list[torch.Tensor], x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on ``weights`` (:meth:`_home`'s, or those of the L + S slots stacked)."""
        raise NotImplementedError

    def _loops_over_experts(self) -> bool:
        """Whether the experts run as a per-expert loop, which takes views of the home experts and replicas (grouped
        GEMMs, a converter's low-precision ones too, take them stacked, the home experts copied)."""
        return not self.use_grouped_mm and self.low_precision is None

    def _run_loop(self, weights: list[list[torch.Tensor]], x: torch.Tensor,
                  num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The per-expert loop on ``weights``: for each of :meth:`_home`'s tensors, the L + S slots' views."""
        raise NotImplementedError

    def _run_with_replicas(self, home: list[torch.Tensor], fetched: torch.Tensor, x: torch.Tensor,
                           num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The L + S slots' experts, once ``fetched`` lands."""
        loop = self._loops_over_experts()
        weights = with_replicas(home, self.exchange, self.redundancy_mapping, self.slots,
                                _get_process_group_name(self.group), fetched, stacked=not loop)
        run = self._run_loop if loop else self._run
        return run(weights, x, num_tokens_per_expert)

    def queue_replica_fetch(self) -> None:
        """Queue this forward's fetch (none where no slot holds a replica, or where the layer before fetched it ahead):
        the EP backend calls it before its dispatch, once the weights are unsharded and its kernel buffer exists."""
        if not self.preceded:
            self._land_leftovers()
        if not self.holds_replicas:
            self.fetched = None
        elif self.fetched is None:
            self.fetched = self._fetch(self._home())

    def _land_leftovers(self) -> None:
        """Land and drop what a forward that stopped early (an exception caught by its caller) left in flight down
        this chain: a leftover is the weights before the last optimizer step."""
        layer = self
        while layer is not None:
            if layer.fetched is not None:
                torch.ops._c10d_functional.wait_tensor(layer.fetched)
                layer.fetched = None
            layer = layer.following

    def fetch_following_ahead(self, experts_queued: bool) -> None:
        """Queue the next MoE layer's fetch (double buffering): the EP backend calls it once this layer's dispatch is
        issued (``experts_queued`` False), so that the next layer's replicas move while this layer's experts
        compute, and again once its combine is (True), the point :attr:`after_experts` picks. Nothing while
        recomputing (each recomputed layer fetches its own), where the next layer holds no replica, or where a
        library's transport moves them (its region holds one layer's fetch at a time)."""
        following = self.following
        if (following is None or experts_queued != self.after_experts or not following.holds_replicas
                or following.fetched is not None or recomputing()):
            return
        if transports.get(_get_process_group_name(following.group)) is not None:
            return
        if isinstance(following, FSDPModule):
            # its all-gather is in flight (torchtitan's forward prefetch of the next block, from this block's
            # pre-forward): wait for it here, so its own pre-forward finds the weights unsharded
            following.unshard()
        following.fetched = following._fetch(following._home())

    def _fetch(self, home: list[torch.Tensor]) -> torch.Tensor:
        if self.exchange is None or self.exchange.send_local.device != home[0].device:
            self._build_tables(home[0].device)  # on first use: the model is parallelized on the meta device
        return fetch_replicas(home, self.exchange, self.redundancy_mapping, self.slots,
                              _get_process_group_name(self.group), self.fetch_name)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        home = self._home()
        self.bytes_per_expert = sum(w[0].numel() for w in home) * home[0].element_size()
        fetched, self.fetched = self.fetched, None
        if not self.holds_replicas:
            # no replica this step (none chosen yet, or the choice set aside): the slots get no pairs, so their
            # (zero) rows are padding after the home experts' groups; no fetch, no gradient return
            return self._run(home, x, num_tokens_per_expert[:home[0].shape[0]])
        if fetched is None:  # called without the EP hooks
            fetched = self._fetch(home)
        return self._run_with_replicas(home, fetched, x, num_tokens_per_expert)


class ExpertsWithReplicas(ReplicaSlots, UnboundLoopExperts):
    """torchtitan's ``GroupedExperts`` (w1, w2, w3) with replica slots. Its per-expert loop takes views of the home
    experts and replicas, its grouped GEMMs (and a converter's low-precision ones) one 3-D weight per projection."""

    def _run(self, weights: list[torch.Tensor], x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.run_experts(*weights, x, num_tokens_per_expert)

    def _run_loop(self, weights: list[list[torch.Tensor]], x: torch.Tensor,
                  num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _run_experts_for_loop(*weights, x, num_tokens_per_expert)


class GptOssExpertsWithReplicas(ReplicaSlots, GptOssExperts):
    """GPT-OSS's experts (mlp1 and mlp2, each a weight and a bias; the clamped SwiGLU) with replica slots: its grouped
    GEMMs on the home experts and replicas stacked, its per-expert loop on views of both."""

    def _run(self, weights: list[torch.Tensor], x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # the tokens come grouped by the EP backend's dispatch; tensor parallel degree 1: replicas refuse expert TP
        return self.run_experts(weights, x, num_tokens_per_expert)

    def _run_loop(self, weights: list[list[torch.Tensor]], x: torch.Tensor,
                  num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return gpt_oss_moe._run_experts_for_loop(*weights, self.swiglu_limit, x, num_tokens_per_expert, 1)


REPLICA_EXPERTS: dict[type, type[ReplicaSlots]] = {
    GroupedExperts: ExpertsWithReplicas,
    UnboundLoopExperts: ExpertsWithReplicas,
    gpt_oss_moe.GptOssGroupedExperts: GptOssExpertsWithReplicas,
    GptOssExperts: GptOssExpertsWithReplicas,
}
"""The experts modules that take replica slots, by their class before adoption: what the replica class adopting it
computes with."""


def adopt_replica_slots(experts: torch.nn.Module, plan: ReplicaPlan, group) -> ReplicaSlots:
    """``experts`` turned, in place, into its :data:`REPLICA_EXPERTS` class, with ``plan``'s replicas (fetched
    within ``group``, the EP group)."""
    return REPLICA_EXPERTS[type(experts)].adopt(experts, plan, group)


def check_replica_experts(job_config, context: ValidationContext) -> None:
    """ConfigError when the job asks for replica slots and its model's routed experts have no replica class."""
    slots = job_config.expert_replication.slots_per_rank
    if not slots or context.moe_shape is None:
        return
    for block in shared_meta_model(job_config).layers.values():
        if block.moe_enabled and type(block.moe.experts) not in REPLICA_EXPERTS:
            raise ConfigError(
                f"expert_replication.slots_per_rank = {slots}: {job_config.model.name}'s routed experts "
                f"({type(block.moe.experts).__name__}) take no replica slots (torchtitan's GroupedExperts and "
                "GPT-OSS's do): set slots_per_rank to 0")
