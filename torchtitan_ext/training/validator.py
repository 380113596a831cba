"""Validation (``validation.enable``): torchtitan's ``Validator``, given the inputs a training step gets.

torchtitan 0.2.2's ``Validator`` asks every model for attention masks and passes them on; its trainer builds them
for FlexAttention and varlen models only, and an SDPA model's attention asserts it gets none (DeepSeek-V3's,
Llama4's and Qwen3's with SDPA stop at the first validation). :class:`Validator` prepares a batch as the trainer's
``post_dataloading_process`` does. What the pass must leave as it was (the experts' load counts, the training
steps' metrics) is the trainer's to restore (:mod:`torchtitan_ext.training.trainer`); the datasets it reads are
checked with training's (:mod:`torchtitan_ext.data`), its layout here (:func:`check_validation`).
"""

from typing import Any

import torch
from torchtitan.components.validate import Validator as TorchTitanValidator
from torchtitan.distributed.context_parallel import prepare_context_parallel_input

from torchtitan_ext.config import (comm_backend, ConfigError, data_parallel_degree, model_class_and_args,
                                   register_check, tokens_per_dispatch, ValidationContext)
from torchtitan_ext.ep import backend_class

V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Pipeline schedules whose ranks each hold two adjacent stages, handing gradients between them within the rank:
torch's forward-only pass (``eval``) stops on that hand-over ("can't steal_bwd_input if this stage doesn't have
backward", seen with ZBVZeroBubble)."""

ATTENTION_WITH_MASKS = ("flex", "varlen")
"""The ``attn_type`` values whose model takes attention masks (torchtitan's trainer builds them for these only)."""


class Validator(TorchTitanValidator):
    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, model_parts: list[torch.nn.Module],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """(inputs, labels, extra inputs for the first stage, keyword arguments for every stage), as the trainer's."""
        inputs = input_dict["input"]
        extra_inputs = {key: value for key, value in input_dict.items() if key != "input"}
        extra_kwargs: dict[str, Any] = {}
        model = model_parts[0]
        if getattr(model.model_args, "attn_type", "sdpa") in ATTENTION_WITH_MASKS:
            extra_kwargs["attention_masks"] = model.get_attention_masks(
                input_batch=inputs, tokenizer=self.tokenizer, extra_inputs=extra_inputs)
        if self.parallel_dims.cp_enabled:
            inputs, labels, extra_kwargs = prepare_context_parallel_input(
                inputs, labels, extra_kwargs, self.parallel_dims.get_mesh("cp"), inputs.device,
                self.job_config.parallelism.context_parallel_load_balancer,
            )
        return inputs, labels, extra_inputs, extra_kwargs


def build_validator(*, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                    validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None,
                    pp_has_first_stage: bool | None = None, pp_has_last_stage: bool | None = None) -> Validator:
    """``TrainSpec.build_validator_fn`` for our train specs (torchtitan's ``build_validator``, our class)."""
    return Validator(
        job_config=job_config, dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer,
        parallel_dims=parallel_dims, loss_fn=loss_fn, validation_context=validation_context,
        maybe_enable_amp=maybe_enable_amp, metrics_processor=metrics_processor, pp_schedule=pp_schedule,
        pp_has_first_stage=pp_has_first_stage, pp_has_last_stage=pp_has_last_stage,
    )


def check_validation(job_config, context: ValidationContext) -> None:
    """ConfigError where a validating job would stop, or hang, at its first validation, once its ranks have trained a
    step: a sequence longer than the model's position table or that its parallelism cannot split, a pipeline schedule
    or batch torch's forward-only pass cannot run, a dispatch larger than training's where the EP backend's buffers are
    made for training's, or a pass over the whole dataset that data-parallel ranks end at different batches."""
    validation, p = job_config.validation, job_config.parallelism
    if not validation.enable:
        return
    _, model_args = model_class_and_args(job_config)
    longest = getattr(model_args, "max_seq_len", None)
    if longest is not None and validation.seq_len > longest:
        raise ConfigError(
            f"validation.seq_len = {validation.seq_len} is longer than the model's position table (max_seq_len = "
            f"{longest}, which torchtitan sets from training.seq_len): use a validation.seq_len of at most {longest}")
    divisor = p.tensor_parallel_degree * 2 * p.context_parallel_degree
    if validation.seq_len % divisor:
        raise ConfigError(f"validation.seq_len = {validation.seq_len} is not divisible by TP x 2 x CP = {divisor}: use "
                          f"a multiple of {divisor}")
    if p.pipeline_parallel_degree > 1:
        if p.pipeline_parallel_schedule in V_SHAPED_SCHEDULES:
            raise ConfigError(
                f"validation.enable with pipeline_parallel_schedule = '{p.pipeline_parallel_schedule}': torch's "
                "V-shaped schedules cannot run a forward-only pass (each rank's two stages hand gradients over "
                "within the rank); use another schedule to validate, or unset validation.enable")
        microbatches = job_config.training.local_batch_size // p.pipeline_parallel_microbatch_size
        if validation.local_batch_size % microbatches:
            raise ConfigError(
                f"validation.local_batch_size = {validation.local_batch_size}: the pipeline schedule splits every "
                f"batch into its {microbatches} microbatches (training.local_batch_size / "
                f"pipeline_parallel_microbatch_size): use a multiple of {microbatches}")
    tokens = tokens_per_dispatch(job_config)
    if (tokens["validation"] > tokens["training"] and context.moe_shape is not None and p.expert_parallel_degree > 1
            and backend_class(job_config).sized_by_dispatch):
        raise ConfigError(
            f"validation.local_batch_size x seq_len = {validation.local_batch_size} x {validation.seq_len} gives "
            f"{tokens['validation']} tokens per rank per MoE dispatch, more than training's {tokens['training']}, "
            f"which {comm_backend(job_config)}'s buffers are made for: lower validation.local_batch_size or seq_len "
            "(or raise training's)")
    degree = data_parallel_degree(job_config, context.world_size)
    if validation.steps == -1 and degree is not None and degree > 1:
        raise ConfigError(
            f"validation.steps = -1 (the whole dataset) on {degree} data-parallel ranks: each reads its own share, "
            "and the first to run out leaves the others waiting in a collective; set validation.steps to a number "
            "of batches")


register_check(check_validation)
