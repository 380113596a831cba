"""torchtitan's model converters held to the libraries installed beside them, before a job builds its model.

torchtitan 0.2.2's grouped-GEMM converters (``quantize.grouped_mm.mx``, ``quantize.grouped_mm.float8``) convert
the experts with torchao's ``MoETrainingConfig`` (``torchao.prototype.moe_training.conversion_utils``), which
torchao removed in 0.17; torchao 0.16, which has it, does not import its MoE kernels under the triton that
torch 2.13 brings (its autotune keys name no kernel argument). Unchecked, such a job fails at model conversion,
after its process group is up and its model allocated.
"""

from importlib.metadata import PackageNotFoundError, version

from torchtitan_ext.config import ConfigError, register_check, ValidationContext

GROUPED_MM_CONVERTERS = ("quantize.grouped_mm.mx", "quantize.grouped_mm.float8")
"""torchtitan 0.2.2's converters that import ``MoETrainingConfig`` from torchao."""


def _moe_training_config_problem() -> str | None:
    """Why the installed torchao cannot give torchtitan's converters ``MoETrainingConfig``; None if it can."""
    try:
        installed = version("torchao")
    except PackageNotFoundError:
        return "torchao is not installed"
    if tuple(int(part) for part in installed.split(".")[:2] if part.isdigit()) >= (0, 17):
        return f"torchao {installed} has none (removed in 0.17)"
    try:
        from torchao.prototype.moe_training.conversion_utils import MoETrainingConfig  # noqa: F401
    except Exception as e:  # an ImportError, or the ValueError of a triton that cannot build torchao's kernels
        return f"torchao {installed} does not import it ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None


def check_model_converters(job_config, context: ValidationContext) -> None:
    grouped = [name for name in job_config.model.converters if name in GROUPED_MM_CONVERTERS]
    if context.device_type is None or not grouped:
        return
    problem = _moe_training_config_problem()
    if problem:
        raise ConfigError(
            f"model.converters = {grouped}: torchtitan 0.2.2 converts the experts with torchao's MoETrainingConfig, "
            f"and {problem}; torchao 0.16 and earlier, which have it, do not import under torch 2.13's triton: "
            "remove it from model.converters (the experts train in bf16)"
        )


register_check(check_model_converters)
