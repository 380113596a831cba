"""Qwen3 (with its MoE flavours, Qwen3-MoE): torchtitan's model with our parallelize plan.

Qwen3-MoE's layers are torchtitan's standard MoE (SwiGLU experts without bias, softmax routing
renormalised over the top-k, no shared experts, scores applied after the experts), so every
backend, expert placement and replication applies as to DeepSeek-V3. torchtitan 0.2.2 gives
Qwen3 no pipeline split, so neither does this spec (config validation refuses PP > 1); its TP plan
runs on GPUs only (:attr:`Qwen3ModelArgs.cpu_tensor_parallel_problem`).
"""

import dataclasses
from functools import partial
from typing import ClassVar

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list, apply_non_moe_tp
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs as TorchTitanArgs

from torchtitan_ext.models.args import as_our_args
from torchtitan_ext.models.moe import grouped_mm_where_supported
from torchtitan_ext.models.parallelize import parallelize_moe_model


@dataclasses.dataclass
class Qwen3ModelArgs(TorchTitanArgs):
    cpu_tensor_parallel_problem: ClassVar[str] = (
        "torchtitan's Qwen3 TP plan runs attention on DTensors, and PyTorch has no DTensor rule for a CPU's "
        "SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu)")
    """Why TP cannot run on a CPU (config validation reads this); on a GPU it is torchtitan's plan."""

    def update_from_config(self, job_config, **kwargs) -> None:
        self.moe_args = grouped_mm_where_supported(self.moe_args)
        super().update_from_config(job_config, **kwargs)


def parallelize_qwen3(model, parallel_dims, job_config):
    """torchtitan's Qwen3 parallelisms with the configured EP backend."""
    dense_tp = partial(
        apply_non_moe_tp,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        # float8 linears take the plain TP styles (torchtitan_ext.models.converters says why)
        enable_float8_tensorwise_tp=False,
        # the shared plan enables async TP itself (torchtitan's maybe_enable_async_tp)
        enable_async_tp=False,
        cp_enabled=parallel_dims.cp_enabled,
    )
    return parallelize_moe_model(
        model, parallel_dims, job_config, apply_dense_tp=dense_tp, op_sac_save_list=_op_sac_save_list
    )


DEBUG_MOE_SMALL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, moe_inter_dim=128,
                       moe_args=MoEArgs(num_experts=16, num_shared_experts=0, top_k=4, score_func="softmax",
                                        route_norm=True, route_scale=1.0, score_before_experts=False))
"""The "debugmodel_moe_small" flavour: Qwen3-MoE's layer (softmax top-k renormalised, no shared experts) at a
size a CPU trains in seconds a step: 4 layers of 16 experts, top-4. torchtitan's "debugmodel_moe" (8 layers of
64 experts, top-8) is kept as it ships."""


def flavors() -> dict[str, Qwen3ModelArgs]:
    """torchtitan's Qwen3 flavours (dense and MoE) as our model args, plus "debugmodel_moe_small"."""
    found = {
        name: as_our_args(Qwen3ModelArgs, args)
        for name, args in qwen3_args.items()
    }
    found["debugmodel_moe_small"] = dataclasses.replace(found["debugmodel_moe"], **DEBUG_MOE_SMALL)
    return found
