"""An independent MXFP8 reference: OCP MX scaling written from the format's definition, not from torchao.

A block is 32 consecutive values along the GEMM's contracting dimension. Its scale is the power of two 2^e with
e = ceil(log2(amax / 448)) (448: the largest float8 e4m3 value; "RCEIL", rounding the scale up so that no value
saturates), and each value is stored as float8 e4m3 of value / 2^e, rounded to nearest. A GEMM in MXFP8 multiplies
the dequantized operands, each quantized along its contracting dimension: in forward the tokens and the weights
along the input dimension; for the input's gradient the output gradient and the weights along the output
dimension; for the weights' gradient the output gradient and the tokens along the token dimension, per expert
group (groups are multiples of 32 rows, so no block straddles two experts).

Not reproduced, and absent from the tests' inputs: blocks whose largest value is below 448 x 2^-127 (torchao flushes
them to zero) and blocks holding inf or NaN.
"""

import torch

from tests.models import swiglu_reference

BLOCK = 32
E4M3_MAX = 448.0


def fake_quantize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` quantized to MXFP8 in blocks of 32 along ``dim`` and dequantized, in fp64."""
    moved = x.double().movedim(dim, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(min=-127, max=127)
    scale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
    quantized = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * scale
    return quantized.reshape(moved.shape).movedim(-1, dim)


class MXGroupedMM(torch.autograd.Function):
    """out[rows of group g] = A[rows] @ B[g] with every operand quantized as MXFP8 does, in ``out_dtype`` (bf16: the
    grouped GEMMs' outputs; a linear layer's follow its input)."""

    @staticmethod
    def forward(ctx, a, b, group_ends, out_dtype=torch.bfloat16):
        ctx.save_for_backward(a, b)
        ctx.group_ends = group_ends
        qa, qb = fake_quantize(a, 1), fake_quantize(b, 1)  # a [M, K], b [E, K, N]: both along K
        return _grouped(qa, qb, group_ends).to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ends = ctx.group_ends
        qgrad = fake_quantize(grad, 1)  # along N
        grad_a = _grouped(qgrad, fake_quantize(b, 2).transpose(1, 2), ends).to(a.dtype)
        grad_b = torch.zeros(b.shape, dtype=torch.float64)
        qgrad_tokens, qa_tokens = fake_quantize(grad, 0), fake_quantize(a, 0)  # along M, blocks inside a group
        start = 0
        for group, end in enumerate(ends):
            grad_b[group] = qa_tokens[start:end].t() @ qgrad_tokens[start:end]
            start = end
        return grad_a, grad_b.to(b.dtype), None, None


def _grouped(a, b, ends):
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for group, end in enumerate(ends):
        out[start:end] = a[start:end] @ b[group]
        start = end
    return out


def experts(w1, w2, w3, x, tokens_per_expert):
    """The routed experts' SwiGLU with MXFP8 GEMMs."""
    return swiglu_reference.experts(MXGroupedMM, w1, w2, w3, x, tokens_per_expert)


def gpt_oss_experts(mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, limit, x, tokens_per_expert):
    """GPT-OSS's experts with MXFP8 GEMMs."""
    return swiglu_reference.gpt_oss_experts(MXGroupedMM, mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, limit, x,
                                            tokens_per_expert)
