"""Measures one rank's compute per training step on this machine (:class:`~torchtitan_ext.planning.measured_compute.MeasuredCompute`).

``python -m torchtitan_ext.plan ... --topology T --measure-compute``: one process per rank (one thread each,
all at once) builds the job's model as the trainer does here, times forward and backward of one rank's
batch, gradient clipping and the optimizer step; then the routed experts alone on the rows each MoE layer
saw; then each backend's local work (one MoE call's dispatch and combine in a group of one, less its
collectives replayed alone and less torchtitan's own sort). What it measures and leaves out, and why FLOPs
do not price a CPU step: docs/planning.md, "Calibrate it on your own cluster" (``--measure-compute``).
"""

import copy
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe import MoE
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_ext import runtime
from torchtitan_ext.config import ConfigError, load_job_config, model_class_and_args, MoEShape, parse, shared_meta_model
from torchtitan_ext.data import check_tokenizer_folder, prepare_embedded_assets
from torchtitan_ext.ep import BACKENDS
from torchtitan_ext.ep.base import destroy_kernel_buffers
from torchtitan_ext.ep.experts import adopt_routed_experts
from torchtitan_ext.measuring.collective_recorder import CollectiveRecorder
from torchtitan_ext.planning.local_traffic import backend_forward, MoECall, torchtitan_sort_forward
from torchtitan_ext.planning.measured_compute import MeasuredCompute
from torchtitan_ext.runtime.memory import memory_limit_bytes
from torchtitan_ext.runtime.workers import run_workers
from torchtitan_ext.training import prepare
from torchtitan_ext.training.validator import ATTENTION_WITH_MASKS

WARMUP_STEPS = 2
TIMED_STEPS = 4
MEASURE_DEADLINE = timedelta(hours=1)
"""Longest a measurement may run, and a rank wait in one of its collectives."""
BYTES_PER_PARAMETER = 16
"""A float32 parameter, its gradient and AdamW's two moments (activations and a low-precision copy come on
top: the memory check refuses well before it matters)."""


def check_measurable(job_config, world_size: int) -> None:
    """ConfigError unless this machine can measure the job's per-rank compute as a whole-model pass (the caller
    also loads the job as a CPU job, so that what a CPU job refuses is refused before any process starts; this
    check first, whose fixes name --measure-compute)."""
    if runtime.device_type() != "cpu":
        raise ConfigError(
            "--measure-compute times a CPU job, and this machine trains on CUDA: drop --measure-compute "
            "(FLOPs at the topology's compute_tflops)"
        )
    p = job_config.parallelism
    for field, degree in (
        ("tensor_parallel_degree", p.tensor_parallel_degree),
        ("pipeline_parallel_degree", p.pipeline_parallel_degree),
        ("context_parallel_degree", p.context_parallel_degree),
    ):
        if degree > 1:
            raise ConfigError(
                f"--measure-compute times one rank's forward and backward through the whole model, which "
                f"parallelism.{field} = {degree} splits: drop --measure-compute (FLOPs at the topology's "
                f"compute_tflops), or ask about the job with {field} = 1"
            )
    most = runtime.max_local_world_size()
    if world_size > most:
        raise ConfigError(
            f"--measure-compute starts one process per rank on this machine, and --world-size {world_size} is more "
            f"than the {most} ranks it can run: it measures a job this machine runs; drop --measure-compute for "
            "another machine's job"
        )
    model = shared_meta_model(job_config)
    if not any(isinstance(module, MoE) for module in model.modules()):
        raise ConfigError(
            f"--measure-compute times the routed experts of the model's MoE layers, and model.name = "
            f"'{job_config.model.name}' builds none: drop --measure-compute (FLOPs at the topology's compute_tflops)"
        )
    if _takes_attention_masks(job_config):
        # the trainer builds such a model's masks with the tokenizer (its end-of-text id ends block_causal's documents)
        check_tokenizer_folder(job_config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    needed = world_size * parameters * BYTES_PER_PARAMETER
    memory = memory_limit_bytes()
    if needed > memory // 2:
        raise ConfigError(
            f"--measure-compute builds the whole model ({parameters / 1e6:,.0f}M parameters) in each of "
            f"{world_size} processes: {needed / 2**30:,.1f} GiB of parameters and optimizer state, more than half "
            f"of the {memory / 2**30:,.1f} GiB of memory this machine gives this process; drop --measure-compute for a model this machine cannot train"
        )


def _takes_attention_masks(job_config) -> bool:
    return getattr(model_class_and_args(job_config)[1], "attn_type", "sdpa") in ATTENTION_WITH_MASKS


def _measure(rank: int, world_size: int, train_args: list[str]) -> tuple:
    """One rank's (forward-backward and optimizer times per timed step, the routed experts' times, the dispatch
    times of :func:`_time_dispatch`)."""
    prepare()
    job_config = load_job_config(train_args, device_type="cpu", world_size=world_size)
    model_cls, model_args = model_class_and_args(job_config)
    torch.manual_seed(rank)
    model = model_cls(model_args)
    # the experts' loop a CPU job trains with (the parallelize plan's, which this model does not go through)
    adopt_routed_experts(model)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    one_rank = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    # torchtitan's optimizers with the job's settings, without the train spec's MoE hook (the expert-bias update, a
    # few small tensors and an all-reduce over the job's loss mesh, which this one-rank model has not built)
    optimizers = build_optimizers([model], job_config.optimizer, one_rank)
    compute_model = _in_parameter_dtype(model, TORCH_DTYPE_MAP[job_config.training.mixed_precision_param])
    training = job_config.training
    tokens = torch.randint(0, model_args.vocab_size, (training.local_batch_size, training.seq_len))
    masks = {}
    if _takes_attention_masks(job_config):
        # the masks the trainer builds for a FlexAttention or varlen model (its post_dataloading_process)
        tokenizer = get_train_spec(job_config.model.name).build_tokenizer_fn(job_config)
        masks["attention_masks"] = model.get_attention_masks(input_batch=tokens, tokenizer=tokenizer)
    timings = []
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        # every step starts together, as the ranks of a synchronous step do
        dist.barrier()
        began = time.perf_counter()
        if compute_model is not model:
            with torch.no_grad():
                for master, cast in zip(model.parameters(), compute_model.parameters()):
                    cast.copy_(master)
        logits = compute_model(tokens, **masks)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
        if compute_model is not model:
            for master, cast in zip(model.parameters(), compute_model.parameters()):
                master.grad, cast.grad = (None if cast.grad is None else cast.grad.float()), None
        passed = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_norm)
        optimizers.step()
        optimizers.zero_grad()
        if step >= WARMUP_STEPS:
            timings.append((passed - began, time.perf_counter() - passed))
    experts_times = _timed(_routed_experts_pass(compute_model, tokens, masks))
    dtype = next(compute_model.parameters()).dtype
    return timings, experts_times, _time_dispatch(train_args, model_args, tokens.numel(), dtype)


def _routed_experts_pass(model: torch.nn.Module, tokens: torch.Tensor, masks: dict):
    """A call that runs every MoE layer's routed experts forward and backward on the rows and per-expert
    counts the layer received in one forward of ``tokens`` (with ``masks``, the model's keyword arguments)."""
    received = []

    def keep(experts, args, output):
        rows, counts = args
        received.append((experts, rows.detach(), counts, torch.randn_like(output)))

    handles = [module.experts.register_forward_hook(keep) for module in model.modules() if isinstance(module, MoE)]
    try:
        with torch.no_grad():
            model(tokens, **masks)
    finally:
        for handle in handles:
            handle.remove()

    def run():
        for experts, rows, counts, grad in received:
            experts(rows.requires_grad_(), counts).backward(grad)
            rows.grad = None
        model.zero_grad(set_to_none=True)

    return run


def _time_dispatch(train_args: list[str], model_args, tokens: int, dtype: torch.dtype) -> tuple:
    """(times of torchtitan's own sort around the experts: its MoE.forward at EP = 1, the experts as the
    identity; per backend: (times of one MoE call's dispatch + combine, forward and backward; times of its
    collectives alone)), in a subgroup of this rank alone."""
    alone, _ = dist.new_subgroups(group_size=1)
    try:
        moe = model_args.moe_args
        shape = MoEShape(model_args.dim, moe.num_experts, moe.top_k, tokens)
        moe_call = MoECall.random(shape, tokens, dtype)
        grad = torch.randn(tokens, model_args.dim, generator=torch.Generator().manual_seed(1)).to(dtype)

        def torchtitan_sort():
            torchtitan_sort_forward(moe_call, shape, moe.score_before_experts).backward(grad)

        sort_times, timings = _timed(torchtitan_sort), {}
        for name, backend in BACKENDS.items():
            config = parse([*train_args, "--parallelism.expert_parallel_comm_backend", name])
            style = backend.layer_factory(config, shape)(score_before_experts=moe.score_before_experts)

            def call():
                backend_forward(style, moe_call, shape, alone).backward(grad)

            with CollectiveRecorder() as recorder:
                call()
            collectives, _ = recorder.replay_plan()
            timings[name] = (_timed(call), _timed(lambda: [c() for c in collectives]))
        return sort_times, timings
    finally:
        destroy_kernel_buffers()  # built on the subgroup: released while it lives
        dist.destroy_process_group(alone)


def _timed(fn) -> list[float]:
    """Seconds of each timed call of ``fn``, every call started with all processes together."""
    times = []
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        dist.barrier()
        began = time.perf_counter()
        fn()
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - began)
    return times


def _in_parameter_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model FSDP's mixed precision computes with: parameters cast to ``dtype`` (copied from the float32
    master before each step, as FSDP casts at its all-gather), buffers as they are."""
    if dtype == torch.float32:
        return model
    cast = copy.deepcopy(model)
    for parameter in cast.parameters():
        parameter.data = parameter.data.to(dtype)
    return cast


def measure_compute(train_args: list[str], world_size: int) -> MeasuredCompute:
    """Time the job's per-rank compute with ``world_size`` processes at once (:func:`run_workers`'s): 28 s on 2 cores
    for the debug model at 4 ranks."""
    print(f"[measure-compute] {world_size} processes, one thread each: {WARMUP_STEPS} warm-up and "
          f"{TIMED_STEPS} timed forward/backward passes and optimizer steps of the job's model, then of each "
          "backend's dispatch + combine", flush=True)
    job_config = parse(train_args)
    if _takes_attention_masks(job_config):
        prepare_embedded_assets(job_config)  # the tokenizer, built before the ranks read it
    # a model as large as the memory check admits takes minutes per step on a CPU, and a rank may wait that long at a
    # step's barrier: an hour for the run and for each collective (run_workers' defaults: 7 and 2 minutes)
    per_rank = run_workers(world_size, _measure, train_args, preload=[__name__],
                           deadline_s=MEASURE_DEADLINE.total_seconds(), timeout=MEASURE_DEADLINE)
    def slowest_median(series) -> float:
        """Median over steps of the slowest process's time: a synchronous step waits for it."""
        return statistics.median(max(calls) for calls in zip(*series))

    forward_backward = slowest_median([[passed for passed, _ in timings] for timings, _, _ in per_rank])
    optimizer = slowest_median([[stepped for _, stepped in timings] for timings, _, _ in per_rank])
    routed_experts = slowest_median([experts_times for _, experts_times, _ in per_rank])
    torchtitan_sort = slowest_median([sort_times for _, _, (sort_times, _) in per_rank])
    dispatch_work = {}
    for name in BACKENDS:
        calls = slowest_median([dispatch[name][0] for _, _, (_, dispatch) in per_rank])
        collectives = slowest_median([dispatch[name][1] for _, _, (_, dispatch) in per_rank])
        dispatch_work[name] = max(0.0, calls - collectives - torchtitan_sort)
    work = ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in dispatch_work.items())
    print(f"[measure-compute] forward + backward {forward_backward:.3f} s (the routed experts {routed_experts:.3f} "
          f"s of it, {routed_experts / forward_backward:.0%}), clipping and optimizer over all "
          f"parameters {optimizer:.3f} s; one MoE call's dispatch + combine beyond its collectives and "
          f"torchtitan's own sort ({torchtitan_sort * 1e3:.3g} ms): {work} (medians over steps of the slowest "
          "process)", flush=True)
    return MeasuredCompute(forward_backward, optimizer, world_size, dispatch_work, routed_experts)
