"""What the layout advisor needs from a job: its MoE dims, dtypes, FLOPs and data-parallel traffic per rank and
step (:class:`JobShape`, from the model built on the meta device), and the memory a layout needs at an EP degree."""

from dataclasses import dataclass

import torch
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.config import TORCH_DTYPE_MAP

from torchtitan_ext.config import ConfigError, shared_meta_model
from torchtitan_ext.planning.cost_model import DataParallelSync, MoEWorkload
from torchtitan_ext.planning.memory_plan import replica_copies_alive, saved_moe_layers
from torchtitan_ext.planning.pipeline_split import pipeline_split


@dataclass(frozen=True)
class JobShape:
    """What the cost model needs from a job, for one rank and step."""

    work: MoEWorkload
    moe_layers: int
    """MoE layers the busiest rank runs: all of the model's without pipeline parallelism, else the most any
    pipeline rank runs (:mod:`.pipeline_split`; with ``pass_flops``, an upper bound where two ranks hold them)."""
    recomputed_layers: int
    """MoE layers whose forward activation checkpointing recomputes in backward, collectives
    included (those whose dispatched rows are not saved)."""
    dispatches: int
    """MoE calls per layer and step: gradient-accumulation steps x pipeline microbatches."""
    pass_flops: float
    """FLOPs the busiest rank computes in one forward-backward pass of a microbatch: torchtitan's count (6 x
    active parameters + attention), of that rank's pipeline stages."""
    expert_world: int
    """Ranks the experts are spread over: EP degree x expert-FSDP degree."""
    data_parallel_sync: DataParallelSync
    """FSDP's traffic outside the routed experts and HSDP's across replicas (the same at every EP layout)."""
    parameter_share: float
    """The fraction of the model's parameters one rank holds and steps (FSDP and EP shard them all), in
    (0, 1]."""
    expert_flop_share: float
    """The routed experts' share of a pass's FLOPs, in [0, 1): the part of the compute that an EP rank's
    load scales."""
    model_pass_flops: float
    """The model's FLOPs of one pass of a microbatch over its pipeline ranks: the mean rank's, what a published
    TFLOPS/GPU counts (``pass_flops`` without pipeline parallelism)."""
    replica_copies: tuple[int, int] = (0, 0)
    """Under expert replication, :func:`~torchtitan_ext.planning.memory_plan.replica_copies_alive`."""
    pipeline_bubble: float = 0.0
    """The pipeline schedule's idle time over a rank's busy time (:attr:`.PipelineSplit.bubble`), >= 0."""
    mxfp8_flop_share: float = 0.0
    """The part of ``pass_flops`` in GEMMs the job's MXFP8 converters quantize (:func:`mxfp8_parameters`), in
    [0, 1)."""
    experts_in_mxfp8: bool = False
    """Whether the routed experts' grouped GEMMs are among them."""
    in_flight_microbatches: int = 1
    """Microbatches whose saved activations the busiest rank holds at once: 1F1B's warm-up on the first
    pipeline rank, min(PP, microbatches); 1 without pipeline parallelism."""

    @property
    def recompute_factor(self) -> float:
        """Forward-backward passes' cost with activation checkpointing over without (a recomputed
        forward: a third of a pass, counted for the recomputed share of the MoE layers), in [1, 4/3]."""
        return 1 + self.recomputed_layers / self.moe_layers / 3

    @property
    def step_flops(self) -> float:
        """FLOPs of one rank's step: every MoE call's pass, plus the recomputed forwards' share."""
        return self.pass_flops * self.dispatches * self.recompute_factor


def mxfp8_parameters(job_config, model) -> set[str]:
    """The parameters whose GEMMs run in MXFP8 under the job's converters, by the modules torchtitan 0.2.2 converts:
    ``quantize.linear.mx`` each ``nn.Linear`` its ``module_filter_fn`` keeps (both dims multiples of 16, no
    ``filter_fqns`` in the module's name); ``quantize.grouped_mm.mx`` the routed experts' weights in a module whose
    name holds one of its ``fqns`` (what a grouped GEMM reads; other matches run as before)."""
    converters = set(job_config.model.converters)
    mx = job_config.quantize
    picked = set()
    for fqn, module in model.named_modules():
        if "quantize.linear.mx" in converters and module_filter_fn(module, fqn, mx.linear.mx.filter_fqns):
            picked.add(f"{fqn}.weight")
        if "quantize.grouped_mm.mx" in converters and any(target in fqn for target in mx.grouped_mm.mx.fqns):
            picked.update(f"{fqn}.{name}" for name, _ in module.named_parameters(recurse=False)
                          if ".moe.experts." in f".{fqn}.{name}")
    return picked


def job_shape(job_config, world_size: int) -> JobShape:
    """The job's MoE dims, dtypes and FLOPs, from its model built on the meta device."""
    model = shared_meta_model(job_config)
    model_args = model.model_args
    moe_args = model_args.moe_args
    expert_parameters, dense_parameters, moe_layers = 0, 0, set()
    # 6 x active parameters per token of each top-level module, as torchtitan counts FLOPs (embeddings apart), and
    # the part the job's MXFP8 converters run in MXFP8
    module_flops: dict[str, float] = {}
    module_mxfp8_flops: dict[str, float] = {}
    mxfp8_names = mxfp8_parameters(job_config, model)
    experts_in_mxfp8 = False
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        module = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        routed = ".moe.experts." in f".{name}"
        if routed:
            expert_parameters += parameter.numel()
            moe_layers.add(int(parts[1]))
        else:
            dense_parameters += parameter.numel()
        active = parameter.numel() * (moe_args.top_k / moe_args.num_experts if routed else 1)
        flops = 0.0 if module == "tok_embeddings" else 6 * active
        module_flops[module] = module_flops.get(module, 0.0) + flops
        if name in mxfp8_names:
            experts_in_mxfp8 |= routed
            module_mxfp8_flops[module] = module_mxfp8_flops.get(module, 0.0) + flops
    if not moe_layers:
        raise ConfigError(f"model {job_config.model.name} {job_config.model.flavor} has no MoE layers: nothing to advise")
    per_expert = expert_parameters // len(moe_layers) // moe_args.num_experts
    _, flops_per_token = model_args.get_nparams_and_flops(model, job_config.training.seq_len)
    p, training = job_config.parallelism, job_config.training
    split = pipeline_split(job_config, model_args.n_layers)
    # attention's FLOPs (what torchtitan counts beyond the parameters), the same in every layer
    attention = max(0.0, flops_per_token - sum(module_flops.values())) / model_args.n_layers

    def rank_flops(modules) -> float:
        return sum(module_flops.get(m, 0.0) + (attention if m.startswith("layers.") else 0.0) for m in modules)

    total_flops = sum(map(rank_flops, split.rank_modules))
    busiest = max(split.rank_modules, key=rank_flops)
    rank_share = rank_flops(busiest) / total_flops

    def moe_layers_of(modules) -> int:
        return sum(m.startswith("layers.") and int(m.split(".")[1]) in moe_layers for m in modules)

    # the MoE work of the rank with the most MoE layers (the output layer may make another rank's FLOPs the most)
    busiest_moe = max(split.rank_modules, key=moe_layers_of)
    mxfp8_share = sum(module_mxfp8_flops.get(m, 0.0) for m in busiest) / rank_flops(busiest)
    layers = tuple(int(m.split(".")[1]) for m in busiest_moe if m.startswith("layers."))
    rank_moe_layers = tuple(layer for layer in layers if layer in moe_layers)
    saved, _ = saved_moe_layers(job_config, layers, rank_moe_layers)
    replica_copies = replica_copies_alive(job_config, layers, rank_moe_layers, copied=True)  # grouped GEMMs
    recomputed = len(rank_moe_layers) - saved
    microbatch = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else training.local_batch_size
    tokens = microbatch * training.seq_len // p.context_parallel_degree
    if p.tensor_parallel_degree > 1 and p.expert_tensor_parallel_degree == 1:
        tokens //= p.tensor_parallel_degree
    data_parallel = world_size // (p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree)
    accumulation = max(1, training.global_batch_size // (training.local_batch_size * data_parallel))
    dispatches = accumulation * (training.local_batch_size // microbatch)
    routed_per_layer = 6 * moe_args.top_k * per_expert
    forward_outside_experts = (flops_per_token - routed_per_layer * len(moe_layers)) / 3 / model_args.n_layers

    def element(dtype: str) -> int:
        return torch.empty((), dtype=TORCH_DTYPE_MAP[dtype]).element_size()

    reshard = p.fsdp_reshard_after_forward
    work = MoEWorkload(
        tokens=tokens,
        hidden=model_args.dim,
        top_k=moe_args.top_k,
        experts=moe_args.num_experts,
        expert_parameters=per_expert,
        activation_bytes=element(training.mixed_precision_param),
        gather_bytes=element(training.mixed_precision_param),
        reduce_bytes=element(training.mixed_precision_reduce),
        pre_expert_flops=forward_outside_experts * tokens,
        prefetch_flops=flops_per_token / 3 / model_args.n_layers * tokens,
        regather_in_backward=reshard == "always" or (reshard == "default" and p.pipeline_parallel_degree == 1),
        expert_groups=moe_args.num_expert_groups,
        limited_groups=moe_args.num_limited_groups,
    )
    expert_world = world_size // (
        p.pipeline_parallel_degree * p.data_parallel_replicate_degree * p.expert_tensor_parallel_degree
    )
    # every parameter is split over all ranks but the replicas (FSDP and EP, TP and PP shard it)
    parameter_share = p.data_parallel_replicate_degree / world_size
    fsdp_degree = data_parallel // p.data_parallel_replicate_degree * p.context_parallel_degree
    data_parallel_sync = DataParallelSync(
        # PP and TP split as if evenly (TP leaves norms and routers whole: each rank holds a little more)
        dense_parameters=dense_parameters // (p.pipeline_parallel_degree * p.tensor_parallel_degree),
        # the blocks, the embeddings and the output layer, one unit each (torchtitan's apply_fsdp); every
        # unit counts as re-gathered in backward, though the output layer is not by default, and as on
        # every stage, though only the first and last hold the embeddings and the output
        units=model_args.n_layers // p.pipeline_parallel_degree + 2,
        fsdp_degree=fsdp_degree,
        fsdp_stride=p.tensor_parallel_degree,
        replicas=p.data_parallel_replicate_degree,
        # torchtitan's mesh: pp, dp_replicate, dp_shard, cp, tp (innermost last)
        replica_stride=fsdp_degree * p.tensor_parallel_degree,
        shard_parameters=round((dense_parameters + expert_parameters) * parameter_share),
        gather_bytes=work.gather_bytes,
        reduce_bytes=work.reduce_bytes,
        regather_in_backward=work.regather_in_backward,
        accumulation_steps=accumulation,
    )
    rank_flops_per_token = flops_per_token * rank_share
    return JobShape(
        work, len(rank_moe_layers), recomputed, dispatches, rank_flops_per_token * tokens, expert_world,
        data_parallel_sync, parameter_share, routed_per_layer * len(rank_moe_layers) / rank_flops_per_token,
        flops_per_token * tokens / split.degree, replica_copies, pipeline_bubble=split.bubble,
        in_flight_microbatches=min(split.degree, split.microbatches), mxfp8_flop_share=mxfp8_share,
        experts_in_mxfp8=experts_in_mxfp8,
    )


STATE_BYTES_PER_PARAMETER = 16
"""fp32 parameter, fp32 gradient and AdamW's two fp32 moments: what FSDP shards for each parameter."""


def memory_needed(shape: JobShape, ep: int, gathered_expert_bytes: int, buffer_bytes: int | None, rows_ratio: float,
                  replica_slots: int, replica_region_bytes: int = 0) -> int:
    """:attr:`Layout.memory_bytes` of a layout at ``ep``; ``replica_region_bytes``: what the backend reserves beside
    its buffer for its own kernels to carry the replicas (:meth:`~torchtitan_ext.ep.planning_profile.PlanningProfile.planned_replica_region`)."""
    work = shape.work
    state = shape.data_parallel_sync.shard_parameters * STATE_BYTES_PER_PARAMETER
    saved_layers = shape.moe_layers - shape.recomputed_layers
    rows = (work.tokens * work.top_k * rows_ratio * work.hidden * work.activation_bytes * saved_layers
            * shape.in_flight_microbatches if ep > 1 else 0)
    # with replica slots each MoE layer's grouped GEMMs (SM90 on) compute from a copy of its home experts beside the
    # replicas, which backward keeps (the per-expert loop of an older GPU computes from views: less); torchtitan's
    # grouped GEMM saves a bf16 copy of it, so at most 2 bytes count (a bound)
    expert_bytes = work.expert_parameters * min(work.gather_bytes, 2)
    copies, fetched = shape.replica_copies
    replica_copies = ((copies * (work.experts // ep + replica_slots) + fetched * replica_slots) * expert_bytes
                      if replica_slots else 0)
    return round(state + 2 * gathered_expert_bytes + (buffer_bytes or 0) + replica_region_bytes + rows + replica_copies)
