"""Device and process-group choice, and every CPU accommodation for torchtitan 0.2.2.

With CUDA available the trainer is plain torchtitan (NCCL) and nothing here
changes anything. Without CUDA, :func:`configure` switches torchtitan to the CPU
and gloo. Every change is made in memory on the imported modules; no file of an
installed package is touched. Each accommodation below carries a one-line reason.
"""

import os
import warnings
from datetime import timedelta

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.parallel_dims as tt_parallel_dims
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.models.moe.utils as tt_moe_utils
import torchtitan.tools.utils as tt_utils
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import distribute_tensor, DTensor
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.tools.logging import logger

from torchtitan_ext.runtime.memory import CPUMemoryMonitor

_configured_device: str | None = None


def device_type() -> str:
    """``"cuda"`` when a CUDA device is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def max_local_world_size() -> int:
    """Most processes one machine can run: one per GPU, or 4 per CPU core.

    Beyond 4 gloo ranks per core the ranks starve each other and collectives hit
    their timeouts instead of making progress.
    """
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 4 * (os.cpu_count() or 1)


def configure() -> str:
    """Prepare torchtitan for this machine's device; returns the device type.

    Idempotent. Call it before building a ``Trainer``.
    """
    global _configured_device
    if _configured_device is None:
        _configured_device = device_type()
        if _configured_device == "cpu":
            _enable_cpu()
    return _configured_device


def _build_cpu_memory_monitor() -> CPUMemoryMonitor:
    monitor = CPUMemoryMonitor()
    logger.info(
        f"CPU capacity: {monitor.device_name} with {monitor.device_capacity_gib:.2f}GiB memory"
    )
    return monitor


_torch_histc = torch.histc


def _histc_accepting_integers(input, bins=100, min=0, max=0, *, out=None):
    if out is None and input.device.type == "cpu" and not input.is_floating_point():
        return _torch_histc(input.double(), bins=bins, min=min, max=max).to(input.dtype)
    if out is None:
        return _torch_histc(input, bins=bins, min=min, max=max)
    return _torch_histc(input, bins=bins, min=min, max=max, out=out)


def _generate_permute_indices_on_host(*args, **kwargs):
    return generate_permute_indices(*args, **kwargs, use_cpu=True)


def _undefined_peak_flops(device_name: str) -> float:
    return float("nan")


def _set_pg_timeouts_without_device_ids(timeout: timedelta, parallel_dims) -> None:
    logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
    dist.barrier()
    groups = [
        mesh.get_group()
        for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
    ] + [None]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _enable_cpu() -> None:
    # torchtitan picks "cuda" when no accelerator is found; the mesh, trainer and metrics must see "cpu".
    for module in (tt_utils, tt_dist_utils, tt_parallel_dims, tt_metrics):
        module.device_type = "cpu"
    for module in (tt_utils, tt_dist_utils, tt_metrics):
        module.device_module = torch.cpu
    # torch.cpu has no memory statistics; the monitor reports host RSS instead.
    tt_metrics.build_device_memory_monitor = _build_cpu_memory_monitor
    # The router counts tokens with torch.histc on int64 ids, which only CUDA implements.
    torch.histc = _histc_accepting_integers
    # torchtitan's token permutation launches a Triton kernel unless told to use its host path.
    tt_moe_utils.generate_permute_indices = _generate_permute_indices_on_host
    # Peak FLOPS exist only for GPUs; MFU is reported as nan rather than against an A100's peak.
    tt_utils.get_peak_flops = _undefined_peak_flops
    # gloo's barrier rejects device_ids, which torchtitan passes when it tightens timeouts.
    tt_dist_utils.set_pg_timeouts = _set_pg_timeouts_without_device_ids
    # Inductor's compiled-graph caches are shared by every process on the machine, and a graph one rank cached can
    # name process groups another rank is not in ("Could not resolve the process group registered under the name
    # 17" with PP + TP + EP + compile, Llama4): each process compiles its own graphs.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # torchtitan sets NCCL's error-handling mode to 3 and warns whenever the variable exists (torchrun sets it):
    # under gloo it means nothing, so torchrun's value goes and torchtitan sets its own without the warning
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    # DTensor's random fills follow a GPU generator's offsets only: on a CPU every rank would fill its shard from
    # the same seed, and each evenly sharded parameter would start as copies of one shard (rows t and t + V/2 of
    # the embedding alike, rank 1's experts rank 0's). Every rank draws the whole tensor and keeps its shard.
    for fill in (torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default):
        DTensor._op_dispatcher._custom_op_handlers[fill] = _fill_whole_keep_shard
    # torchtitan seeds DTensor's generator, which a CPU mesh has none of, and DTensor warns at every run that its
    # random operators "may not have complete support on cpu device mesh": the fills are the ones above
    warnings.filterwarnings("ignore", message=r"DTensor .* may not have complete support on cpu device mesh")
    # torchdata's data loader calls torch.set_vital, deprecated: nothing the user can act on
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")
    logger.info("No CUDA device: training on CPU with the gloo backend")


def _fill_whole_keep_shard(fill, args, kwargs):
    """``fill`` (an in-place random fill) of a DTensor as one process draws it: the whole tensor from this rank's
    generator (every rank's is in step: torchtitan seeds them alike), of which the rank keeps its shard. The
    generator advances as one process's does, except in a fill that redraws until its values are in bounds
    (``nn.init.trunc_normal_`` beyond a few standard deviations): each rank stops when its own shard is, and
    the fills after it may then draw other whole tensors on each rank (distinct shards still, no longer one
    process's)."""
    target = args[0]
    local = target.to_local()
    if local.is_meta:
        return target
    whole = torch.empty(target.shape, dtype=local.dtype, device=local.device)
    fill(whole, *args[1:], **kwargs)
    local.copy_(distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local())
    return target


def adapt_model_parts(model_parts: list[torch.nn.Module]) -> None:
    """Per-model accommodations, applied once the parallelisms are in place."""
    if _configured_device != "cpu":
        return
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                # gloo implements only SUM (no AVG/PREMUL_SUM) for FSDP's reduce-scatter.
                module.set_force_sum_reduction_for_comms(True)
