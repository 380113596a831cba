"""Communication cost of an MoE layer under an EP layout: the stream model of the seed paper (seeds/000).

The paper's equations, its one-level setting and its Algorithm 1 are :mod:`.paper_model`'s. :func:`layer_costs`
applies the model to a torchtitan job (an expert domain is the expert-FSDP group, the A2A group the EP
group): token bytes, each backend's copies per token, forward and backward, every level of the topology.
Where this goes beyond the paper is said at the function. See docs/planning.md, "What the advisor
cannot predict".
"""

from dataclasses import dataclass

import numpy as np

from torchtitan_ext.config import ConfigError
from torchtitan_ext.planning.expert_reach import group_limited_reach, uniform_miss
from torchtitan_ext.planning.topology import Collective, Topology


@dataclass(frozen=True)
class MeasuredRouting:
    """Routing a run recorded (a routing-statistics dump), in place of uniform routing.

    Each (step, MoE layer) of the dump is one dispatch. An all-to-all ends when
    its busiest receiver has its rows, so each measure is, per dispatch, the
    busiest rank's (or group of ranks') share, averaged over the dispatches;
    the copies per token the advice reports then count every peer as the
    busiest. Experts sit on EP ranks in logical order (E/ep consecutive experts
    per rank, no expert placement).
    """

    source: str
    tokens_per_expert: np.ndarray
    """[dispatches, E]: (token, expert) pairs per expert."""
    sampled_expert_ids: tuple[np.ndarray, ...]
    """Per dispatch, [tokens, top_k] expert ids of the sampled tokens."""
    layers: int = 1
    """MoE layers per recorded step: the dispatches are step-major, ``layers`` per step."""
    step_numbers: tuple[int, ...] = ()
    """The training step of each recorded step (empty: 1, 2, ...)."""

    @classmethod
    def from_dump(cls, stats: dict, source: str, experts: int, top_k: int) -> "MeasuredRouting":
        """From a loaded dump (``routing_stats.load``/``load_folder``) of a model with ``experts`` and ``top_k``."""
        counts = stats["tokens_per_expert"]
        if counts.shape[-1] != experts or int(stats["top_k"]) != top_k:
            raise ConfigError(
                f"--routing-stats {source} records {counts.shape[-1]} experts, top-{int(stats['top_k'])}; the job's "
                f"model has {experts}, top-{top_k}: use a dump of this model"
            )
        if "sampled_expert_ids" not in stats or stats["sampled_expert_ids"].shape[2] == 0:
            raise ConfigError(
                f"--routing-stats {source} has no sampled tokens, which the layout advice needs for the copies "
                "per token: record with routing_stats.sample_tokens > 0"
            )
        sampled = stats["sampled_expert_ids"].reshape(-1, *stats["sampled_expert_ids"].shape[2:])
        rows = tuple(ids[(ids >= 0).all(axis=1)].astype(np.int64) for ids in sampled)
        if not all(len(r) for r in rows):
            raise ConfigError(f"--routing-stats {source}: a step and layer with no sampled token; record more steps")
        return cls(source, counts.reshape(-1, experts).astype(np.float64), rows, counts.shape[1] if counts.ndim == 3 else 1,
                   tuple(int(step) for step in stats["steps"]))

    @property
    def dispatches(self) -> int:
        return len(self.tokens_per_expert)

    @property
    def steps(self) -> int:
        return self.dispatches // self.layers

    def pair_share(self, ep: int) -> float:
        """The busiest EP rank's share of the (token, expert) pairs: 1/ep under uniform routing."""
        per_rank = self.tokens_per_expert.reshape(self.dispatches, ep, -1).sum(axis=2)
        return float(np.mean(per_rank.max(axis=1) / per_rank.sum(axis=1)))

    def reach(self, ep: int, ranks: int) -> float:
        """The largest fraction of tokens with an expert on one group of EP ranks: the groups of
        ``ranks`` consecutive ranks from rank 0 (each rank, or a level's domains; the last may be
        partial). Under uniform routing the mean over groups is 1 - ``uniform_miss(E, k, E/ep x ranks)``;
        the largest is above it by the sampling noise, more so with few sampled tokens."""
        experts = self.tokens_per_expert.shape[1]
        held = experts // ep * ranks
        fractions = []
        for ids in self.sampled_expert_ids:
            hit = np.zeros((len(ids), -(-experts // held)), dtype=bool)
            hit[np.arange(len(ids))[:, None], ids // held] = True
            fractions.append(hit.mean(axis=0).max())
        return float(np.mean(fractions))


@dataclass(frozen=True)
class MoEWorkload:
    """What one rank moves and computes per MoE layer and step."""

    tokens: int
    """Tokens this rank dispatches per MoE layer call (local batch x sequence)."""
    hidden: int
    top_k: int
    experts: int
    expert_parameters: int
    """Parameters of one routed expert."""
    activation_bytes: int
    """Bytes per element of dispatched tokens (and of their combine and gradients)."""
    gather_bytes: int
    """Bytes per element of FSDP's all-gather (the parameter dtype FSDP casts to)."""
    reduce_bytes: int
    """Bytes per element of FSDP's gradient reduce-scatter."""
    pre_expert_flops: float
    """Forward FLOPs of one layer outside its routed experts (attention, router, shared
    experts), for this rank's tokens: the compute FSDP's prefetch can hide an all-gather behind."""
    regather_in_backward: bool
    """FSDP reshards after forward, so backward gathers the experts again."""
    expert_groups: int | None = None
    """Group-limited routing (DeepSeek-V3's node-limited gate): the experts form this many groups of
    consecutive experts, and each token picks its top_k among ``limited_groups`` of them. None: no limit."""
    limited_groups: int | None = None
    prefetch_flops: float | None = None
    """Forward FLOPs, for this rank's tokens, that FSDP's all-gather of a layer's experts runs beside:
    torchtitan's FSDP issues the next block's all-gather while the CPU runs ahead of the current block, so
    that is the whole previous block's forward (attention, router, shared and routed experts). None: the
    layer's own pre-expert compute only (the paper's eq. 7)."""


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per MoE layer and training step, for one rank (the paper's Lat terms)."""

    a2a: float
    """One all-to-all of tokens (dispatch, or combine), one direction."""
    all_gather: float
    """One all-gather of this rank's experts over its expert-FSDP group."""
    reduce_scatter: float
    pre_expert_forward: float
    token_copies: float
    """Copies of each token that leave the rank per dispatch."""
    all_gathers: int
    """All-gathers of the experts per step: 2 when backward gathers again, else 1."""
    prefetch_window: float | None = None
    """Seconds of forward compute an all-gather of the experts hides behind (:attr:`MoEWorkload.prefetch_flops`);
    None: ``pre_expert_forward``."""

    def all_to_alls(self, recomputed: bool) -> int:
        """Dispatch and combine, forward and backward; two more when activation checkpointing
        recomputes the layer's forward in backward (collectives included)."""
        return 6 if recomputed else 4

    def communication(self, recomputed: bool = False) -> float:
        return self.all_to_alls(recomputed) * self.a2a + self.all_gathers * self.all_gather + self.reduce_scatter

    def exposed(self, overlap: bool, recomputed: bool = False, a2a_beside: float | None = None,
                sm_share: float = 0.0) -> float:
        """Communication the step waits for. With overlap: forward as eq. 10 (the all-gather hides
        behind the prefetch window, the paper's pre-expert compute or torchtitan's previous block; the
        all-to-alls cannot, their input is the pre-expert output); in backward the re-gather and the
        gradients' reduce-scatter share the expert-FSDP link and hide together behind twice that
        window (a backward's FLOPs). The paper's eq. 7 also hides expert compute under the
        all-to-alls; here expert compute stays in the step's compute and every all-to-all is exposed,
        unless the job runs them beside another microbatch's compute: ``a2a_beside``, that compute's
        seconds per layer call, with the kernels holding ``sm_share`` of the SMs (:func:`overlapped_exposure`).
        Without overlap: all of it."""
        if not overlap:
            return self.communication(recomputed)
        window = self.pre_expert_forward if self.prefetch_window is None else self.prefetch_window
        forward_gather = max(0.0, self.all_gather - window)
        regather = self.all_gather if self.all_gathers > 1 else 0.0
        backward_fsdp = max(0.0, regather + self.reduce_scatter - 2 * window)
        all_to_alls = self.all_to_alls(recomputed) * self.a2a
        if a2a_beside is not None:
            all_to_alls = overlapped_exposure(all_to_alls, a2a_beside, sm_share)
        return all_to_alls + forward_gather + backward_fsdp


def overlapped_exposure(communication: float, compute: float, sm_share: float) -> float:
    """Seconds the step waits for ``communication`` run beside ``compute`` (another microbatch's, both seconds
    alone) when its kernels hold ``sm_share`` of the SMs (in [0, 1)).

    While the communication runs the GEMMs have 1 - ``sm_share`` of the SMs; once it ends, all. The pair
    takes max(c, C + s x c): the communication alone where it is the longer, else the compute stretched by
    the SMs it lost for the communication's c seconds. Over the compute alone that is max(c - C, s x c): the
    communication's excess over the compute, or the SMs' cost, whichever is more. ``sm_share`` 0 (not priced)
    gives the familiar max(0, c - C)."""
    if not 0.0 <= sm_share < 1.0:
        raise ValueError(f"sm_share = {sm_share}: a share of the SMs in [0, 1)")
    return max(communication - compute, sm_share * communication)


def _levels_of_peers(levels: tuple[int, ...], peers: range) -> dict[int, int]:
    """{level index: how many of ``peers`` rank 0 reaches over that level} (``levels``: :meth:`Topology.rank_levels`)."""
    counts: dict[int, int] = {}
    for peer in peers:
        counts[levels[peer]] = counts.get(levels[peer], 0) + 1
    return counts


def transfer_seconds(
    topology: Topology, bytes_per_level: dict[int, float], collective: Collective = "all_to_all",
    rate_fractions: dict[int, float] | None = None, call_floors: dict[int, float] | None = None,
) -> float:
    """Levels' links run side by side: the slowest level's bytes / the collective's bandwidth + start-up.
    ``rate_fractions``: {level: the fraction of its bandwidth the transfer reaches there} (default 1);
    ``call_floors``: {level: a measured fixed cost per call there, seconds}, in place of the level's latency."""
    fractions, floors = rate_fractions or {}, call_floors or {}
    return max(
        (volume / (topology.levels[level].bandwidth(collective) * fractions.get(level, 1.0))
         + floors.get(level, topology.levels[level].latency_us * 1e-6)
         for level, volume in bytes_per_level.items() if volume > 0),
        default=0.0,
    )


def token_bytes_per_level(
    work: MoEWorkload, topology: Topology, sizes: list[int], ep: int, copies_per_rank: bool,
    routing: MeasuredRouting | None = None, pair_share: float | None = None,
) -> tuple[dict[int, float], float]:
    """({level: bytes rank 0 sends there per all-to-all}, token copies leaving the rank).

    Uniform routing (through the model's group-limited gate where it has one:
    :func:`group_limited_reach`), or with ``routing`` the busiest receiver's
    measured share (pairs per rank; tokens reaching a rank or a domain). The EP
    group is ranks 0..ep-1 (torchtitan's mesh puts ep innermost).
    Per pair (all-to-all): each of the tokens x top_k pairs goes to its expert's rank.
    Per rank (DeepEP, HybridEP): a token goes once to each rank holding one of its experts;
    over an outer level once to each domain (the EP ranks of one inner-level group) holding
    one, and the rank it lands on forwards it inside the domain (counted on the innermost
    level, also for a domain reached over the third level or beyond).
    ``pair_share``, when given, is the busiest receiver's share of the pairs in place of the
    routing's, for per-pair sends (under expert replication: after the split, :mod:`.replica_cost`).
    """
    row = work.hidden * work.activation_bytes
    levels = topology.rank_levels(sizes[-1])
    by_level = _levels_of_peers(levels, range(1, ep))
    volume: dict[int, float] = {}
    copies = 0.0
    if not copies_per_rank:
        if pair_share is None:
            pair_share = routing.pair_share(ep) if routing else 1 / ep
        per_peer = work.tokens * work.top_k * pair_share
        for level, peers in by_level.items():
            volume[level] = peers * per_peer * row
            copies += peers * per_peer / work.tokens
        return volume, copies

    def reach(ranks: int, domain_size: int) -> float:
        return token_reach(work, ep, routing, ranks, domain_size)

    reach_rank = reach(1, 1)
    for level, peers in by_level.items():
        if level == 0:
            volume[0] = volume.get(0, 0.0) + peers * work.tokens * reach_rank * row
            copies += peers * reach_rank
            continue
        domains: dict[int, int] = {}
        for peer in range(1, ep):
            if levels[peer] == level:
                domains[peer // sizes[level - 1]] = domains.get(peer // sizes[level - 1], 0) + 1
        for ranks in domains.values():
            reach_domain = reach(ranks, sizes[level - 1])
            volume[level] = volume.get(level, 0.0) + work.tokens * reach_domain * row
            copies += reach_domain
            # the rank a token lands on forwards it to the domain's other ranks that hold its experts
            volume[0] = volume.get(0, 0.0) + (ranks - 1) * work.tokens * reach_rank * row
    return volume, copies


def token_reach(
    work: MoEWorkload, ep: int, routing: MeasuredRouting | None, ranks: int = 1, domain_size: int = 1
) -> float:
    """The share of tokens that reach a domain of ``domain_size`` ranks, ``ranks`` of them in the EP group: under
    uniform routing (through the model's group-limited gate where it has one), or the busiest receiver's measured
    share. ``ep`` x the share for one rank is the ranks one token reaches, its own among them."""
    if routing:
        return routing.reach(ep, domain_size)
    local = work.experts // ep
    if work.expert_groups is not None:
        return group_limited_reach(work.experts, work.top_k, work.expert_groups, work.limited_groups, local * ranks)
    return 1 - uniform_miss(work.experts, work.top_k, local * ranks)


def layer_costs(
    work: MoEWorkload, topology: Topology, world_size: int, ep: int, efsdp: int, copies_per_rank: bool,
    routing: MeasuredRouting | None = None, pair_share: float | None = None, token_links: Topology | None = None,
    token_rate_fractions: dict[int, float] | None = None, token_call_floors: dict[int, float] | None = None,
) -> LayerCosts:
    """The paper's streams for one MoE layer of a torchtitan job at (ep, efsdp), per rank and step.

    Tokens: eq. 3's A2A over the EP group, with the backend's copies per token (four per step,
    six when activation checkpointing recomputes the layer), over ``token_links`` when the backend's
    kernels see the links otherwise (:meth:`Topology.within_kernel_domain`), each level at the fraction
    of its rate the backend's kernels reach there (``token_rate_fractions``, by level of ``token_links``;
    default: the nominal rate) and with the fixed cost per call measured there (``token_call_floors``, by level;
    default: the level's latency). Experts: eq. 4's AG over the
    expert-FSDP group (ranks ep apart), of this rank's E/ep experts in FSDP's shards, once or twice per
    step, and the gradients' reduce-scatter of the same bytes at the reduce dtype.
    """
    links = topology if token_links is None else token_links
    volume, copies = token_bytes_per_level(work, links, links.group_sizes(world_size), ep, copies_per_rank, routing, pair_share)
    a2a = transfer_seconds(links, volume, rate_fractions=token_rate_fractions, call_floors=token_call_floors)
    gathered = work.experts // ep * work.expert_parameters * (efsdp - 1) / efsdp
    if efsdp > 1:
        level = topology.rank_levels(world_size)[(efsdp - 1) * ep]
        all_gather = transfer_seconds(topology, {level: gathered * work.gather_bytes}, "all_gather")
        reduce_scatter = transfer_seconds(topology, {level: gathered * work.reduce_bytes}, "reduce_scatter")
    else:
        all_gather = reduce_scatter = 0.0
    pre_expert = work.pre_expert_flops / (topology.compute_tflops * 1e12)
    window = None if work.prefetch_flops is None else work.prefetch_flops / (topology.compute_tflops * 1e12)
    return LayerCosts(
        a2a=a2a,
        all_gather=all_gather,
        reduce_scatter=reduce_scatter,
        pre_expert_forward=pre_expert,
        token_copies=copies,
        all_gathers=2 if work.regather_in_backward and efsdp > 1 else 1,
        prefetch_window=window,
    )


@dataclass(frozen=True)
class DataParallelSync:
    """Data parallelism's traffic outside the routed experts' FSDP, per rank and step: FSDP's all-gathers
    and reduce-scatters of the dense parameters, and HSDP's (or DDP's) all-reduce of every gradient
    shard across replicas.

    Not the paper's (its blocks hold experts only), and the same for every EP layout of a job (EP does
    not change these groups), but on a machine where communication does not overlap compute it is part
    of every step. torchtitan keeps gradient sync on for every microbatch of gradient accumulation, so
    each repeats it all.
    """

    dense_parameters: int
    """Parameters FSDP shards over ``fsdp_degree`` ranks (all but the routed experts'), of one
    pipeline stage and tensor-parallel shard. >= 0."""
    units: int
    """``fully_shard`` units: one all-gather and one reduce-scatter each (and one all-reduce across
    replicas), one start-up each. >= 1."""
    fsdp_degree: int
    """Ranks of the FSDP group (data-parallel shard x context parallel); 1: no FSDP traffic. >= 1."""
    fsdp_stride: int
    """Ranks between two members of the FSDP group (torchtitan's mesh puts tensor parallel inside). >= 1."""
    replicas: int
    """Data-parallel replicas (HSDP, or DDP without FSDP); 1: no all-reduce. >= 1."""
    replica_stride: int
    """Ranks between two replicas of one shard. >= 1."""
    shard_parameters: int
    """Parameters one rank holds and all-reduces across replicas: its shard of every parameter. >= 0."""
    gather_bytes: int
    """Bytes per element FSDP gathers: the parameter dtype it casts to before the all-gather."""
    reduce_bytes: int
    """Bytes per element of gradients in the reduce-scatter and the all-reduce."""
    regather_in_backward: bool
    """FSDP reshards after forward, so backward gathers every unit again."""
    accumulation_steps: int
    """Forward-backward passes per optimizer step (gradient accumulation). >= 1."""

    def communication(self, topology: Topology, world_size: int) -> float:
        """Seconds per step: per accumulation step, the all-gathers (two when backward gathers again)
        and the reduce-scatter over the FSDP group, then the all-reduce across replicas (a
        reduce-scatter and an all-gather of the rank's gradient shard)."""
        return sum(self.per_level(topology, world_size).values())

    def per_level(self, topology: Topology, world_size: int) -> dict[int, float]:
        """:meth:`communication` by the level whose link carries it (each group's outermost)."""
        levels = topology.rank_levels(world_size)
        busy: dict[int, float] = {}

        def add(collective: Collective, size: int, stride: int, elements: float, element_bytes: int, times: int) -> None:
            if size == 1:
                return
            level = levels[(size - 1) * stride]
            link = topology.levels[level]
            moved = elements * (size - 1) / size
            seconds = moved * element_bytes / link.bandwidth(collective) + self.units * link.latency_us * 1e-6
            busy[level] = busy.get(level, 0.0) + times * self.accumulation_steps * seconds

        add("all_gather", self.fsdp_degree, self.fsdp_stride, self.dense_parameters, self.gather_bytes,
            2 if self.regather_in_backward else 1)
        add("reduce_scatter", self.fsdp_degree, self.fsdp_stride, self.dense_parameters, self.reduce_bytes, 1)
        for collective in ("reduce_scatter", "all_gather"):
            add(collective, self.replicas, self.replica_stride, self.shard_parameters, self.reduce_bytes, 1)
        return busy
