"""GPT-OSS's attention on a CPU (:class:`torchtitan_ext.models.gpt_oss.FlexOrDenseAttention`) equals PyTorch's
FlexAttention, run eagerly (forward only: PyTorch has no FlexAttention backward on a CPU), on the masks GPT-OSS uses:
causal, causal with a sliding window, and per-document (torchtitan's "block_causal" for GPT-OSS); with
grouped-query heads, output and log-sum-exp, in fp32 and from bf16 inputs (accumulated in fp32, as FlexAttention does)."""

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod, get_sliding_window_mask_mod

from torchtitan_ext.models.gpt_oss import FlexOrDenseAttention

LENGTH = 48
DOCUMENTS = torch.tensor([[5, 9, 0, 7] * 12, [1] * 20 + [0] + [2] * 27])
"""Two sequences; token 0 ends a document."""


def _masks():
    causal = get_causal_mask_mod()
    return {
        "causal": (None, causal),
        "sliding_window": (None, and_masks(causal, get_sliding_window_mask_mod(5))),
        "documents": (2, get_document_mask_mod(DOCUMENTS, 0)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", _masks())
def test_dense_attention_equals_flex_attention(mask, dtype):
    """bf16 inputs: FlexAttention's fp32 result on the same (exactly upcast) values, its output rounded once to
    bf16 and its log-sum-exp in fp32."""
    batch, mask_mod = _masks()[mask]
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, LENGTH, 16, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, LENGTH, 16, generator=generator).to(dtype) for _ in range(2))
    block_mask = create_block_mask(mask_mod, batch, None, LENGTH, LENGTH, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's notice that it is for debugging
        expected, expected_lse = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, scale=0.3,
                                                return_lse=True, enable_gqa=True)
    out, lse = FlexOrDenseAttention()(q, k, v, block_mask=block_mask, scale=0.3, return_lse=True, enable_gqa=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    rounding = {"rtol": 2**-8, "atol": 2**-8} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, expected.to(dtype), **rounding)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-6)
