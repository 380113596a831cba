"""DeepSeek-V3: torchtitan's model with our parallelize plan and two extra flavours."""

import dataclasses
from functools import partial

from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list, apply_non_moe_tp
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs as TorchTitanArgs

from torchtitan_ext.models.args import as_our_args
from torchtitan_ext.models.moe import grouped_mm_where_supported
from torchtitan_ext.models.parallelize import parallelize_moe_model


@dataclasses.dataclass
class DeepSeekV3ModelArgs(TorchTitanArgs):
    def update_from_config(self, job_config, **kwargs) -> None:
        self.moe_args = grouped_mm_where_supported(self.moe_args)
        super().update_from_config(job_config, **kwargs)
        # Every EP backend is applied by the parallelize plan to torchtitan's standard
        # MoE; its "deepep" MoE would import deep_ep while the model is built.
        self.moe_impl = "standard"


def parallelize_deepseekv3(model, parallel_dims, job_config):
    """torchtitan's DeepSeek-V3 parallelisms with the configured EP backend."""
    dense_tp = partial(
        apply_non_moe_tp,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        # float8 linears take the plain TP styles (torchtitan_ext.models.converters says why)
        enable_float8_tensorwise_tp=False,
        cp_enabled=parallel_dims.cp_enabled,
    )
    return parallelize_moe_model(
        model, parallel_dims, job_config, apply_dense_tp=dense_tp, op_sac_save_list=_op_sac_save_list
    )


CUT_LAYERS = 4
"""Layers of the "16B_4layers" flavour: the 16B model's shapes (its dense first layer and 3 MoE
layers), small enough for a few-GPU smoke test of a cluster (python -m torchtitan_ext.bench cluster_check)."""


SMALL_DEBUG_ATTENTION = dict(n_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
"""The "debugmodel_small" flavour: the debug model with a 4-head attention of 32-dim heads (12.5M
parameters, not 33M; its MoE layers unchanged). Multi-process tests train it or its 3-layer cut: on CPU a debug
step is mostly gloo moving FSDP's parameters, 2.6x less of them here."""


SHALLOW_DEBUG_LAYERS = 3
"""The "debugmodel_small_3layers" flavour: "debugmodel_small" cut to its dense first layer and 2 MoE layers
(MoE layers 1 and 2). The multi-process training tests train it: a step of a debug model on a CPU is
per-operator and per-parameter overhead more than arithmetic, and half the layers take 0.6 of its CPU time."""


WIDE_EXPERTS_INTER_DIM = 1024
"""The "debugmodel_wide_experts" flavour: "debugmodel_small" with 4x wider experts (routed and shared), so
that the MoE layers take most of a step's FLOPs (the routed experts 53%, against 8% in the debug model and
38% in "debugmodel_small"): the shape on which expert load balancing shows in the step time
(python -m torchtitan_ext.bench replication)."""


def flavors() -> dict[str, DeepSeekV3ModelArgs]:
    """torchtitan's DeepSeek-V3 flavours as our model args, plus "16B_4layers", "debugmodel_small",
    "debugmodel_small_3layers" and "debugmodel_wide_experts"."""
    found = {
        name: as_our_args(DeepSeekV3ModelArgs, args)
        for name, args in deepseekv3_args.items()
    }
    found[f"16B_{CUT_LAYERS}layers"] = dataclasses.replace(found["16B"], n_layers=CUT_LAYERS)
    found["debugmodel_small"] = dataclasses.replace(found["debugmodel"], **SMALL_DEBUG_ATTENTION)
    found[f"debugmodel_small_{SHALLOW_DEBUG_LAYERS}layers"] = dataclasses.replace(
        found["debugmodel_small"], n_layers=SHALLOW_DEBUG_LAYERS)
    found["debugmodel_wide_experts"] = dataclasses.replace(found["debugmodel_small"], moe_inter_dim=WIDE_EXPERTS_INTER_DIM)
    return found
