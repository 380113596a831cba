"""The trainer: torchtitan's ``Trainer``, extended only through its own seams.

Our config sections are merged into its ``JobConfig`` (:mod:`torchtitan_ext.config`),
our train specs registered with ``register_train_spec`` (:mod:`.specs`), our
dataset in its dataset registry, and the subclass below adds what a run needs
beyond torchtitan's loop.
"""

import os
import sys
from functools import partial
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer as TorchTitanTrainer

from torchtitan_ext import runtime
from torchtitan_ext.balancing import routing_stats
from torchtitan_ext.balancing.migration import ExpertMigration, moe_modules
from torchtitan_ext.balancing.routing_skew import RoutingSkewer
from torchtitan_ext.config import ConfigError, job_summary, moe_layer_ids, routed_moe_args
from torchtitan_ext.ep.base import destroy_kernel_buffers
from torchtitan_ext.ep.replication.choice import ReplicaChooser
from torchtitan_ext.runtime.collectives import CollectiveFailed, name_other_collective
from torchtitan_ext.runtime.preemption import PreemptionRequest
from torchtitan_ext.training import checkpoints, faults, nvlink_domains


class Trainer(TorchTitanTrainer):
    """torchtitan's ``Trainer`` plus the runtime accommodations, the routing recorder, the expert
    placement (:mod:`torchtitan_ext.balancing.migration`) and replicas
    (:mod:`torchtitan_ext.ep.replication.choice`), a benchmark's routing skew
    (:mod:`torchtitan_ext.balancing.routing_skew`), pipeline
    gradients normalized like the others' (:mod:`torchtitan_ext.training.loss`), and the fault handling of
    :mod:`torchtitan_ext.training.faults` (preemption, non-finite values, named collective failures)."""

    def __init__(self, job_config, preemption: PreemptionRequest | None = None):
        # torchtitan's "Starting job:" line shows job.description, which overrides make stale
        job_config.job.description = job_banner(job_config)
        super().__init__(job_config)
        runtime.adapt_model_parts(self.model_parts)
        self.routing_recorder = routing_stats.recorder_for(job_config, self.model_parts, self.parallel_dims)
        moe_args = routed_moe_args(self.model_parts[0].model_args)
        if moe_args is not None:
            migration = ExpertMigration(
                job_config, self.model_parts, self.optimizers, moe_layer_ids(job_config), moe_args.num_experts, self.device
            )
            migration.attach(self.checkpointer)
        self.replica_chooser = (
            ReplicaChooser(job_config.expert_replication, moe_modules(self.model_parts)) if job_config.expert_replication.slots_per_rank else None
        )
        if self.replica_chooser is not None:
            self.metrics_processor.sources.append(self.replica_chooser.metrics)
        self.routing_skew = (
            RoutingSkewer(job_config, self.model_parts, self.device) if job_config.routing_skew.alpha else None
        )
        self.preemption = preemption or PreemptionRequest()
        args = self.model_parts[0].model_args
        self.router_health = (
            faults.RouterHealth(self.model_parts, args.n_layers, self.device)
            if routed_moe_args(args) is not None else None
        )
        self.checkpointer._purge_stale_checkpoints = partial(checkpoints.purge_keeping_complete, self.checkpointer)
        self._step_losses: list[torch.Tensor] = []
        self._preempt_now = False
        self.optimizers.step = self._checked(self.optimizers.step)
        if self.parallel_dims.pp_enabled:
            _metadata_inference_in_eval_mode(self.pp_schedule, self.model_parts)
        if job_config.validation.enable:
            self.validator.validate = self._leaving_training_as_it_was(self.validator.validate)

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        # before the model is built: a job whose EP groups cross NVLink domains stops here
        nvlink_domains.check_ep_domains(self.job_config, parallel_dims, self.device)
        return parallel_dims

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if not self.parallel_dims.pp_enabled:
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        else:
            # the schedule runs backward on each microbatch's loss: normalize it there (torchtitan_ext.training.loss)
            with self.loss_fn.normalized_by(global_valid_tokens):
                loss = super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
                )
        # under loss parallelism the loss is a DTensor (replicated): its local value is the whole of it
        self._step_losses.append(loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach())
        return loss

    def _checked(self, optimizer_step):
        """The optimizer's step behind the ranks' agreement on this step's health and on preemption."""

        def step(*args, **kwargs):
            local_loss = torch.stack([loss.reshape(-1).sum() for loss in self._step_losses]).sum() if self._step_losses else None
            self._step_losses = []
            state = faults.agree(self.preemption.signal_name is not None, local_loss, self.router_health, self.device)
            if self.router_health is not None:
                self.router_health.reset()
            self._preempt_now = state["preempt"]
            if state["nonfinite_loss"] or state["layer"] is not None:
                message = faults.describe_nonfinite(self.step, state)
                if self.job_config.faults.on_nonfinite == "stop":
                    raise faults.NonFiniteLoss(
                        f"{message}: stopped (faults.on_nonfinite = 'stop'); the last checkpoint is untouched, "
                        "or set faults.on_nonfinite = 'skip_step' to skip such steps"
                    )
                logger.warning(f"{message}: this step's update is skipped (faults.on_nonfinite = 'skip_step')")
                return None
            return optimizer_step(*args, **kwargs)

        return step

    def _leaving_training_as_it_was(self, validate):
        """torchtitan's validation pass, after which training goes on as if it had not run: torchtitan's MoE adds
        every forward's expert counts to ``tokens_per_expert``, eval mode included, and those counts set the next
        step's routing bias; and the training steps' time and throughput leave the pass out
        (:meth:`~torchtitan_ext.training.metrics.MetricsProcessor.validation_window`)."""

        def validate_and_restore(model_parts, step):
            counts = [(buffer, buffer.clone()) for part in model_parts
                      for name, buffer in part.named_buffers() if name.endswith("tokens_per_expert")]
            with self.metrics_processor.validation_window():
                validate(model_parts, step)
            with torch.no_grad():
                for buffer, before in counts:
                    buffer.copy_(before)

        return validate_and_restore

    def train_step(self, data_iterator):
        if self.routing_skew is not None:
            self.routing_skew.before_step(self.step)
        if self.replica_chooser is not None:
            self.replica_chooser.before_step(self.step)
        try:
            super().train_step(data_iterator)
        except (faults.NonFiniteLoss, CollectiveFailed):
            raise
        except RuntimeError as e:
            named = name_other_collective(e)
            if named is None:
                raise
            raise named from e
        if self.routing_recorder is not None:
            self.routing_recorder.end_step(self.step)
            config = self.job_config
            last = self.step == config.training.steps or self._preempt_now
            if self.step % config.routing_stats.save_every == 0 or last:
                path = self.routing_recorder.save(routing_stats.output_folder(config))
                if path is not None:
                    logger.info(f"Routing statistics saved to {path}")
        if self._preempt_now:
            raise self._preempted()

    def _preempted(self) -> faults.Preempted:
        """Save this step in full (torchtitan's last-step save may keep the model only) and say where,
        once it is complete on disk."""
        where = f"preempted ({self.preemption.signal_name}) at the end of step {self.step}"
        checkpointer = self.checkpointer
        if not checkpointer.enable or checkpointer.load_only:
            setting = "checkpoint.enable = false" if not checkpointer.enable else "checkpoint.load_only = true"
            return faults.Preempted(f"{where}: nothing saved ({setting})", saved=True)
        path = checkpoints.save_now(checkpointer, self.step)
        if path is None:
            return faults.Preempted(
                f"{where}: its checkpoint {checkpointer.folder}/step-{self.step} is incomplete (no .metadata); "
                "a rerun resumes from the last complete one", saved=False,
            )
        return faults.Preempted(f"{where}: checkpoint saved in {path}; rerun the same command to resume", saved=True)

    def train(self):
        checkpointer = self.checkpointer
        if checkpointer.enable:
            checkpoints.set_aside_torn(checkpointer.folder)
        if checkpointer.enable and checkpointer.last_save_in_hf and not checkpointer.load_only:
            left_out = checkpoints.routing_bias_left_out_of_hf(self.job_config, checkpointer.sd_adapter)
            if left_out is not None:
                logger.warning(
                    f"checkpoint.last_save_in_hf: the HF export leaves out {left_out} and each MoE layer's like it, "
                    f"the routing bias load balancing trains ({self.job_config.model.name}'s HF format has no place "
                    "for it), so the exported model routes by the router's scores alone; the DCP checkpoints keep it"
                )
        super().train()
        # an asynchronous save still in flight is finished, not dropped when the process exits
        checkpoints.wait_for_saves(self.checkpointer)


def job_banner(job_config) -> str:
    """What the job is (:func:`~torchtitan_ext.config.job_summary` for torchrun's WORLD_SIZE) and its config file."""
    source = job_config.job.config_file or "no config file"
    return f"{job_summary(job_config, int(os.environ.get('WORLD_SIZE', '1')))} ({source})"


def _metadata_inference_in_eval_mode(schedule, model_parts) -> None:
    """Run the pipeline schedule's stage initialization with the model in eval mode.

    Before its first microbatch, torch's pipeline schedule runs each stage forward and backward
    once on uninitialized tensors (``torch.empty``) to infer shapes. That pass is not training: in
    eval mode the router health check, the EP counters and the routing statistics (which count
    training forwards only) ignore it, instead of reporting its garbage as non-finite router output
    or counting its tokens in step 1. torchtitan's MoE adds every forward's expert counts to
    ``tokens_per_expert`` whatever the mode; they are zeroed after the pass, so that the first
    expert-bias update sees only the step's own tokens.
    """
    initialize = schedule._initialize_pp_stages

    def initialize_in_eval_mode(*args, **kwargs):
        modes = [part.training for part in model_parts]
        for part in model_parts:
            part.eval()
        try:
            return initialize(*args, **kwargs)
        finally:
            for part, mode in zip(model_parts, modes):
                part.train(mode)
                with torch.no_grad():
                    for name, buffer in part.named_buffers():
                        if name.endswith("tokens_per_expert"):
                            buffer.zero_()

    schedule._initialize_pp_stages = initialize_in_eval_mode


def run(job_config) -> int:
    """Train (or write the seed checkpoint of) a validated job in this process; the exit status.

    Preemption ends it cleanly (0) once its checkpoint is complete on disk (1 if it is not); a
    non-finite step under ``on_nonfinite = "stop"``, a failed collective or a placement the ranks refuse together
    (:mod:`.nvlink_domains`) is one line on stderr (1).
    """
    preemption = PreemptionRequest()
    preemption.install()
    trainer: Trainer | None = None
    failure = None
    try:
        trainer = Trainer(job_config, preemption)
        if job_config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            seed = Path(trainer.checkpointer.folder) / "step-0"
            if not checkpoints.is_complete(seed):
                raise RuntimeError(f"the seed checkpoint {seed} has no .metadata after its save")
            logger.info(f"Created seed checkpoint in {seed}")
        else:
            trainer.train()
    except faults.Preempted as e:
        if e.saved:
            logger.info(str(e))
        else:
            print(f"error: {e}", file=sys.stderr, flush=True)
            failure = e
    except (faults.NonFiniteLoss, CollectiveFailed, ConfigError) as e:
        # one line, not a traceback (torchrun tears the peers down), and before the trainer's
        # teardown, which can wait on the same stuck peer; a ConfigError here is what only the ranks together can
        # check (their NVLink domains)
        print(f"error: {e}", file=sys.stderr, flush=True)
        failure = e
    finally:
        if trainer is not None:
            trainer.close()
    if isinstance(failure, CollectiveFailed):
        # a peer is lost: destroying the kernel buffers (a collective) or a barrier would wait for it; the
        # buffers' destructors skip theirs (explicitly_destroy), so the process exits as it is
        return 1
    if torch.distributed.is_initialized():
        # the ranks agreed on how this run ended: each destroys its kernel buffers (collectives over the
        # EP group's communicator) and, once all are done, the process group
        destroy_kernel_buffers()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
    return 0 if failure is None else 1
