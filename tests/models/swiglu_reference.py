"""The routed experts' SwiGLU over a reference grouped GEMM, in torchtitan's order (bf16 inputs, bf16 GEMM outputs):
what the low-precision references (mx_reference, float8_reference) share; each brings its own quantized GEMM.
:func:`gpt_oss_experts` is GPT-OSS's form, written from its definition (torchtitan's GPT-OSS model): biases on both
projections, gate and linear halves interleaved, the SwiGLU clamped."""

import torch
import torch.nn.functional as F


def experts(grouped_mm, w1, w2, w3, x, tokens_per_expert):
    """``grouped_mm.apply(a [M, K], b [E, K, N], group ends)`` for each of the three projections."""
    ends = torch.cumsum(tokens_per_expert, 0).tolist()
    rows = x.bfloat16()

    def gemm(a, w):
        return grouped_mm.apply(a, w.bfloat16().transpose(1, 2), ends)

    hidden = F.silu(gemm(rows, w1)) * gemm(rows, w3)
    return gemm(hidden, w2).type_as(x)


def gpt_oss_experts(grouped_mm, mlp1_weight, mlp1_bias, mlp2_weight, mlp2_bias, limit, x, tokens_per_expert):
    """GPT-OSS's experts over ``grouped_mm``: each group's rows get their expert's bias (its gradient summed in the
    bias's dtype), cast to bf16, after each GEMM;
    the gate (even columns) clamped above at ``limit``, the linear half (odd columns) to [-limit, limit]; out =
    gate x sigmoid(1.702 gate) x (linear + 1)."""
    ends = torch.cumsum(tokens_per_expert, 0).tolist()

    def projection(a, weight, bias):
        out = grouped_mm.apply(a, weight.bfloat16().transpose(1, 2), ends)
        starts = [0, *ends[:-1]]
        rows = [bias[expert].expand(end - start, -1) for expert, (start, end) in enumerate(zip(starts, ends))]
        return out + torch.cat(rows + [bias.new_zeros(out.shape[0] - ends[-1], out.shape[1])]).to(out.dtype)

    hidden = projection(x.bfloat16(), mlp1_weight, mlp1_bias)
    gate, linear = hidden[:, 0::2].clamp(max=limit), hidden[:, 1::2].clamp(-limit, limit)
    return projection(gate * torch.sigmoid(1.702 * gate) * (linear + 1), mlp2_weight, mlp2_bias).type_as(x)
