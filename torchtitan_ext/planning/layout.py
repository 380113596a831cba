"""One priced EP layout (backend, EP and expert-FSDP degree, replica slots, settings) and what the advisor
predicts of it: its step, communication, local work, memory and links."""

from dataclasses import dataclass

from torchtitan_ext.ep import PLANNING_PROFILES
from torchtitan_ext.planning.cost_model import LayerCosts
from torchtitan_ext.planning.local_traffic import LocalTraffic


@dataclass(frozen=True)
class Layout:
    backend: str
    ep: int
    efsdp: int
    refused: str | None
    """The job config's validation error for this layout; None when it runs."""
    costs: LayerCosts | None = None
    moe_layers: int = 0
    recomputed_layers: int = 0
    dispatches: int = 1
    compute_s: float = 0.0
    dispatch_work_s: float = 0.0
    """The backend's local work per MoE call (dispatch and combine, forward and backward, without the
    collectives and library kernels): measured on this machine under a measured compute (0 at EP = 1, where the
    measured step holds torchtitan's own sort); else its counted passes over the token rows
    (``local_traffic``, torchtitan's sort at EP = 1) at the topology's memory bandwidth; 0 without either."""
    dispatch_forward_share: float = 0.5
    """The forward's part of ``dispatch_work_s``, which a recomputed layer runs again (a half where only the
    whole call is timed)."""
    local_traffic: LocalTraffic | None = None
    """The bytes one MoE call moves outside the kernels as counted in a group of one (:mod:`.local_traffic`), when
    they price the local work."""
    received_tokens: float = 1.0
    """Token vectors the mean rank holds per token it sends: for a backend that sends each token once per rank,
    the EP ranks one token reaches (uniform routing); 1 otherwise."""
    data_parallel_s: float = 0.0
    """Data parallelism's traffic outside the routed experts' FSDP, per step (:class:`DataParallelSync`)."""
    overlap: bool = True
    gathered_expert_bytes: int = 0
    """Experts one layer's all-gather materialises on this rank (transient)."""
    buffer_bytes: int | None = None
    """The backend's communication buffer on one rank (the planner's count; None: unknown here)."""
    a2a_level: str = ""
    """The outermost topology level the EP group's all-to-all crosses ("" at EP = 1)."""
    gather_level: str = ""
    """The outermost level the expert-FSDP group's all-gather crosses ("" at efsdp = 1)."""
    replica_slots: int = 0
    """This layout's ``expert_replication.slots_per_rank``."""
    settings: tuple[tuple[str, str, object], ...] = ()
    """(section, field, value) of the backend's own section priced in place of the job's
    (:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.advised_alternatives`); empty: the job's."""
    ep_settings: tuple[tuple[str, str, object], ...] = ()
    """(section, field, value) of the backend's own section that follow from this layout's EP degree, set in place
    of the job's (:func:`~torchtitan_ext.planning.layout_links.settings_at_ep`); empty: the job's hold."""
    job_replica_slots: int = 0
    """The job's own ``expert_replication.slots_per_rank`` (the overrides name the slots when they differ)."""
    rows_ratio: float = 1.0
    """The busiest EP rank's expert rows over the mean rank's, >= 1: 1 under uniform routing; under measured
    routing the dump's, after the replicas' split (:mod:`.replica_cost`)."""
    expert_compute_s: float = 0.0
    """The routed experts' part of ``compute_s``, which a rank's load scales: their FLOP share, or their
    measured time under a measured compute."""
    replica_fetch_s: float = 0.0
    """One forward's fetch of the replicas' weights and exchange of the pair counts, per MoE layer and call."""
    replica_return_s: float = 0.0
    """One backward's return of the replicas' gradients, per MoE layer and call."""
    kernel_rates: str = ""
    """Which published figures priced this backend's all-to-all on each link (:func:`describe_kernel_rates`)."""
    rate_evidence: tuple[str, ...] = ()
    """Where the rate of each link its all-to-all crosses comes from, one entry per link, innermost first
    (:func:`~torchtitan_ext.planning.layout_links.rate_evidence`); none at EP = 1."""
    model_flops: float = 0.0
    """Model FLOPs of one rank's step as torchtitan counts them for its TFLOPS (6 x active parameters +
    attention, per token; recomputed forwards not counted): the mean pipeline rank's."""
    memory_bytes: int = 0
    """What one rank needs at least: its shard of parameters, gradients and AdamW state, two layers'
    gathered experts (the one computing and the one FSDP prefetches), the backend's buffer, the
    dispatched rows kept for backward (of each microbatch a pipeline rank holds in flight) and, with replica slots, the copy of home and replica experts each
    MoE layer computes from. Activations outside the MoE are not counted: a lower bound."""
    link_busy: tuple[tuple[str, float], ...] = ()
    """(link, seconds per step it carries) for each physical link: the EP all-to-alls, expert FSDP's
    gathers and reduce-scatters, the data-parallel sync and the replicas' traffic, hidden or not: a
    link that carries more than the step can hide bounds the step."""
    nominal_links: tuple[str, ...] = ()
    """Links of a named fabric that this layout's all-to-all crosses, priced at their nominal rate because
    the backend publishes no figure for them: its time there is a lower bound."""
    nominal_fabrics: tuple[str, ...] = ()
    """The fabric of each of ``nominal_links``, in their order."""
    mxfp8_flop_share: float = 0.0
    """The part of the compute's FLOPs in MXFP8 GEMMs (the job's converters), which ``compute_s`` prices at the
    topology's MXFP8 rate."""
    pipeline_bubble: float = 0.0
    """The pipeline schedule's idle time over a rank's busy time (:attr:`.PipelineSplit.bubble`): the step
    stretches the busiest rank's compute and MoE work by 1 + this. 0 without pipeline parallelism."""
    a2a_overlap: bool = False
    """Whether the job runs each MoE layer's all-to-alls beside another microbatch's compute (DualPipeV's
    overlapped EP, or a published run's equivalent): then only what that compute cannot hide is exposed."""
    communication_sm_share: float = 0.0
    """The share of a GPU's SMs the backend's communication kernels hold, in [0, 1), which the GEMMs beside them
    lose while they run (priced under ``a2a_overlap`` only; 0 where the backend's SM count or the topology's is
    unknown: ``sm_note`` says which)."""
    sm_note: str = ""
    """Why ``communication_sm_share`` is 0 under ``a2a_overlap``, or ""."""
    fitted_step_s: float | None = None
    """With ``nominal_links``: the step with them at the rate a fit gives the backend there
    (docs/advisor_fit.toml), the other end of the range the nominal rate opens; None where no fit row covers
    them, or where the layout is priced."""

    def _per_step(self, per_layer) -> float:
        kept = self.moe_layers - self.recomputed_layers
        return self.dispatches * (per_layer(False) * kept + per_layer(True) * self.recomputed_layers)

    @property
    def communication_s(self) -> float:
        return self._per_step(self.costs.communication)

    @property
    def compute_per_layer_call_s(self) -> float:
        """The step's compute spread over its MoE layer calls (dense layers' share included): what another
        microbatch computes beside one layer's all-to-alls under ``a2a_overlap``."""
        return self.compute_s / (self.dispatches * max(self.moe_layers, 1))

    @property
    def exposed_s(self) -> float:
        beside = self.compute_per_layer_call_s if self.a2a_overlap else None
        return self._per_step(lambda recomputed: self.costs.exposed(
            self.overlap, recomputed, beside, self.communication_sm_share))

    @property
    def local_work_s(self) -> float:
        """The backend's local work per step; a recomputed layer runs its forward part again."""
        return self._per_step(
            lambda recomputed: self.dispatch_work_s * (1 + self.dispatch_forward_share if recomputed else 1.0)
        )

    @property
    def imbalance_s(self) -> float:
        """The busiest rank's expert compute above the mean rank's, per step."""
        return self.expert_compute_s * (self.rows_ratio - 1)

    @property
    def replica_s(self) -> float:
        """The replicas' traffic per step; a recomputed layer fetches (and counts) again."""
        return self._per_step(lambda recomputed: self.replica_fetch_s * (2 if recomputed else 1) + self.replica_return_s)

    @property
    def moe_s(self) -> float:
        """What the layout adds to the step: exposed MoE communication, the backend's local work, the busiest
        rank's extra expert compute and the replicas' traffic."""
        return self.exposed_s + self.local_work_s + self.imbalance_s + self.replica_s

    @property
    def tflops_per_gpu(self) -> float:
        """Predicted model TFLOP/s per GPU: the step's model FLOPs over its predicted time (as torchtitan reports)."""
        return self.model_flops / self.step_s / 1e12

    @property
    def data_parallel_exposed_s(self) -> float:
        """Data-parallel time the step waits for: with overlap, what compute cannot hide (FSDP prefetches
        the next unit's gather during this one's compute); without, all of it."""
        return max(0.0, self.data_parallel_s - self.compute_s) if self.overlap else self.data_parallel_s

    @property
    def busiest_link(self) -> tuple[str, float]:
        """(link, seconds per step) of the link that carries the most."""
        return max(self.link_busy, key=lambda item: item[1], default=("", 0.0))

    @property
    def pipelined_s(self) -> float:
        """The busiest rank's compute and MoE work per step, with the pipeline's bubble."""
        return (self.compute_s + self.moe_s) * (1 + self.pipeline_bubble)

    @property
    def step_s(self) -> float:
        """Predicted step time: compute, the backend's local work and the exposed MoE communication (with the
        pipeline's bubble), and the exposed data-parallel communication (the smaller collectives, the loss's and
        the gradient norm's all-reduces, and the pipeline's sends between stages are left out); at least the
        busiest link's traffic, which overlap cannot hide from itself."""
        return max(self.pipelined_s + self.data_parallel_exposed_s, self.busiest_link[1])

    @property
    def link_bound(self) -> bool:
        """Whether the busiest link's traffic, not compute and exposed communication, sets the step."""
        return self.busiest_link[1] > self.pipelined_s + self.data_parallel_exposed_s

    @property
    def label(self) -> str:
        """The backend, and the settings of its section priced in place of the job's ("deepep legacy",
        "hybridep 16/32")."""
        if not self.settings:
            return self.backend
        return f"{self.backend} {PLANNING_PROFILES[self.backend].settings_label({field: value for _, field, value in self.settings})}"

    def overrides(self) -> list[str]:
        selected = ["--parallelism.expert_parallel_comm_backend", self.backend, "--parallelism.expert_parallel_degree", str(self.ep)]
        for section, field, value in (*self.ep_settings, *self.settings):
            selected += [f"--{section}.{field}", str(value)]
        if self.replica_slots != self.job_replica_slots:
            selected += ["--expert_replication.slots_per_rank", str(self.replica_slots)]
        return selected
