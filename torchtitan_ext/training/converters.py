"""torchtitan's model converters held to the torchao installed beside them, before a job builds its model.

torchtitan 0.2.2's converters import torchao names inside their constructor or ``convert``, so a torchao without
them fails the job after its process group is up and its model allocated. torchao 0.17 removed
``MoETrainingConfig`` (both grouped-GEMM converters) and ``MXLinearConfig`` (``quantize.linear.mx``); torchao 0.16,
which has them, did not import its MoE kernels under triton 3.9.0 (its autotune keys name no kernel argument;
tried on a CPU machine, not with the triton a CUDA build of torch 2.13 brings). A dry run for another machine is
not held to this one's torchao.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

from torchtitan_ext.config import ConfigError, register_check, ValidationContext

TORCHAO_NAMES = {
    "quantize.linear.float8": ("torchao.float8", ("Float8LinearConfig", "convert_to_float8_training",
                                                  "precompute_float8_dynamic_scale_for_fsdp")),
    "quantize.linear.mx": ("torchao.prototype.mx_formats.config", ("MXLinearConfig", "MXFP8Dim1CastKernelChoice")),
    "quantize.grouped_mm.float8": ("torchao.prototype.moe_training.conversion_utils", ("MoETrainingConfig",)),
    "quantize.grouped_mm.mx": ("torchao.prototype.moe_training.conversion_utils", ("MoETrainingConfig",
                                                                                    "MoEScalingType")),
}
"""What each of torchtitan 0.2.2's converters imports from torchao: (module, names)."""


def _torchao_problem(converter: str) -> str | None:
    """Why the installed torchao cannot serve ``converter``; None if it can."""
    module_name, names = TORCHAO_NAMES[converter]
    try:
        installed = f"torchao {version('torchao')}"
    except PackageNotFoundError:
        return "torchao is not installed"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or the ValueError of a triton that cannot build torchao's kernels
        first_line = (str(e).splitlines() or [""])[0][:160]
        return f"{installed} does not import {module_name} ({type(e).__name__}: {first_line})"
    missing = [name for name in names if not hasattr(module, name)]
    return f"{installed} has no {', '.join(missing)} in {module_name}" if missing else None


def check_model_converters(job_config, context: ValidationContext) -> None:
    if context.device_type is None:
        return
    for converter in job_config.model.converters:
        problem = _torchao_problem(converter) if converter in TORCHAO_NAMES else None
        if problem:
            raise ConfigError(
                f"model.converters = {job_config.model.converters}: torchtitan's {converter} converter needs torchao "
                f"names that {problem}: remove {converter} from model.converters (what it converts then runs "
                f"unquantized, in training.mixed_precision_param = '{job_config.training.mixed_precision_param}')"
            )


register_check(check_model_converters)
