"""The loss of a pipelined job, normalized like every other job's.

torchtitan 0.2.2 sums the cross-entropy over a microbatch's tokens and
divides by the step's global valid-token count before backward. Under
pipeline parallelism, though, the schedule calls backward on each
microbatch's loss itself, and that loss is the undivided sum: every gradient
(and ``grad_norm``) came out ``global_valid_tokens`` times too large, which
clipping then hid by rescaling each step. :class:`PipelineLoss` divides the
gradient, not the value: the trainer's logged loss (sum over microbatches,
divided by the global token count) stays as torchtitan computes it.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class PipelineLoss:
    """A sum-reduced loss function whose gradient is divided by the step's global valid tokens
    while :meth:`normalized_by` is active (the trainer's pipeline steps)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self._divisor: torch.Tensor | None = None

    @contextmanager
    def normalized_by(self, global_valid_tokens: torch.Tensor) -> Iterator[None]:
        self._divisor = global_valid_tokens
        try:
            yield
        finally:
            self._divisor = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum = self.loss_fn(pred, labels)
        if self._divisor is None:
            return loss_sum
        normalized = loss_sum / self._divisor
        # value: the sum (what the trainer averages for the log); gradient: the normalized loss's
        return normalized + (loss_sum - normalized).detach()


def build_loss_fn(build: Callable[..., Callable]) -> Callable[..., PipelineLoss]:
    """A ``TrainSpec.build_loss_fn`` that wraps ``build``'s loss in :class:`PipelineLoss`."""

    def build_pipeline_loss(job_config, **kwargs) -> PipelineLoss:
        return PipelineLoss(build(job_config, **kwargs))

    return build_pipeline_loss
