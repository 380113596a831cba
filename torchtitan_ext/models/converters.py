"""Low-precision model converters on the pinned torchao: MXFP8 and float8 routed experts, MXFP8 linears.

torchtitan 0.2.2's converters of these names import torchao names (``MoETrainingConfig``, ``MXLinearConfig``) that
torchao 0.17 removed. torchao 0.18, the one pinned here, serves the same recipes through
``torchao.prototype.moe_training.config`` (``MXFP8TrainingOpConfig``, ``Float8TrainingOpConfig``). The converters
below keep torchtitan's names and config sections (``[quantize.grouped_mm.mx]``, ...) and take their places in
torchtitan's converter registry; ``quantize.linear.float8`` stays torchtitan's own, which torchao 0.18 serves.

Float8 linears under TP take the plain TP styles (all-gathers in the compute dtype), as in torchtitan 0.2.2's jobs:
its model plans look for a converter named "float8", which its registry never holds, so they never pick torchao's
float8 styles. The plans here pass that choice explicitly: the float8 styles all-gather float8 tensors, which gloo
cannot (a CPU job fails at its first step), and no GPU has run them here.

Routed experts (``quantize.grouped_mm.mx`` / ``.float8``): the converter hands each experts module that ``fqns``
names a :class:`LowPrecisionGroupedMM`; the experts' forward (:class:`torchtitan_ext.ep.experts.UnboundLoopExperts`
and GPT-OSS's :class:`~torchtitan_ext.ep.experts.GptOssExperts`, and their replica classes) then runs torchao's
quantize-then-scaled grouped GEMM on the weights the parallelize plan leaves it: this rank's EP shard, FSDP's
unsharded parameter, replicas appended. The parameters stay plain tensors, so EP's partition, FSDP, checkpoints,
expert migration and replication hold the same weights with or without a converter. The groups must be multiples
of the kernel's block (32 rows for MXFP8, 16 for float8): under EP the backend's dispatch pads them to
:func:`torchtitan_ext.ep.base.token_group_alignment`, which reads the same converters; without EP torchao pads them
(MXFP8) or torchtitan's padding wrapper does (float8 on a GPU).

Where they run: MXFP8 on sm100 GPUs (B200, GB200, GB300), and on a CPU with torchao's emulated kernels (quantize,
dequantize to bf16, bf16 grouped GEMM); float8 on sm90 and sm100 (torchao's Triton casts and CUDA's scaled grouped
GEMM), and on a CPU with this module's emulation of that recipe from torchao's own scaling functions (torchao 0.18
has none). A GPU outside a recipe's range is refused in one line at config time, before any allocation.
"""

import importlib
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.nn.functional as F
from torchtitan.components.quantization import (
    FP8_GROUP_ALIGNMENT_SIZE,
    MXFP8_GROUP_ALIGNMENT_SIZE,
    QuantizationConverter,
)
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.models.gpt_oss.model import moe as gpt_oss_moe
from torchtitan.models.moe.utils import indices_padding_wrapper, set_token_group_alignment_size_m
from torchtitan.protocols.model_converter import _registry_model_converter_cls
from torchtitan.tools.logging import logger

from torchtitan_ext.config import ConfigError, register_check, shared_meta_model, ValidationContext
from torchtitan_ext.ep.experts import ROUTED_EXPERTS, run_gpt_oss_experts_grouped_mm


@dataclass(frozen=True)
class Recipe:
    """What one converter name needs of the machine and of the shapes it converts."""

    name: str
    """The converter's name in ``model.converters``."""
    kind: str
    """"mx" (MXFP8: blocks of 32 values, power-of-two scales) or "float8" (rowwise float8 scales)."""
    alignment: int
    """Row multiple of every expert group (grouped converters), or of every converted dimension."""
    min_capability: tuple[int, int]
    """Lowest CUDA compute capability its kernels run on."""
    max_capability_major: int | None
    """Highest CUDA major version its kernels run on; None: no upper bound."""
    gpus: str
    """The GPUs that capability range means, for the refusal."""


RECIPES = {
    recipe.name: recipe for recipe in (
        Recipe("quantize.grouped_mm.mx", "mx", MXFP8_GROUP_ALIGNMENT_SIZE, (10, 0), 10, "sm100: B200, GB200, GB300"),
        # torch's scaled grouped GEMM runs on sm90 and sm100 only
        Recipe("quantize.grouped_mm.float8", "float8", FP8_GROUP_ALIGNMENT_SIZE, (9, 0), 10,
               "sm90 or sm100: H100, H200, B200, GB200, GB300"),
        Recipe("quantize.linear.mx", "mx", MXFP8_GROUP_ALIGNMENT_SIZE, (10, 0), 10, "sm100: B200, GB200, GB300"),
    )
}
"""The converters this module serves, by name."""


def _cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def recipe_problem(recipe: Recipe, device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why ``recipe`` cannot run on this machine (``capability``: its GPU's, None where none is visible); None if
    it can (a CPU runs every recipe emulated), or where this host cannot tell (a CUDA job checked from a host without a GPU is checked again on its
    ranks)."""
    if device_type == "cpu":  # every recipe runs emulated there
        return None
    if capability is None:
        return None
    too_new = recipe.max_capability_major is not None and capability[0] > recipe.max_capability_major
    if capability < recipe.min_capability or too_new:
        return f"{recipe.name} needs a GPU of {recipe.gpus}; this one is sm{capability[0]}{capability[1]}"
    if recipe.kind == "mx":
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _SM100_KERNELS_AVAILABLE

        if not _SM100_KERNELS_AVAILABLE:
            return (f"{recipe.name} runs torchao's sm100 kernels, which this torchao build lacks: install the torchao "
                    "0.18 wheel built for CUDA 12.8 or newer")
    return None


def _torchao_problem() -> str | None:
    """Why the installed torchao cannot serve these converters; None if it can."""
    try:
        installed = f"torchao {version('torchao')}"
    except PackageNotFoundError:
        return "torchao is not installed: pip install torchao==0.18.0"
    try:
        module = importlib.import_module("torchao.prototype.moe_training.config")
    except Exception as e:  # an ImportError, or the ValueError of a triton that cannot build torchao's kernels
        first_line = (str(e).splitlines() or [""])[0][:160]
        return f"{installed} does not import torchao.prototype.moe_training.config ({type(e).__name__}: {first_line})"
    missing = [name for name in ("MXFP8TrainingOpConfig", "Float8TrainingOpConfig") if not hasattr(module, name)]
    return f"{installed} has no {', '.join(missing)}: pip install torchao==0.18.0" if missing else None


def _torchao_config(name: str, device_type: str, pad_groups: bool):
    """torchao's op config of converter ``name``: kernels for ``device_type`` (emulated on a CPU), groups padded by
    torchao when ``pad_groups`` (MXFP8 only: torchao's float8 op cannot)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig, MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    if RECIPES[name].kind == "float8":
        return Float8TrainingOpConfig()
    recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if device_type == "cpu" else MXFP8TrainingRecipe.MXFP8_RCEIL
    config = MXFP8TrainingOpConfig.from_recipe(recipe)
    config.pad_token_groups_for_grouped_mm = pad_groups
    return config


def _float8_dequantized(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` cast to float8 e4m3 with one scale per slice along ``dim`` (torchao's rowwise scaling: the largest
    magnitude maps to at most 448, the scale rounded down to a power of two, the cast saturating) and back, in
    bf16 (exact: a float8 value times a power of two)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=True)
    return (to_fp8_saturated(x.float() * scale, torch.float8_e4m3fn).float() / scale).to(torch.bfloat16)


def _per_group(x: torch.Tensor, group_ends: list[int], quantize) -> torch.Tensor:
    """``quantize`` applied to each group of rows of ``x`` alone (rows past the last group kept as zeros)."""
    out, start = torch.zeros_like(x, dtype=torch.bfloat16), 0
    for end in group_ends:
        if end > start:  # an expert without tokens has no scale
            out[start:end] = quantize(x[start:end])
        start = end
    return out


class _Float8GroupedMMEmulated(torch.autograd.Function):
    """torchao 0.18's rowwise float8 grouped GEMM, emulated on a CPU (torchao has no emulation of it): the same
    scaling as its Triton casts, dequantized, then a bf16 grouped GEMM. Forward: A's rows and B's columns scaled
    along the contracting dimension; input gradient: the output gradient's rows and B along the output dimension;
    weight gradient: both operands along the tokens, per expert group."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b_t, offsets)
        return torch._grouped_mm(_float8_dequantized(a, -1), _float8_dequantized(b_t, -2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b_t, offsets = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        grad_a = torch._grouped_mm(_float8_dequantized(grad, -1), _float8_dequantized(b_t, -1).transpose(-2, -1),
                                   offs=offsets)
        ends = offsets.tolist()  # a CPU emulation: reading the group ends costs nothing
        grad_b = torch._grouped_mm(_per_group(grad, ends, lambda rows: _float8_dequantized(rows, 0)).t(),
                                   _per_group(a, ends, lambda rows: _float8_dequantized(rows, 0)), offs=offsets)
        return grad_a.to(a.dtype), grad_b.transpose(-2, -1).to(b_t.dtype), None


class LowPrecisionGroupedMM:
    """The routed experts' grouped GEMMs in a torchao low-precision recipe: torchtitan's standard experts' three
    (SwiGLU as torchtitan's ``_run_experts_grouped_mm``: inputs and weights in bf16, outputs in bf16, the result in
    the input's dtype), GPT-OSS's two (:func:`~torchtitan_ext.ep.experts.run_gpt_oss_experts_grouped_mm`, biases
    added in bf16)."""

    def __init__(self, config, pad_with_torchtitan: bool, emulate_float8: bool = False):
        self.config = config
        """torchao's ``MXFP8TrainingOpConfig`` or ``Float8TrainingOpConfig``."""
        self.pad_with_torchtitan = pad_with_torchtitan
        """The groups arrive unpadded and torchao's op cannot pad them: torchtitan's padding wrapper does."""
        self.emulate_float8 = emulate_float8
        """Float8 on a CPU: :class:`_Float8GroupedMMEmulated` in place of torchao's CUDA kernels."""

    def grouped_mm(self, a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """bf16 ``a`` [M, K] times ``b_t`` [E, K, N] over the row groups ``offsets`` ends, both quantized on the fly."""
        if self.emulate_float8:
            return _Float8GroupedMMEmulated.apply(a, b_t, offsets)
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

        return _quantize_then_scaled_grouped_mm(a, b_t, config=self.config, offs=offsets)

    def run_experts(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        run = indices_padding_wrapper(self._swiglu) if self.pad_with_torchtitan else self._swiglu
        return run(w1, w2, w3, x, num_tokens_per_expert)

    def run_gpt_oss_experts(self, mlp1_weight: torch.Tensor, mlp1_bias: torch.Tensor, mlp2_weight: torch.Tensor,
                            mlp2_bias: torch.Tensor, swiglu_limit: float, x: torch.Tensor,
                            num_tokens_per_expert: torch.Tensor, tp_degree: int = 1) -> torch.Tensor:
        run = partial(run_gpt_oss_experts_grouped_mm, grouped_mm=self.grouped_mm)
        if self.pad_with_torchtitan:
            run = gpt_oss_moe.indices_padding_wrapper(run)
        return run(mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, swiglu_limit, x, num_tokens_per_expert, tp_degree)

    def _swiglu(self, w1, w2, w3, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        gemm = partial(self.grouped_mm, offsets=offsets)
        rows = x.bfloat16()
        hidden = F.silu(gemm(rows, w1.bfloat16().transpose(-2, -1))) * gemm(rows, w3.bfloat16().transpose(-2, -1))
        return gemm(hidden, w2.bfloat16().transpose(-2, -1)).type_as(x)


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class GroupedMMConverter(QuantizationConverter):
    """``quantize.grouped_mm.mx`` and ``quantize.grouped_mm.float8``: the experts that ``fqns`` names run their
    grouped GEMMs in the recipe (:class:`LowPrecisionGroupedMM`)."""

    name: str

    def __init__(self, job_config, parallel_dims):
        super().__init__(job_config, parallel_dims)
        section = getattr(job_config.quantize.grouped_mm, self.name.rsplit(".", 1)[1])
        self.fqns = [section.fqns] if isinstance(section.fqns, str) else list(section.fqns)
        recipe = RECIPES[self.name]
        # under EP (and expert replication, which rides on it) the backend's dispatch pads every group
        pad_groups = not parallel_dims.ep_enabled
        device_type = _device_type()
        self.grouped_mm = LowPrecisionGroupedMM(
            _torchao_config(self.name, device_type, pad_groups and recipe.kind == "mx"),
            # torchtitan's padding wrapper is a Triton kernel; the float8 emulation takes groups of any size
            pad_with_torchtitan=pad_groups and recipe.kind == "float8" and device_type == "cuda",
            emulate_float8=recipe.kind == "float8" and device_type == "cpu",
        )
        if self.grouped_mm.pad_with_torchtitan:
            set_token_group_alignment_size_m(RECIPES[self.name].alignment)
        self.enabled = True

    def convert(self, model: torch.nn.Module) -> None:
        converted = []
        for fqn, module in model.named_modules():
            if not isinstance(module, tuple(ROUTED_EXPERTS)) or not any(target in fqn for target in self.fqns):
                continue
            # torchtitan's experts become this harness's in the parallelize plan, which run the recipe; another
            # subclass brings its own forward, which would not
            if type(module) not in ROUTED_EXPERTS and not isinstance(module, tuple(ROUTED_EXPERTS.values())):
                raise ConfigError(f"{self.name}.fqns matches {fqn}, a {type(module).__name__}, whose forward would "
                                  f"not run the recipe: narrow {self.name}.fqns")
            module.low_precision = self.grouped_mm
            converted.append(fqn)
        if not converted:
            raise ConfigError(f"{self.name}.fqns = {self.fqns} matches no routed experts of the model: set it to "
                              "['experts']")
        kernels = "emulated kernels (CPU)" if _device_type() == "cpu" else "GPU kernels"
        logger.info(f"{self.name}: {len(converted)} routed experts modules run their grouped GEMMs in "
                    f"{type(self.grouped_mm.config).__name__} ({kernels}), outputs in bf16")

    def post_optimizer_hook(self, model) -> None:
        return


class MXGroupedMMConverter(GroupedMMConverter):
    name = "quantize.grouped_mm.mx"


class Float8GroupedMMConverter(GroupedMMConverter):
    name = "quantize.grouped_mm.float8"


class MXLinearConverter(QuantizationConverter):
    """``quantize.linear.mx``: every ``nn.Linear`` whose dimensions are multiples of 32 and whose name matches no
    ``filter_fqns`` computes in MXFP8, through torchao's MXFP8 training weights (``quantize_``)."""

    def __init__(self, job_config, parallel_dims):
        super().__init__(job_config, parallel_dims)
        section = job_config.quantize.linear.mx
        if (section.recipe_name, section.mxfp8_dim1_cast_kernel_choice) != ("mxfp8_cublas", "triton"):
            raise ConfigError(
                "quantize.linear.mx: torchao 0.18 serves one MXFP8 linear recipe (power-of-two scales rounded up, "
                "its own cast kernels): leave quantize.linear.mx.recipe_name and mxfp8_dim1_cast_kernel_choice at "
                "their defaults"
            )
        self.filter_fqns = section.filter_fqns
        self.config = _torchao_config("quantize.linear.mx", _device_type(), pad_groups=False)
        self.enabled = True

    def convert(self, model: torch.nn.Module) -> None:
        from torchao.quantization import quantize_

        def converted(module, fqn):
            return (module_filter_fn(module, fqn, self.filter_fqns)
                    and all(size % MXFP8_GROUP_ALIGNMENT_SIZE == 0 for size in module.weight.shape))

        quantize_(model, config=self.config, filter_fn=converted)
        logger.info("quantize.linear.mx: linear layers compute in MXFP8")

    def post_optimizer_hook(self, model) -> None:
        return


CONVERTERS = {"quantize.grouped_mm.mx": MXGroupedMMConverter, "quantize.grouped_mm.float8": Float8GroupedMMConverter,
              "quantize.linear.mx": MXLinearConverter}
# torchtitan registers its own converters of these names when its quantization package is imported (above): ours
# take their places, under the names users write
_registry_model_converter_cls.update(CONVERTERS)


def _unaligned_expert_dims(job_config, recipe: Recipe) -> str | None:
    """Why ``recipe``'s blocks cannot tile the routed experts' GEMMs on one rank: every dimension they contract over,
    the model's and the experts' hidden size as tensor parallelism leaves it (the TP degree without EP, the expert
    TP degree under EP), must be a multiple of the block; None where it is."""
    parallelism, model = job_config.parallelism, shared_meta_model(job_config)
    dim = model.model_args.dim
    if parallelism.expert_parallel_degree > 1:
        shards, field = parallelism.expert_tensor_parallel_degree, "expert_tensor_parallel_degree"
    else:
        shards, field = parallelism.tensor_parallel_degree, "tensor_parallel_degree"
    if dim % recipe.alignment:
        return (f"{recipe.name} quantizes the routed experts' GEMMs in blocks of {recipe.alignment} along the model "
                f"dimension {dim}, which is not a multiple of it: remove {recipe.name}")
    for size in sorted({ROUTED_EXPERTS[type(block.moe.experts)].hidden_size(block.moe.experts)
                        for block in model.layers.values() if block.moe_enabled}):
        if size % (shards * recipe.alignment):
            return (f"{recipe.name} quantizes the routed experts' GEMMs in blocks of {recipe.alignment}: their hidden "
                    f"size {size} over parallelism.{field} = {shards} leaves {size / shards:g} per rank: choose a "
                    f"degree that leaves a multiple of {recipe.alignment}")
    return None


def _float8_linear_problem(job_config, device_type: str | None) -> str | None:
    """Why torchtitan's own ``quantize.linear.float8`` would stop every rank on this machine: its float8 linears need
    an sm89 GPU or newer, else torchtitan's gate asks for ``quantize.linear.float8.emulate`` in eager mode. Past
    the gate a ``recipe_name`` builds torchao's unemulated recipe, which a CPU runs (torch's CPU scaled matmul) and an
    older GPU does not. None where they run, or where this host cannot tell (``device_type`` None: another
    machine's job)."""
    if "quantize.linear.float8" not in job_config.model.converters or device_type is None:
        return None
    capability = _cuda_capability() if device_type == "cuda" else None
    if device_type == "cuda" and (capability is None or capability >= (8, 9)):
        return None
    float8 = job_config.quantize.linear.float8
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    recipe_fails = float8.recipe_name is not None and device_type == "cuda"
    if float8.emulate and not compiled and not recipe_fails:
        return None
    machine = "a CPU" if device_type == "cpu" else f"an sm{capability[0]}{capability[1]} GPU"
    conditions = [name for name, holds in (("the model uncompiled (compile.components without model)", compiled),
                                           ("no quantize.linear.float8.recipe_name", recipe_fails)) if holds]
    return (f"model.converters has quantize.linear.float8, whose float8 linears need an sm89 GPU or newer, and this "
            f"machine has {machine}: set quantize.linear.float8.emulate"
            f"{' with ' + ' and '.join(conditions) if conditions else ''} to emulate them, or remove it")


def check_model_converters(job_config, context: ValidationContext) -> None:
    """Unknown converters, and the low-precision ones where they cannot run, refused in one line before any
    allocation."""
    unknown = [name for name in job_config.model.converters if name not in _registry_model_converter_cls]
    if unknown:
        raise ConfigError(f"model.converters = {job_config.model.converters}: {unknown[0]!r} is not a model converter: "
                          f"use any of {', '.join(sorted(_registry_model_converter_cls))} (--model.converters '' for none)")
    kinds = {name.rsplit(".", 1)[1] for name in job_config.model.converters if name.startswith("quantize.")}
    if len(kinds) > 1:
        raise ConfigError(f"model.converters = {job_config.model.converters} mixes {' and '.join(sorted(kinds))}: "
                          "torchtitan quantizes dense and MoE layers in one type; keep the converters of one")
    problem = _float8_linear_problem(job_config, context.device_type)
    if problem:
        raise ConfigError(problem)
    ours = [name for name in job_config.model.converters if name in RECIPES]
    if not ours:
        return
    for name in ours:
        if name.startswith("quantize.grouped_mm."):
            section = getattr(job_config.quantize.grouped_mm, name.rsplit(".", 1)[1])
            if not section.fqns:
                raise ConfigError(f"{name} is in model.converters but {name}.fqns is empty: set "
                                  f"--{name}.fqns experts (the routed experts' modules)")
    grouped = [name for name in ours if name.startswith("quantize.grouped_mm.")]
    if grouped:
        unserved = sorted({type(block.moe.experts).__name__ for block in shared_meta_model(job_config).layers.values()
                           if block.moe_enabled and type(block.moe.experts) not in ROUTED_EXPERTS})
        if unserved:
            raise ConfigError(f"model.converters has {grouped[0]}, whose grouped GEMMs serve "
                              f"{', '.join(cls.__name__ for cls in ROUTED_EXPERTS)}, not {job_config.model.name}'s "
                              f"{unserved[0]}: remove {grouped[0]}")
        problem = _unaligned_expert_dims(job_config, RECIPES[grouped[0]])
        if problem:
            raise ConfigError(problem)
    if context.device_type is None:
        # priced or dry-run for other machines: the machine's checks run on the job's own ranks
        return
    problem = _torchao_problem()
    if problem:
        raise ConfigError(f"model.converters = {job_config.model.converters}: {problem}")
    capability = _cuda_capability() if context.device_type == "cuda" else None
    for name in ours:
        problem = recipe_problem(RECIPES[name], context.device_type, capability)
        if problem:
            raise ConfigError(f"model.converters = {job_config.model.converters}: {problem}; remove {name} to "
                              f"train in training.mixed_precision_param = "
                              f"'{job_config.training.mixed_precision_param}'")


register_check(check_model_converters)
