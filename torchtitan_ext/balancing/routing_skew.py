"""A controlled routing skew for benchmarks: a few experts made hot, the hot ones moving every few steps.

Under ``[routing_skew] alpha > 0`` every MoE layer's router logits get a constant bias
``alpha * log(1 / rank_e)``, where ``rank_e`` (1 .. E) is expert e's place in a permutation of the layer's
experts, drawn from ``seed``, the layer and the window of ``drift_every`` steps (so every rank draws the same
one, and the hot experts move when a window ends). Under softmax scoring an expert's weight in the scores
scales as ``rank_e ** -alpha``, a Zipf skew, as routing is early in training.

What it is not: a model of any real routing, or anything to train with. It changes which experts tokens reach,
and so the loss; it exists so that balancing (expert replication, placement) can be timed against a skew that
is known, repeatable and drifting. Off by default, and the log says so on every start where it is on.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torchtitan.tools.logging import logger

from torchtitan_ext.balancing.migration import moe_modules
from torchtitan_ext.config import ConfigError, Range, register_check, register_section, ValidationContext
from torchtitan_ext.ep.base import to_device


@dataclass
class RoutingSkew:
    alpha: float = 0.0
    """
    For benchmarks only: strength of the skew added to every router's logits (the expert at place r of the
    layer's permutation gets + alpha x log(1 / r)). 0: off. Range >= 0; 1 and 2 are a mild and a strong
    skew. It changes routing and the loss: never in a config meant for training.
    """
    drift_every: int = 3
    """Steps each permutation holds before the next is drawn (the hot experts move). Range >= 1."""
    seed: int = 0
    """Seed of the permutations; every rank draws the same ones. Any integer >= 0."""


register_section("routing_skew", RoutingSkew, {
    "routing_skew.alpha": Range(0, meaning="skew strength"),
    "routing_skew.drift_every": Range(1, meaning="steps"),
    "routing_skew.seed": Range(0, meaning="a seed"),
})


def check_routing_skew(job_config, context: ValidationContext) -> None:
    """ConfigError for a skew on a model without MoE layers (no router to skew)."""
    if job_config.routing_skew.alpha and context.moe_shape is None:
        raise ConfigError(
            f"routing_skew.alpha = {job_config.routing_skew.alpha} skews MoE routers, and this model has no MoE "
            "layer: set it to 0"
        )


register_check(check_routing_skew)


def skew_bias(num_experts: int, alpha: float, seed: int, layer: int, window: int) -> torch.Tensor:
    """[E] fp32: alpha x log(1 / place) for each expert's place (1 .. E) in the permutation of ``window``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007 + window)
    order = torch.randperm(num_experts, generator=generator)
    place = torch.empty(num_experts).index_copy_(0, order, torch.arange(1.0, num_experts + 1))
    return place.log().mul_(-alpha)


def _biased(bias: torch.Tensor, module, inputs, logits: torch.Tensor) -> torch.Tensor:
    return logits + bias.to(logits.dtype)


class RoutingSkewer:
    """Adds the skew's bias to every MoE layer's router logits (a forward hook on its gate), redrawn between
    steps when a window of ``drift_every`` steps begins."""

    def __init__(self, job_config, model_parts, device: torch.device):
        section = job_config.routing_skew
        self.alpha, self.drift_every, self.seed = section.alpha, section.drift_every, section.seed
        self.layers = moe_modules(model_parts)
        self.biases = {layer: torch.zeros(moe.router.gate.out_features, device=device)
                       for layer, moe in self.layers.items()}
        for layer, moe in self.layers.items():
            moe.router.gate.register_forward_hook(partial(_biased, self.biases[layer]))
        self.window: int | None = None
        logger.warning(
            f"Routing skew on (routing_skew.alpha = {self.alpha:g}, a new permutation every {self.drift_every} "
            f"step(s), seed {self.seed}): for benchmarks only, it changes routing and the loss"
        )

    def before_step(self, step: int) -> None:
        """Draw the layers' permutations when ``step`` begins a window (a copy to the device between steps)."""
        window = (step - 1) // self.drift_every
        if window == self.window:
            return
        self.window = window
        for layer, bias in self.biases.items():
            bias.copy_(to_device(skew_bias(bias.shape[0], self.alpha, self.seed, layer, window), bias.device))
