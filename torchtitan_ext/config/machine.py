"""Config defaults this machine decides: a CPU job's training precision.

On a CPU without native bf16 matrix units, bf16 only makes every GEMM
slower: such a CPU trains in float32 unless the job says otherwise. GPU jobs
never call this.
"""

import os
import re

import torch

from torchtitan_ext.config.errors import ConfigError

CPU_BF16_ENV = "TORCHTITAN_EXT_CPU_BF16"
"""Overrides the CPU probe of :func:`cpu_bf16_support`: "native" or "emulated".

"emulated" makes any CPU behave like one without bf16 matrix units, which is
how the test suite and ``python -m torchtitan_ext.bench cpu_precision`` exercise that path.
"""

PRECISION_KEY = "training.mixed_precision_param"

PRECISION_LOG = re.compile(rf"CPU precision: {re.escape(PRECISION_KEY)} = (\w+).*")
"""The line of :func:`choose_cpu_precision` in a job's log, as the tools that read a run's precision find it: the
whole line, and in group 1 the parameter dtype the job trains in."""


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


def choose_cpu_precision(job_config, explicit: set[str]) -> str:
    """Pick the parameter dtype of a CPU job; returns the one-line reason to log.

    On a CPU without native bf16 matrix multiply, ``training.mixed_precision_param``
    becomes float32 unless the TOML or the command line sets it (``explicit``):
    bf16 there only makes every GEMM slower and buys nothing. The reduce dtype
    is float32 in torchtitan 0.2.2 already. GPU jobs never call this.
    """
    native, evidence = cpu_bf16_support()
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


