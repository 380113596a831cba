"""Device and process-group choice, and every CPU accommodation for torchtitan 0.2.2.

With CUDA available the trainer is plain torchtitan (NCCL) and nothing here
changes anything. Without CUDA, :func:`configure` switches torchtitan to the CPU
and gloo. Every change is made in memory on the imported modules; no file of an
installed package is touched. Each accommodation below carries a one-line reason.
"""

import ctypes
import ctypes.util
import dataclasses
import os
import platform
import resource
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
from torchtitan.models.moe.kernels import generate_permute_indices
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError

_GIB = 1024**3
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_configured_device: str | None = None


def device_type() -> str:
    """``"cuda"`` when a CUDA device is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


CPU_BF16_ENV = "TORCHTITAN_EXT_CPU_BF16"
"""Overrides the CPU probe of :func:`cpu_bf16_support`: "native" or "emulated".

"emulated" makes any CPU behave like one without bf16 matrix units, which is
how the test suite and ``scripts/bench_cpu_precision.py`` exercise that path.
"""

PRECISION_KEY = "training.mixed_precision_param"


def cpu_bf16_support() -> tuple[bool, str]:
    """(whether this CPU multiplies bf16 matrices natively, the evidence).

    Without AVX512_BF16 or AMX, oneDNN emulates bf16 GEMMs on AVX-512 (about 4x
    slower than fp32, measured) and AVX2-only CPUs fall back to a scalar kernel
    (about 18x slower). Deterministic: CPU feature flags, not a timing.
    """
    forced = os.environ.get(CPU_BF16_ENV, "")
    if forced:
        if forced not in ("native", "emulated"):
            raise ConfigError(
                f"{CPU_BF16_ENV}={forced!r}: use 'native' or 'emulated', or unset it to probe the CPU"
            )
        return forced == "native", f"{CPU_BF16_ENV}={forced}"
    if torch.cpu._is_amx_tile_supported():
        return True, "the CPU has AMX tiles"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "the CPU has AVX512_BF16"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"the CPU has no AVX512_BF16 or AMX (vector unit: {capability})"


_loop_experts = False
"""Set by :func:`choose_cpu_precision`: the CPU emulates bf16, so experts run torchtitan's per-expert loop."""


def fit_experts(moe_args):
    """(MoE args, line to log or None): ``moe_args`` as the trainer builds the model on this machine.

    torchtitan's grouped-GEMM expert path casts tokens and weights to bf16
    whatever the training dtype, so on a CPU that emulates bf16 the experts run
    its per-expert loop instead, in the training dtype (3.5x faster here on
    the debug model's expert shapes, measured). Returns a changed copy, never
    mutating the flavour's shared arguments.
    """
    if not (_loop_experts and moe_args.use_grouped_mm):
        return moe_args, None
    return dataclasses.replace(moe_args, use_grouped_mm=False), (
        "CPU experts: per-expert GEMMs in the training dtype instead of torchtitan's bf16 grouped GEMM "
        "(bf16 is emulated on this CPU)"
    )


def choose_cpu_precision(job_config, explicit: set[str]) -> str:
    """Pick the parameter dtype of a CPU job; returns the one-line reason to log.

    On a CPU without native bf16 matrix multiply, ``training.mixed_precision_param``
    becomes float32 unless the TOML or the command line sets it (``explicit``):
    bf16 there only makes every GEMM slower and buys nothing. The reduce dtype
    is float32 in torchtitan 0.2.2 already. Such a CPU also runs the experts
    without the bf16 grouped GEMM (:func:`fit_experts`). GPU jobs never call this.
    """
    global _loop_experts
    native, evidence = cpu_bf16_support()
    _loop_experts = not native
    current = job_config.training.mixed_precision_param
    if native or current == "float32":
        return f"CPU precision: {PRECISION_KEY} = {current} ({evidence})"
    if PRECISION_KEY in explicit:
        return (
            f"CPU precision: {PRECISION_KEY} = {current} as configured, but {evidence}: "
            "its bf16 GEMMs are emulated, several times slower than float32"
        )
    job_config.training.mixed_precision_param = "float32"
    return (
        f"CPU precision: {PRECISION_KEY} = float32 instead of the default {current}, because "
        f"{evidence} and emulated bf16 GEMMs are several times slower; set {PRECISION_KEY} to override"
    )


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


class CPUMemoryMonitor:
    """Host-memory stand-in for torchtitan's CUDA ``DeviceMemoryMonitor``.

    Reports this process's resident set size: "active" is the current RSS and
    "reserved" the peak RSS (VmHWM) since the last reset, both against the
    machine's physical memory.
    """

    def __init__(self):
        self.device_name = f"cpu ({platform.processor() or platform.machine()})"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / _GIB

    def get_peak_stats(self) -> tt_metrics.DeviceMemStats:
        current, peak = _rss_bytes()
        return tt_metrics.DeviceMemStats(
            max_active_gib=current / _GIB,
            max_active_pct=100 * current / self.device_capacity,
            max_reserved_gib=peak / _GIB,
            max_reserved_pct=100 * peak / self.device_capacity,
            num_alloc_retries=0,
            num_ooms=0,
        )

    def reset_peak_stats(self) -> None:
        # Writing 5 to clear_refs resets VmHWM on Linux; elsewhere the peak is run-long.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    try:
        with open("/proc/self/status") as f:
            kib = {
                key: int(value.split()[0])
                for key, _, value in (line.partition(":") for line in f)
                if key in ("VmRSS", "VmHWM")
            }
        return kib["VmRSS"] * 1024, max(kib["VmHWM"], kib["VmRSS"]) * 1024
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


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


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory_in_heap() -> None:
    """Keep freed blocks in glibc's heap instead of returning them to the kernel.

    New large tensors then reuse pages that are already mapped instead of
    page-faulting fresh ones on first touch (a 67 MB ``index_select``: 15 ms
    instead of 50 ms), at the cost of a resident set that never shrinks and
    grows with heap fragmentation. Training does not call this: with it,
    torchtitan's own DeepSeek-V3 debug TOML (8 x 2048 tokens per rank) ran out
    of 24 GiB with 2 processes, where each peaks at 11.7 GiB without it. The
    benchmarks call it, so that page faults do not drown what they compare.
    """
    libc = _libc()
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the kernel (CPU runs only; a no-op on CUDA).

    For a program that kept freed memory (:func:`keep_freed_memory_in_heap`)
    and changes working set, like a benchmark sweeping shapes.
    """
    if _configured_device == "cpu":
        _libc().malloc_trim(0)


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
    logger.info("No CUDA device: training on CPU with the gloo backend")


def adapt_model_parts(model_parts: list[torch.nn.Module]) -> None:
    """Per-model accommodations, applied once the parallelisms are in place."""
    if _configured_device != "cpu":
        return
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                # gloo implements only SUM (no AVG/PREMUL_SUM) for FSDP's reduce-scatter.
                module.set_force_sum_reduction_for_comms(True)
