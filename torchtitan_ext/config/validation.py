"""Validation of a job config: the shared checks, then every feature's registered ones.

:func:`validate` rejects bad values and combinations with one line naming the
field and the fix (:class:`~torchtitan_ext.config.errors.ConfigError`), before
any process group, buffer or model exists.
"""

from torchtitan.components.optimizer import build_optimizers, build_optimizers_with_moe_load_balancing
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_ext.config.errors import ConfigError
from torchtitan_ext.config.job import fsdp_shards, model_args_of, moe_shape, MoEShape, routed_moe_args
from torchtitan_ext.config.ranges import check_ranges
from torchtitan_ext.config.registry import field_ranges, registered_checks, ValidationContext
from torchtitan_ext.config.sections import overlaps_expert_parallel


def validate(job_config, *, device_type: str | None, world_size: int | None = None,
             command_line: frozenset[str] = frozenset()) -> None:
    """Reject invalid values and combinations before anything is allocated.

    ``device_type`` is where the job runs ("cuda"/"cpu"; None when validating
    for another machine, which skips the checks of what this machine can run);
    ``world_size`` the number of processes in the job, when known; ``command_line`` the keys the command line set.
    """
    check_ranges(job_config, field_ranges())
    shape = moe_shape(job_config)
    _check_attention(job_config, device_type)
    _check_cpu_only_limits(job_config, device_type)
    _check_tensor_parallel(job_config, device_type)
    _check_expert_parallel(job_config, shape)
    _check_activation_checkpointing(job_config)
    _check_pipeline(job_config, device_type)
    _check_pipeline_split(job_config)
    _check_optimizer(job_config)
    _check_switches(job_config)
    if world_size is not None:
        _check_world_size(job_config, world_size)
    _check_tied_weights(job_config, world_size)
    context = ValidationContext(device_type, world_size, shape, command_line)
    for check in registered_checks():
        check(job_config, context)
    # after the backends' checks: a kernel library that takes bf16 tokens only names its own fix first
    _check_mixed_precision(job_config, world_size)


def _check_mixed_precision(job_config, world_size: int | None) -> None:
    """A TP or PP job without FSDP runs in float32 (:func:`~torchtitan_ext.config.job.fsdp_shards`):
    another ``training.mixed_precision_param``, the default bfloat16 included, would not be what it trains in."""
    p, precision = job_config.parallelism, job_config.training.mixed_precision_param
    if precision == "float32" or (p.tensor_parallel_degree == 1 and p.pipeline_parallel_degree == 1):
        return
    if fsdp_shards(job_config, world_size) is False:
        raise ConfigError(
            f"training.mixed_precision_param = '{precision}', but torchtitan mixes precision through FSDP where TP or "
            "PP is on, and this job has no FSDP (data-parallel shard x context parallel = 1): it would train in "
            "float32; set training.mixed_precision_param = 'float32' to say so, or shard data parallelism "
            "(data_parallel_shard_degree > 1)"
        )


TORCHTITAN_OPTIMIZERS = ("Adam", "AdamW")
"""What torchtitan 0.2.2's optimizer builders make; both keep two moments (``exp_avg``, ``exp_avg_sq``) of every
parameter, in its dtype."""


def builds_torchtitans_optimizers(job_config) -> bool:
    """Whether the model's train spec builds its optimizers with torchtitan's builders (a spec of another model may
    build any)."""
    return get_train_spec(job_config.model.name).build_optimizers_fn in (
        build_optimizers, build_optimizers_with_moe_load_balancing)


def _check_optimizer(job_config) -> None:
    name = job_config.optimizer.name
    if builds_torchtitans_optimizers(job_config) and name not in TORCHTITAN_OPTIMIZERS:
        raise ConfigError(f"optimizer.name = '{name}' is not an optimizer torchtitan builds: use "
                          f"{' or '.join(TORCHTITAN_OPTIMIZERS)}")


REFUSED_SWITCHES = {
    "fault_tolerance.enable": (
        "torchtitan 0.2.2's trainer, which this harness extends, has no TorchFT (torchtitan.experiments.ft's has): the "
        "job would train without fault tolerance; unset it (docs/reliability.md lists the faults a job survives here)"
    ),
    "memory_estimation.enable": (
        "no trainer of torchtitan 0.2.2 reads it: the job would train without an estimate; unset it (python -m "
        "torchtitan_ext.plan --job.config_file X prices a rank's memory)"
    ),
}
"""The torchtitan switches a job here cannot use, each with why: its trainer leaves them unread (the job would run
without the feature), or this harness does not run them."""


def _check_switches(job_config) -> None:
    for key, why in REFUSED_SWITCHES.items():
        section, field = key.split(".")
        if getattr(getattr(job_config, section), field):
            raise ConfigError(f"{key} is set, but {why}")


def _check_expert_parallel(job_config, shape: MoEShape | None) -> None:
    ep = job_config.parallelism.expert_parallel_degree
    if shape is None and ep > 1:
        # torchtitan would build the EP mesh and parallelize nothing on it: the job would say "EP=2" and have none
        name, flavor = job_config.model.name, job_config.model.flavor
        moe_flavors = [other for other, args in get_train_spec(name).model_args.items() if routed_moe_args(args)]
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep}, but model.name = '{name}', flavor '{flavor}' has no routed "
            "experts: set it to 1" + (f", or use an MoE flavour ({', '.join(moe_flavors)})" if moe_flavors else ""))
    if shape is not None and shape.num_experts % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} does not divide the model's "
            f"{shape.num_experts} experts: pick a divisor of {shape.num_experts}"
        )


def _check_tied_weights(job_config, world_size: int | None) -> None:
    """torchtitan's FSDP plan shards the embedding and the output projection in two groups, and torch's FSDP refuses a
    parameter that two groups share: a flavour that ties them (Qwen3's small dense ones) stops in every rank's first
    forward ("Parameter ... is shared with a parameter already managed by another FSDP group")."""
    name, flavor = job_config.model.name, job_config.model.flavor
    if not getattr(model_args_of(job_config), "enable_weight_tying", False) or not fsdp_shards(job_config, world_size):
        return
    untied = [other for other, args in get_train_spec(name).model_args.items()
              if not getattr(args, "enable_weight_tying", False)]
    raise ConfigError(
        f"model.flavor = '{flavor}' ties the output projection to the embedding (enable_weight_tying), and torchtitan "
        "shards the two in separate FSDP groups, which torch's FSDP refuses: train it without FSDP "
        "(data_parallel_shard_degree x context_parallel_degree = 1: one rank, or data_parallel_replicate_degree for "
        "the ranks), or use a flavour of " + name + " that does not tie them ("
        + ", ".join(untied) + ")")


def _check_attention(job_config, device_type: str | None) -> None:
    model_args = model_args_of(job_config)
    attention = getattr(model_args, "attn_type", "sdpa")
    cp = job_config.parallelism.context_parallel_degree
    if cp > 1 and attention != "sdpa":
        raise ConfigError(
            f"parallelism.context_parallel_degree = {cp}: model.flavor = '{job_config.model.flavor}' uses {attention} "
            "attention, and torchtitan's context parallelism takes SDPA only: set it to 1, or use an SDPA flavour"
        )
    if cp > 1 and device_type == "cpu":
        # torch's ring attention replaces SDPA's CUDA kernels (flash, efficient, cuDNN) only: the CPU's SDPA runs
        # unsharded on the sequence shards and fails on mixed tensors and DTensors in every rank's first step
        raise ConfigError(
            f"parallelism.context_parallel_degree = {cp} on a CPU: torch's context parallelism shards SDPA's CUDA "
            "kernels only; set it to 1 here (a dry run, COMM_MODE=fake_backend, checks a CP layout), or run on GPUs"
        )
    if attention == "flex" and device_type == "cpu" and not getattr(model_args, "dense_attention_on_cpu", False):
        raise ConfigError(
            f"model.flavor = '{job_config.model.flavor}' uses FlexAttention, whose backward PyTorch does not "
            "implement on CPU: use an SDPA flavour (e.g. debugmodel) on CPU"
        )


def _check_tensor_parallel(job_config, device_type: str | None) -> None:
    problem = getattr(model_args_of(job_config), "cpu_tensor_parallel_problem", None)
    degree = job_config.parallelism.tensor_parallel_degree
    if problem and degree > 1 and device_type == "cpu":
        raise ConfigError(f"parallelism.tensor_parallel_degree = {degree} on a CPU: {problem}; set it to 1 here "
                          "(shard with FSDP and EP), or run on GPUs")


def _check_cpu_only_limits(job_config, device_type: str | None) -> None:
    if job_config.profiling.enable_profiling and device_type == "cpu":
        raise ConfigError(
            "profiling.enable_profiling on CPU: torchtitan 0.2.2's profiler asks torch.profiler for a GPU activity "
            "that a CPU-only machine does not have (it passes None, and every rank fails at the first step); "
            "unset it on CPU (py-spy record --subprocesses profiles a CPU job)"
        )
    checkpoint = job_config.checkpoint
    if checkpoint.enable and checkpoint.async_mode == "async_with_pinned_mem" and device_type == "cpu":
        # its staging copies the state into pinned memory with non-blocking copies, which assert an accelerator:
        # every rank failed at its first save
        raise ConfigError(
            "checkpoint.async_mode = 'async_with_pinned_mem' on a CPU: it stages through pinned memory, which needs "
            "a GPU; use 'async' (or 'disabled') on CPU"
        )
    if job_config.training.enable_cpu_offload and device_type == "cpu":
        # torchtitan asks for a gloo backend beside the device's, which on a CPU is gloo again: every rank's
        # process group fails to start
        raise ConfigError(
            "training.enable_cpu_offload on a CPU: it moves parameters from GPU memory to the host, where a CPU "
            "job's already are; unset it on CPU"
        )


def _check_activation_checkpointing(job_config) -> None:
    ac = job_config.activation_checkpoint
    if ac.mode == "memory_budget" and not (job_config.compile.enable and "model" in job_config.compile.components):
        raise ConfigError(
            "activation_checkpoint.mode = 'memory_budget' works through torch.compile: set compile.enable = true "
            "(with 'model' in compile.components), or use mode 'selective' or 'full'"
        )
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        option = ac.selective_ac_option
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = '{option}': use 'op' (per operator) "
                "or a positive integer N (every N-th layer)"
            )


def _check_pipeline_split(job_config) -> None:
    degree = job_config.parallelism.pipeline_parallel_degree
    name = job_config.model.name
    if degree > 1 and get_train_spec(name).pipelining_fn is None:
        raise ConfigError(f"parallelism.pipeline_parallel_degree = {degree}: torchtitan 0.2.2 gives {name} no "
                          "pipeline split: set it to 1 (shard the model with FSDP, TP or EP instead)")


def _check_pipeline(job_config, device_type: str | None) -> None:
    p = job_config.parallelism
    if p.expert_parallel_degree == 1 or not overlaps_expert_parallel(p):
        return
    if job_config.activation_checkpoint.mode != "none":
        raise ConfigError(
            "pipeline_parallel_schedule = 'DualPipeV' overlapping expert parallelism cannot run with "
            f"activation_checkpoint.mode = '{job_config.activation_checkpoint.mode}' (torchtitan 0.2.2): set "
            "activation_checkpoint.mode = 'none' or parallelism.pipeline_parallel_expert_parallel_overlap = false"
        )
    if device_type == "cpu":
        raise ConfigError(
            "pipeline_parallel_schedule = 'DualPipeV' overlaps expert parallelism on CUDA streams, which a CPU "
            "does not have: set parallelism.pipeline_parallel_expert_parallel_overlap = false on CPU"
        )


def _check_microbatches(p, local_batch: int, microbatches: int) -> None:
    """What torch's 1F1B and interleaved schedules refuse when they are built (torch 2.13 ``schedules.py``)."""
    pp, schedule = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if pp == 1:
        return
    size = p.pipeline_parallel_microbatch_size
    if schedule.lower() == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"pipeline_parallel_schedule = '1F1B' needs at least as many microbatches as its {pp} stages, but "
            f"training.local_batch_size = {local_batch} / pipeline_parallel_microbatch_size = {size} gives "
            f"{microbatches}: raise local_batch_size to {pp * size} or more"
        )
    rounds = max(1, microbatches // pp)
    if schedule.lower() in ("interleaved1f1b", "interleavedzerobubble") and microbatches % rounds:
        raise ConfigError(
            f"pipeline_parallel_schedule = {schedule!r} runs microbatches in rounds of {pp}, and training.local_batch_size "
            f"= {local_batch} / pipeline_parallel_microbatch_size = {size} gives {microbatches}, not a multiple of its "
            f"{rounds} rounds: use a local_batch_size giving a multiple of {pp} microbatches"
        )


def _check_world_size(job_config, world_size: int) -> None:
    p = job_config.parallelism
    fixed = p.data_parallel_replicate_degree * p.context_parallel_degree
    fixed *= p.tensor_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not a multiple of dp_replicate x cp x tp x pp = {fixed}: "
                f"change NGPU (or the node count) or those degrees"
            )
        shard = world_size // fixed
    elif shard * fixed != world_size:
        raise ConfigError(
            f"dp_replicate x dp_shard x cp x tp x pp = {shard * fixed} but the world size is "
            f"{world_size}: set parallelism.data_parallel_shard_degree = -1 or NGPU = {shard * fixed}"
        )
    replicate = p.data_parallel_replicate_degree
    if replicate > 1 and shard == 1 and p.context_parallel_degree == 1 and (
            p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1):
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree = {replicate} without a data-parallel shard is DDP, which "
            "torchtitan runs only as the job's one parallelism, not beside TP or PP: shard data parallelism instead "
            f"(parallelism.data_parallel_shard_degree = {replicate}, data_parallel_replicate_degree = 1), or add a "
            "shard beside the replicas (HSDP: data_parallel_shard_degree > 1)"
        )
    ep, etp, tp = p.expert_parallel_degree, p.expert_tensor_parallel_degree, p.tensor_parallel_degree
    divisor = tp * 2 * p.context_parallel_degree
    seq_len = job_config.training.seq_len
    if seq_len % divisor:
        raise ConfigError(
            f"training.seq_len = {seq_len} is not divisible by TP x 2 x CP = {divisor}: use a multiple of {divisor}"
        )
    batch_ranks = p.data_parallel_replicate_degree * shard
    global_batch = job_config.training.global_batch_size
    local_batch = job_config.training.local_batch_size
    if global_batch != -1 and global_batch % (local_batch * batch_ranks):
        raise ConfigError(
            f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size x data-parallel "
            f"ranks = {local_batch} x {batch_ranks}: use a multiple of {local_batch * batch_ranks} (or -1)"
        )
    if p.pipeline_parallel_degree > 1 and local_batch % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"training.local_batch_size = {local_batch} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}: "
            "use a multiple of it"
        )
    microbatches = local_batch // p.pipeline_parallel_microbatch_size
    stages = 2 * p.pipeline_parallel_degree  # DualPipeV runs two stages per rank (the V)
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule.lower() == "dualpipev" and microbatches < stages:
        raise ConfigError(
            f"pipeline_parallel_schedule = 'DualPipeV' runs {stages} stages and needs as many microbatches, but "
            f"training.local_batch_size = {local_batch} / pipeline_parallel_microbatch_size = "
            f"{p.pipeline_parallel_microbatch_size} gives {microbatches}: raise local_batch_size to "
            f"{stages * p.pipeline_parallel_microbatch_size} or more"
        )
    _check_microbatches(p, local_batch, microbatches)
    if ep == 1:
        return
    if etp not in (1, tp):
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree = {etp}: use 1 or tensor_parallel_degree ({tp})")
    borrowed = shard * p.context_parallel_degree * tp
    if borrowed % (ep * etp):
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} (x expert TP {etp}) must divide "
            f"dp_shard x cp x tp = {borrowed}: choose an EP degree that divides {borrowed}, or a world size "
            f"(NGPU x nodes) that makes dp_shard x cp x tp a multiple of {ep * etp}"
        )
    expert_shards = borrowed // (ep * etp)
    if shard * p.context_parallel_degree == 1 and expert_shards > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_degree = {ep} leaves {expert_shards} ranks holding the same "
            f"experts, but there is no data-parallel shard dimension to shard them over "
            f"(dp_shard x cp = 1): set expert_parallel_degree = {borrowed // etp} or add data parallelism"
        )
