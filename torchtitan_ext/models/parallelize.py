"""Parallelize plan pieces shared by every model (DeepSeek-V3, Llama4, Qwen3, GPT-OSS).

:func:`parallelize_moe_model` gives the routed experts our per-expert loop
(:mod:`torchtitan_ext.ep.experts`), then applies, in torchtitan's order: TP (the model's
own dense plan), MoE parallelism (TP of router and shared experts, and the
configured EP backend on the routed experts), CP, activation checkpointing
(the backend's ops on the selective save list), torch.compile, and FSDP/HSDP
or DDP. Everything but the MoE step and the experts' loop is torchtitan's own code.
"""

import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.distributed.tensor import distribute_module, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import NoParallel
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp_to_attention_module
from torchtitan.distributed.dual_pipe_v import DualPipeExpertParallel, get_dual_pipe_v_flag
from torchtitan.distributed.expert_parallel import TensorParallel
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra.parallelize import apply_ddp
from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp
from torchtitan.tools.logging import logger

from torchtitan_ext.config import max_tokens_per_rank, MoEShape
from torchtitan_ext.ep import backend_class
from torchtitan_ext.ep.base import moe_layer_name
from torchtitan_ext.ep.experts import adopt_routed_experts
from torchtitan_ext.ep.replication import saved_transport_ops
from torchtitan_ext.ep.replication.experts import adopt_replica_slots, link_fetch_ahead
from torchtitan_ext.ep.replication.plan import dispatched_shape, fetches_ahead, ReplicaPlan
from torchtitan_ext.ep.replication.split import ReplicaRouter
from torchtitan_ext.models.moe import ExpertParallelMoE, TensorParallelTokenSplit

_layer_factories: dict[int, tuple[weakref.ref, Callable]] = {}


def expert_parallel_layers(job_config, model_args) -> Callable:
    """The backend's per-layer style constructor for this job.

    One per job config, so that every pipeline stage of a rank shares the
    backend's single buffer.
    """
    cached = _layer_factories.get(id(job_config))
    if cached is None or cached[0]() is not job_config:
        moe_args = model_args.moe_args
        shape = dispatched_shape(job_config, MoEShape(
            hidden_dim=model_args.dim,
            num_experts=moe_args.num_experts,
            top_k=moe_args.top_k,
            max_tokens_per_rank=max_tokens_per_rank(job_config),
        ))
        backend = backend_class(job_config)
        factory = backend.layer_factory(job_config, shape)
        for key in [k for k, (ref, _) in _layer_factories.items() if ref() is None]:
            del _layer_factories[key]
        _layer_factories[id(job_config)] = (weakref.ref(job_config), factory)
        settings = "; ".join(f"{k}: {v}" for k, v in backend.describe(job_config, shape).items())
        logger.info(f"Expert parallelism for {shape}: {settings}")
    return _layer_factories[id(job_config)][1]


class ScoresAfterTensorParallelExperts(ParallelStyle):
    """TP without EP, scores applied after the experts (DeepSeek-V3): applied to the MoE's router.

    The TP-sharded experts return partial outputs, and the router's scores
    multiply those, so each TP rank computes only a partial gradient for the
    scores. The router treats them as replicated: this style marks its output
    scores so that backward all-reduces their gradient over TP first
    (torchtitan 0.2.2 does not, and its routers' gradients are wrong). Scores
    applied before the experts (Llama4) need nothing: the experts' input
    gradient is all-reduced already.
    """

    @staticmethod
    def _mark_scores(module, outputs, tp_mesh):
        top_scores, *rest = outputs
        top_scores = DTensor.from_local(top_scores, tp_mesh, (Replicate(),), run_check=False)
        return (top_scores.to_local(grad_placements=(Partial(),)), *rest)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        # the gate's weight is NoParallel's already: nothing to partition here
        return distribute_module(module, device_mesh, partition_fn=lambda *_: None, output_fn=self._mark_scores)


def apply_moe_parallelism(model: torch.nn.Module, parallel_dims, job_config,
                          experts_tensor_parallel: type[ParallelStyle] = TensorParallel) -> None:
    """TP for the MoE layers' router and shared experts, and EP (or TP: ``experts_tensor_parallel``, the model's
    style for its experts' parameters) for the routed experts."""
    tp_mesh = parallel_dims.get_optional_mesh("tp")
    ep_mesh = parallel_dims.get_optional_mesh("ep")
    etp_enabled = parallel_dims.etp_enabled
    dual_pipe_v = get_dual_pipe_v_flag(job_config, parallel_dims)
    make_layer = expert_parallel_layers(job_config, model.model_args) if ep_mesh is not None else None

    for layer_id, block in model.layers.items():
        if not block.moe_enabled:
            continue
        if tp_mesh is not None:
            plan = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Partial(),),
                    desired_output_layouts=(Shard(1),),
                ),
                "moe.router.gate": NoParallel(),
            }
            if block.moe.shared_experts is not None:
                plan.update({
                    "moe.shared_experts.w1": ColwiseParallel(),
                    "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                    "moe.shared_experts.w3": ColwiseParallel(),
                })
            parallelize_module(block, tp_mesh, plan)

        if make_layer is None:
            parallelize_module(block.moe.experts, tp_mesh, experts_tensor_parallel())
            if not block.moe.score_before_experts:
                parallelize_module(block.moe.router, tp_mesh, ScoresAfterTensorParallelExperts())
            continue
        token_split = TensorParallelTokenSplit(tp_mesh) if tp_mesh is not None and not etp_enabled else None
        ExpertParallelMoE.adopt(block.moe, token_split)
        slots = job_config.expert_replication.slots_per_rank
        if slots:
            # no replicas until the first choice (torchtitan_ext.ep.replication.choice)
            plan = ReplicaPlan.empty(block.moe.experts.num_experts, ep_mesh.size(), slots)
            block.moe.replicas = ReplicaRouter(plan, ep_mesh.get_group())
            adopt_replica_slots(block.moe.experts, plan, ep_mesh.get_group())
        style = make_layer(score_before_experts=block.moe.score_before_experts)
        style.layer_name = moe_layer_name(layer_id)
        if slots:
            block.moe.experts.fetch_name = style.collective_name("replica fetch")
        # the metrics processor reads each layer's dispatch counters from its experts module
        block.moe.experts.dispatch_stats = style.stats
        if dual_pipe_v:
            style = DualPipeExpertParallel(style)
        mesh = parallel_dims.get_mesh(["ep", "etp"]) if etp_enabled else ep_mesh
        parallelize_module(block.moe.experts, mesh, style)
    if make_layer is not None and job_config.expert_replication.slots_per_rank and fetches_ahead(job_config):
        experts_fsdp = parallel_dims.get_optional_mesh("efsdp")
        link_fetch_ahead([block.moe.experts if block.moe_enabled else None for block in model.layers.values()],
                         after_experts=experts_fsdp is not None and experts_fsdp.size() > 1)


def ignore_profiler_ranges_in_selective_checkpointing() -> None:
    """Let per-op selective activation checkpointing skip profiler range markers.

    FSDP2 wraps each MoE's experts as its own unit inside the checkpointed
    block, and its hooks open a different number of ``record_function`` ranges
    in the forward than in the recompute (the all-gather is prefetched in one
    and not the other). Selective checkpointing counts every op and aborts at
    the first count that differs ("invocation index 3 encountered during
    backward but not found in storage"). The ranges are profiling markers with
    no output to cache, so they join the ops SAC already lets through.
    """
    SAC_IGNORED_OPS.update((
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    ))


def parallelize_moe_model(
    model: torch.nn.Module,
    parallel_dims,
    job_config,
    *,
    apply_dense_tp: Callable[[torch.nn.Module, object], None],
    op_sac_save_list: set,
    experts_tensor_parallel: type[ParallelStyle] = TensorParallel,
) -> torch.nn.Module:
    """Apply every configured parallelism; ``apply_dense_tp(model, tp_mesh)`` is the model's own TP plan,
    ``experts_tensor_parallel`` its style for the routed experts under TP without EP (torchtitan's for w1, w2, w3
    by default). ``job_config`` has passed config validation at the job's world size, which refuses CP without SDPA
    and a sequence length that TP x 2 x CP does not divide."""
    adopt_routed_experts(model)
    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.get_mesh("tp")
        apply_dense_tp(model, tp_mesh)
        maybe_enable_async_tp(job_config, tp_mesh)

    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        apply_moe_parallelism(model, parallel_dims, job_config, experts_tensor_parallel)

    if parallel_dims.cp_enabled:
        apply_cp_to_attention_module(
            [block.attention.inner_attention for block in model.layers.values()],
            parallel_dims.get_mesh("cp"),
            getattr(model.model_args, "attn_type", "sdpa"),
        )

    model_compile_enabled = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        ignore_profiler_ranges_in_selective_checkpointing()
        if parallel_dims.ep_enabled:
            op_sac_save_list = op_sac_save_list | set(backend_class(job_config).sac_save_ops())
        if job_config.expert_replication.slots_per_rank:
            op_sac_save_list = op_sac_save_list | saved_transport_ops()
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=model_compile_enabled,
            op_sac_save_list=op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )

    if model_compile_enabled:
        apply_compile(model, job_config.compile, parallel_dims.ep_enabled)

    dp_mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_optional_mesh(dp_mesh_names)
    # EP with no data-parallel shard dimension (EP borrowing all of TP, dp_shard x cp = 1) has
    # nothing to shard: every expert lives on one rank (config validation ensures efsdp = 1)
    if dp_mesh is not None and (parallel_dims.fsdp_enabled or parallel_dims.ep_enabled):
        edp_mesh_names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            ep_degree=parallel_dims.ep,
            edp_mesh=parallel_dims.get_optional_mesh(edp_mesh_names),
            gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor,
        )
        logger.info(f"Applied {'HSDP' if parallel_dims.dp_replicate_enabled else 'FSDP'} to the model")
    elif parallel_dims.dp_replicate_enabled:
        dp_mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != dp_mesh.size():
            raise RuntimeError("DDP does not support > 1D parallelism")
        apply_ddp(model, dp_mesh, enable_compile=model_compile_enabled)
    return model
