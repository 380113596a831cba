"""The benchmarks' routing skew: a Zipf bias on each router's logits, the same on every rank, moving every few steps."""

from types import SimpleNamespace

import pytest
import torch

from torchtitan_ext.balancing.routing_skew import check_routing_skew, RoutingSkewer, skew_bias
from torchtitan_ext.config import ConfigError, ValidationContext


def _model(experts: int = 8) -> torch.nn.Module:
    """One MoE layer (layer id 1) as the skew finds it: a router whose gate makes the logits."""
    moe = torch.nn.Module()
    moe.router = torch.nn.Module()
    moe.router.gate = torch.nn.Linear(4, experts, bias=False)
    moe.experts = torch.nn.Module()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"1": torch.nn.Module()})
    model.layers["1"].moe = moe
    return model


def _job(alpha: float, drift_every: int = 3, seed: int = 0):
    return SimpleNamespace(routing_skew=SimpleNamespace(alpha=alpha, drift_every=drift_every, seed=seed))


def test_the_bias_is_alpha_log_one_over_each_experts_place():
    bias = skew_bias(8, 2.0, seed=0, layer=1, window=0)
    places = torch.exp(-bias / 2.0).round()
    assert sorted(places.tolist()) == list(range(1, 9)), "each expert holds one place of a permutation"
    assert torch.allclose(bias, -2.0 * places.log())
    assert torch.equal(skew_bias(8, 2.0, 0, 1, 0), bias), "every rank draws the same"
    assert not torch.equal(skew_bias(8, 2.0, 0, 2, 0), bias), "each layer its own"


def test_the_skew_adds_to_the_logits_and_moves_once_per_window():
    model = _model()
    skewer = RoutingSkewer(_job(alpha=1.0, drift_every=3, seed=7), [model], torch.device("cpu"))
    gate = model.layers["1"].moe.router.gate
    x = torch.randn(5, 4)
    plain = x @ gate.weight.T
    added = {}
    for step in range(1, 8):
        skewer.before_step(step)
        added[step] = (gate(x) - plain)[0].detach()
    assert torch.allclose(added[1], skew_bias(8, 1.0, 7, 1, 0), atol=1e-6)
    assert torch.equal(added[1], added[3]) and torch.equal(added[4], added[6])
    assert torch.allclose(added[4], skew_bias(8, 1.0, 7, 1, 1), atol=1e-6) and not torch.equal(added[3], added[4])
    assert torch.allclose(added[7], skew_bias(8, 1.0, 7, 1, 2), atol=1e-6)
    assert not skewer.biases[1].requires_grad, "a constant: the router's gradient is the unskewed one's"


def test_a_skew_without_moe_layers_is_refused():
    context = ValidationContext(device_type=None, world_size=None, moe_shape=None)
    with pytest.raises(ConfigError) as error:
        check_routing_skew(_job(alpha=2.0), context)
    assert str(error.value) == (
        "routing_skew.alpha = 2.0 skews MoE routers, and this model has no MoE layer: set it to 0"
    )
