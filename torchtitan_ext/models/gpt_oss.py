"""GPT-OSS: torchtitan's model with our parallelize plan.

GPT-OSS's routed experts are not torchtitan's standard ones: each carries biases on both
projections, its first projection interleaves the gate and linear halves, and its SwiGLU is clamped
(``swiglu_limit``). Every EP backend serves them unchanged: a backend moves tokens and applies the
scores after the experts (out = sum_k score_k x expert_k(x), the bias inside each expert), and
shards every expert parameter over EP along its expert dimension; expert replication fetches and
sums all four of an expert's parameters (``GptOssExpertsWithReplicas``), and the low-precision expert
converters quantize its two grouped GEMMs. Expert TP under EP, written against the standard experts'
w1, w2, w3, is refused for it in one line by its own check.

Four departures from torchtitan 0.2.2's model; the first changes values in every job (weights drawn in fp32, fp32
optimizer masters), the last in an fp32 job. And one from its arguments: ``--debug.moe_force_load_balance`` reaches
the routers, as in torchtitan's other MoE models; torchtitan's GPT-OSS arguments never read it:

- the transformer blocks hold their parameters in the default dtype (fp32), as every other model
  here does, instead of bf16: FSDP's ``mixed_precision_param`` sets the compute dtype, and the
  optimizer updates fp32 masters;
- where the tensors are on a CPU, attention runs :class:`FlexOrDenseAttention`'s dense form (PyTorch
  implements no FlexAttention backward on a CPU), and the masks are built eagerly (compiling
  ``create_block_mask`` takes about 14 s per process there). On a GPU both are torchtitan's;
- the router's bias starts at zero (torchtitan leaves it uninitialized, so routing differed run to run);
- the parallelize plan runs the experts as ``torchtitan_ext.ep.experts.GptOssExperts``: with grouped GEMMs no
  host sync (torchtitan's reads the group sizes four times a forward) and the output in the tokens' dtype
  (torchtitan's is bf16).
"""

import dataclasses
from functools import partial
from typing import ClassVar

import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask
from torchtitan.models.attention import (
    FlexAttentionWrapper,
    get_causal_mask_mod,
    get_document_mask_mod,
    get_sliding_window_mask_mod,
)
from torchtitan.models.gpt_oss import gptoss_configs
from torchtitan.models.gpt_oss.infra.expert_parallel import GptossTensorParallel
from torchtitan.models.gpt_oss.infra.parallelize import _op_sac_save_list, apply_non_moe_tp
from torchtitan.models.gpt_oss.model.args import GptOssModelArgs as TorchTitanArgs
from torchtitan.models.gpt_oss.model.model import GptOssModel as TorchTitanModel
from torchtitan.models.moe import MoEArgs

from torchtitan_ext.models.args import as_our_args
from torchtitan_ext.models.moe import grouped_mm_where_supported
from torchtitan_ext.models.parallelize import parallelize_moe_model


@dataclasses.dataclass
class GptOssModelArgs(TorchTitanArgs):
    dense_attention_on_cpu: ClassVar[bool] = True
    """:class:`GptOssModel` computes its FlexAttention densely on a CPU (config validation reads this)."""

    def update_from_config(self, job_config, **kwargs) -> None:
        self.moe_args = grouped_mm_where_supported(self.moe_args)
        super().update_from_config(job_config, **kwargs)
        self.moe_args._debug_force_load_balance = job_config.debug.moe_force_load_balance


class FlexOrDenseAttention(FlexAttentionWrapper):
    """torchtitan's FlexAttention on a GPU; on a CPU the same function computed densely.

    The dense form is FlexAttention's definition: scores q.k x scale where the block mask's
    ``mask_mod`` allows, -inf elsewhere, softmax over the keys; with ``return_lse`` also each row's
    log-sum-exp of the scores (natural log), which GPT-OSS's attention sinks rescale by.
    """

    def forward(self, q, k, v, *, score_mod=None, block_mask=None, scale=None, return_lse=False, enable_gqa=False):
        if q.device.type != "cpu":
            return super().forward(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                   return_lse=return_lse, enable_gqa=enable_gqa)
        if score_mod is not None:
            raise NotImplementedError("a score_mod on a CPU: only block masks have a dense form here")
        if enable_gqa and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # in fp32, as FlexAttention accumulates (its log-sum-exp is fp32 whatever the inputs' dtype)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        if block_mask is not None:
            # the mask's own batch and head sizes: a per-document mask differs per sequence
            batch, heads = block_mask.shape[:2]
            allowed = create_mask(block_mask.mask_mod, batch, heads, q.shape[2], k.shape[2], device=q.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.float()).to(q.dtype)
        return (out, lse) if return_lse else out


class GptOssModel(TorchTitanModel):
    """torchtitan's GPT-OSS with fp32 blocks, :class:`FlexOrDenseAttention` and a zero router bias at
    initialization (see the module docstring)."""

    def __init__(self, model_args: TorchTitanArgs):
        super().__init__(model_args)
        self.layers.to(torch.get_default_dtype())
        for block in self.layers.values():
            block.attention.inner_attention = FlexOrDenseAttention()

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        # torchtitan 0.2.2 initializes the router's weight only: its bias would keep whatever memory the model was
        # materialized in (to_empty after a meta-device build), and routing would differ from run to run
        with torch.no_grad():
            for block in self.layers.values():
                if block.moe.router.gate.bias is not None:
                    block.moe.router.gate.bias.zero_()

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        if input_batch.device.type != "cpu":
            return super().get_attention_masks(input_batch, tokenizer, extra_inputs)
        # torchtitan's masks (get_attention_masks), built without compiling
        match self.model_args.attn_mask_type:
            case "causal":
                batch, basic = None, get_causal_mask_mod()
            case "block_causal":
                batch, basic = input_batch.shape[0], get_document_mask_mod(input_batch, tokenizer.eos_id)
            case other:
                raise ValueError(f"Unknown attention mask type: {other}")
        window = get_sliding_window_mask_mod(self.model_args.sliding_window_size)
        length = input_batch.shape[1]
        build = partial(create_block_mask, B=batch, H=None, Q_LEN=length, KV_LEN=length, device="cpu")
        return {"basic_mask": build(basic), "sliding_window_mask": build(and_masks(basic, window))}


def parallelize_gptoss(model, parallel_dims, job_config):
    """torchtitan's GPT-OSS parallelisms with the configured EP backend; TP without EP shards the experts
    (and their biases) as torchtitan's GPT-OSS plan does."""
    dense_tp = partial(
        apply_non_moe_tp,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        # float8 linears take the plain TP styles (torchtitan_ext.models.converters says why)
        enable_float8_tensorwise_tp=False,
        # the shared plan enables async TP itself (torchtitan's maybe_enable_async_tp)
        enable_async_tp=False,
    )
    return parallelize_moe_model(
        model, parallel_dims, job_config, apply_dense_tp=dense_tp, op_sac_save_list=_op_sac_save_list,
        experts_tensor_parallel=GptossTensorParallel,
    )


DEBUG_SMALL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, moe_inter_dim=128, vocab_size=2048,
                   sliding_window_size=64,
                   moe_args=MoEArgs(num_experts=8, num_shared_experts=0, score_func="softmax", route_norm=True,
                                    route_scale=1.0, gate_bias=True, score_before_experts=False, top_k=4,
                                    use_grouped_mm=True, load_balance_coeff=1e-3))
"""The "debugmodel_small" flavour: GPT-OSS's layer (biased, clamped SwiGLU experts; a biased router; attention
with sinks, sliding-window on even layers) at a size a CPU trains in seconds a step. torchtitan's "debugmodel"
(hidden 256, GPT-OSS's 201,088-token vocabulary and 64 heads) is kept as it ships."""


def flavors() -> dict[str, GptOssModelArgs]:
    """torchtitan's GPT-OSS flavours as our model args, plus "debugmodel_small"."""
    found = {
        name: as_our_args(GptOssModelArgs, args)
        for name, args in gptoss_configs.items()
    }
    found["debugmodel_small"] = dataclasses.replace(found["debugmodel"], **DEBUG_SMALL)
    return found
