"""The routed experts' SwiGLU over a reference grouped GEMM, in torchtitan's order (bf16 inputs, bf16 GEMM outputs):
what the low-precision references (mx_reference, float8_reference) share; each brings its own quantized GEMM."""

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
