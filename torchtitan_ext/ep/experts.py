"""The routed experts as this harness runs them: torchtitan's math, without the host syncs and weight-gradient copies
of its forward.

Without grouped GEMMs (a CPU, a GPU below SM90) torchtitan's experts run one expert at a time and index each out of
the stacked [E, ...] weight. Each index's backward writes a zero-filled gradient of the whole stack, and autograd sums
the E of them: E x E experts' bytes written and (E - 1) x E added per projection, per layer and step (with 16 local
experts, half of the experts' forward and backward on a CPU: docs/balancing.md, "The CPU's per-expert loop").
Unbound, the E gradients are stacked once.

With grouped GEMMs, torchtitan's GPT-OSS experts read the group sizes on the host to lay each expert's bias over its
rows (``int(offsets[-1])`` and ``repeat_interleave`` without an output size: four host syncs per layer's forward);
:func:`run_gpt_oss_experts_grouped_mm` lays them with the sizes left on the device.

Outputs and gradients equal torchtitan's. :func:`adopt_routed_experts` turns a model's experts, in place, into this
module's class for them (:data:`ROUTED_EXPERTS`): torchtitan's ``GroupedExperts`` into :class:`UnboundLoopExperts`,
whose grouped GEMMs are torchtitan's or a model converter's low-precision ones; GPT-OSS's into
:class:`GptOssExperts`, whose grouped GEMMs are torch's bf16 ones or the converter's.
"""

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.gpt_oss.model import moe as gpt_oss_moe
from torchtitan.models.moe import moe as torchtitan_moe
from torchtitan.models.moe.moe import _run_experts_for_loop, GroupedExperts


def run_experts_for_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's per-expert loop on the experts' weights unbound (it only indexes them by expert)."""
    return _run_experts_for_loop(w1.unbind(0), w2.unbind(0), w3.unbind(0), x, num_tokens_per_expert)


class UnboundLoopExperts(GroupedExperts):
    """GroupedExperts whose per-expert loop takes each expert's weights unbound, and whose grouped GEMMs run a
    model converter's low-precision recipe when it gave them one."""

    low_precision = None
    """The recipe a model converter set (:class:`torchtitan_ext.models.converters.LowPrecisionGroupedMM`): the three
    grouped GEMMs quantize on the fly, on a CPU too; None: torchtitan's GEMMs."""

    @staticmethod
    def hidden_size(experts: GroupedExperts) -> int:
        """The experts' hidden size as ``experts`` (this class or torchtitan's) holds it: w2's input dimension."""
        return experts.w2.shape[-1]

    def local_weights(self) -> list[torch.Tensor]:
        """This rank's [E, ...] w1, w2, w3, as plain tensors."""
        return [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm and self.low_precision is None:
            return super().forward(x, num_tokens_per_expert)
        return self.run_experts(*self.local_weights(), x, num_tokens_per_expert)

    def run_experts(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on these (local) weights: the low-precision grouped GEMMs, torchtitan's grouped GEMMs, or
        the per-expert loop."""
        if self.low_precision is not None:
            return self.low_precision.run_experts(w1, w2, w3, x, num_tokens_per_expert)
        if self.use_grouped_mm:
            # looked up at each call: torchtitan's compile swaps in its compiled version
            return torchtitan_moe._run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)


def run_gpt_oss_experts_for_loop(mlp1_weight: torch.Tensor, mlp1_bias: torch.Tensor, mlp2_weight: torch.Tensor,
                                 mlp2_bias: torch.Tensor, swiglu_limit: float, x: torch.Tensor,
                                 num_tokens_per_expert: torch.Tensor, tp_degree: int = 1) -> torch.Tensor:
    """torchtitan's GPT-OSS per-expert loop on the experts' weights and biases unbound (it only indexes them by
    expert)."""
    return gpt_oss_moe._run_experts_for_loop(mlp1_weight.unbind(0), mlp1_bias.unbind(0), mlp2_weight.unbind(0),
                                             mlp2_bias.unbind(0), swiglu_limit, x, num_tokens_per_expert, tp_degree)


def _expert_of_row(num_tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] each row's expert, E (one past the last) for the padding rows after the last group, which must number
    rows - sum(num_tokens_per_expert) >= 0 (a dispatch pads after the groups). The group sizes stay on the device:
    the padding's count is a device value, and ``output_size`` tells ``repeat_interleave`` the rows it writes."""
    counts = num_tokens_per_expert.long()
    counts = torch.cat([counts, (rows - counts.sum()).reshape(1)])
    return torch.arange(counts.shape[0], device=counts.device).repeat_interleave(counts, output_size=rows)


def _bias_per_row(bias: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """[rows, D]: each expert's bias over its group's rows, zeros over the padding rows."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[-1])]).index_select(0, expert_of_row)


def bf16_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM of bf16 ``a`` [M, K] and ``b_t`` [E, K, N] over the row groups ``offsets`` ends."""
    return torch._grouped_mm(a, b_t, offs=offsets)


def run_gpt_oss_experts_grouped_mm(mlp1_weight: torch.Tensor, mlp1_bias: torch.Tensor, mlp2_weight: torch.Tensor,
                                   mlp2_bias: torch.Tensor, swiglu_limit: float, x: torch.Tensor,
                                   num_tokens_per_expert: torch.Tensor, tp_degree: int = 1,
                                   grouped_mm=bf16_grouped_mm) -> torch.Tensor:
    """torchtitan's GPT-OSS grouped GEMMs (bf16) and biases, the host never waiting for the group sizes, the output
    in the tokens' dtype (as torchtitan's ``GroupedExperts``; its GPT-OSS returns bf16, which a kernel library's
    combine, its buffer sized for fp32 activations, refuses). ``tp_degree``: the experts' TP degree, which the second
    bias is divided by forward (TP's all-reduce sums it); ``grouped_mm``: the GEMMs (:func:`bf16_grouped_mm`'s
    signature; a model converter's low-precision recipe)."""
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    expert_of_row = _expert_of_row(num_tokens_per_expert, x.shape[0])
    h = grouped_mm(x.bfloat16(), mlp1_weight.transpose(-2, -1).bfloat16(), offsets)
    h = h + _bias_per_row(mlp1_bias, expert_of_row).to(h.dtype)
    h = gpt_oss_moe.swiglu(h, limit=swiglu_limit)
    h = grouped_mm(h, mlp2_weight.transpose(-2, -1).bfloat16(), offsets)
    b2 = gpt_oss_moe.ScaleBiasForward.apply(_bias_per_row(mlp2_bias, expert_of_row), tp_degree)
    return (h + b2.to(h.dtype)).type_as(x)


class GptOssExperts(gpt_oss_moe.GptOssGroupedExperts):
    """GPT-OSS's experts (mlp1 and mlp2, each a weight and a bias; the clamped SwiGLU) with
    :func:`run_gpt_oss_experts_grouped_mm` for grouped GEMMs (or a model converter's low-precision ones) and the loop
    on unbound weights."""

    low_precision = None
    """The recipe a model converter set (:class:`torchtitan_ext.models.converters.LowPrecisionGroupedMM`): the two
    grouped GEMMs quantize on the fly, on a CPU too; None: torch's bf16 GEMMs."""

    @staticmethod
    def hidden_size(experts: gpt_oss_moe.GptOssGroupedExperts) -> int:
        """The experts' hidden size as ``experts`` (this class or torchtitan's) holds it: mlp2's input dimension (mlp1
        writes twice it, the gate and linear halves)."""
        return experts.mlp2_weight.shape[-1]

    def local_weights(self) -> list[torch.Tensor]:
        """This rank's [E, ...] mlp1 weight and bias, mlp2 weight and bias, as plain tensors."""
        return [w.to_local() if isinstance(w, DTensor) else w
                for w in (self.mlp1_weight, self.mlp1_bias, self.mlp2_weight, self.mlp2_bias)]

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        weights = self.local_weights()
        mesh_dims = self.mlp1_weight.device_mesh.mesh_dim_names if isinstance(self.mlp1_weight, DTensor) else ()
        tp_degree = self.mlp1_weight.device_mesh.size(mesh_dims.index("tp")) if "tp" in mesh_dims else 1
        if self.use_grouped_mm and "ep" not in mesh_dims and self.low_precision is None:
            # as torchtitan: without EP nothing has grouped the rows by expert in aligned groups (a recipe pads its own)
            padded = gpt_oss_moe.indices_padding_wrapper(run_gpt_oss_experts_grouped_mm)
            return padded(*weights, self.swiglu_limit, x, num_tokens_per_expert, tp_degree)
        return self.run_experts(weights, x, num_tokens_per_expert, tp_degree)

    def run_experts(self, weights: list[torch.Tensor], x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                    tp_degree: int = 1) -> torch.Tensor:
        """The experts on these (local, stacked) weights and biases, rows grouped by expert: the low-precision
        grouped GEMMs, the bf16 ones, or the per-expert loop."""
        if self.low_precision is not None:
            return self.low_precision.run_gpt_oss_experts(*weights, self.swiglu_limit, x, num_tokens_per_expert,
                                                          tp_degree)
        run = run_gpt_oss_experts_grouped_mm if self.use_grouped_mm else run_gpt_oss_experts_for_loop
        return run(*weights, self.swiglu_limit, x, num_tokens_per_expert, tp_degree)


ROUTED_EXPERTS: dict[type, type[torch.nn.Module]] = {
    GroupedExperts: UnboundLoopExperts,
    gpt_oss_moe.GptOssGroupedExperts: GptOssExperts,
}
"""torchtitan's routed-experts classes, and the class of this module each becomes (:func:`adopt_routed_experts`)."""


def adopt_routed_experts(model: torch.nn.Module) -> None:
    """Every torchtitan routed-experts module of ``model`` turned, in place, into its :data:`ROUTED_EXPERTS` class
    (same parameters and state dict keys); subclasses, which bring their own forward, are left as they are."""
    for module in model.modules():
        if type(module) in ROUTED_EXPERTS:
            module.__class__ = ROUTED_EXPERTS[type(module)]
