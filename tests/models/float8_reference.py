"""An independent rowwise float8 reference, written from the recipe's definition, not from torchao.

Each slice along the GEMM's contracting dimension gets one scale s = 2^floor(log2(448 / amax)) (448: the largest
float8 e4m3 value; rounded down to a power of two so that no value saturates), and its values are stored as float8
e4m3 of x * s, rounded to nearest. Forward: the tokens' rows and each expert's weight columns along the input
dimension; the input's gradient: the output gradient's rows and the weights along the output dimension; the
weights' gradient: the output gradient and the tokens along the token dimension, within each expert's group.
"""

import torch

from tests.models import swiglu_reference

E4M3_MAX = 448.0


def fake_quantize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with one float8 scale per slice along ``dim``, dequantized, in fp64."""
    x = x.double()
    amax = x.abs().amax(dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() / scale


class Float8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_ends):
        ctx.save_for_backward(a, b)
        ctx.group_ends = group_ends
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        qa, qb, start = fake_quantize(a, 1), fake_quantize(b, 1), 0  # a [M, K], b [E, K, N]: along K
        for group, end in enumerate(group_ends):
            out[start:end] = qa[start:end] @ qb[group]
            start = end
        return out.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = torch.zeros(a.shape, dtype=torch.float64)
        grad_b = torch.zeros(b.shape, dtype=torch.float64)
        qgrad, qb, start = fake_quantize(grad, 1), fake_quantize(b, 2), 0  # along N
        for group, end in enumerate(ctx.group_ends):
            grad_a[start:end] = qgrad[start:end] @ qb[group].t()
            if end > start:  # along the tokens of this group
                grad_b[group] = fake_quantize(a[start:end], 0).t() @ fake_quantize(grad[start:end], 0)
            start = end
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None


def experts(w1, w2, w3, x, tokens_per_expert):
    """The routed experts' SwiGLU with float8 GEMMs."""
    return swiglu_reference.experts(Float8GroupedMM, w1, w2, w3, x, tokens_per_expert)


def gpt_oss_experts(mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, limit, x, tokens_per_expert):
    """GPT-OSS's experts with float8 GEMMs."""
    return swiglu_reference.gpt_oss_experts(Float8GroupedMM, mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, limit, x,
                                            tokens_per_expert)
