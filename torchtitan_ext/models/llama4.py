"""Llama4: torchtitan's model with our parallelize plan."""

import dataclasses
from functools import partial

from torchtitan.models.llama4 import llama4_args
from torchtitan.models.llama4.model.args import TransformerModelArgs
from torchtitan.models.llama4.infra.parallelize import _op_sac_save_list, apply_non_moe_tp

from torchtitan_ext.models.args import as_our_args
from torchtitan_ext.models.moe import grouped_mm_where_supported
from torchtitan_ext.models.parallelize import parallelize_moe_model


@dataclasses.dataclass
class Llama4ModelArgs(TransformerModelArgs):
    def update_from_config(self, job_config, **kwargs) -> None:
        self.moe_args = grouped_mm_where_supported(self.moe_args)
        super().update_from_config(job_config, **kwargs)


def parallelize_llama4(model, parallel_dims, job_config):
    """torchtitan's Llama4 parallelisms with the configured EP backend.

    Llama4 scales tokens by their routing score before the experts; every
    backend keeps that (``score_before_experts`` is passed to each layer's EP style).
    """
    dense_tp = partial(
        apply_non_moe_tp,
        loss_parallel=not job_config.parallelism.disable_loss_parallel,
        # float8 linears take the plain TP styles (torchtitan_ext.models.converters says why)
        enable_float8_tensorwise_tp=False,
    )
    return parallelize_moe_model(
        model, parallel_dims, job_config, apply_dense_tp=dense_tp, op_sac_save_list=_op_sac_save_list
    )


def flavors() -> dict[str, Llama4ModelArgs]:
    """torchtitan's Llama4 flavours as our model args."""
    return {
        name: as_our_args(Llama4ModelArgs, args)
        for name, args in llama4_args.items()
    }
