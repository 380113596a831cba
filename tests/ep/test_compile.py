"""torch.compile over an EP layer (the routed experts with a backend's dispatch and combine), on a CPU with the
aot_eager backend: non-blocking HybridEP, whose shapes are static, compiles into one graph; the others break
where a host value sets a shape (held per backend, so that a new break is noticed), and every compiled layer
computes what the eager one does, forward and backward.

The nccl backend is left out: its split sizes are host values (one graph break, budgeted as its host sync),
and AOTAutograd then fails to copy the backward graph of the experts' DTensor weights (a ProcessGroup in it).
torchtitan's own ``compile.enable`` does not compile the routed experts either (torchtitan issue 1940)."""

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from tests.ep.cases import _experts, Case, global_inputs, make_style, Routing

CASE = Case("compiled", num_experts=8, top_k=2, score_before_experts=False, seed=31, total_tokens=64, hidden=32,
            pad_multiple=8)
GRAPH_BREAKS = {"hybridep_non_blocking": 0, "hybridep": 2, "deepep": 5, "deepep_legacy": 5}
"""Graph breaks of each backend's layer under torchtitan's compile settings: blocking HybridEP's and DeepEP's
dispatch size their outputs from the routing (twice each: the forward frame and the resumed one); DeepEP also
breaks 3 times at ``Tensor.is_pinned()`` in :func:`torchtitan_ext.ep.base.to_device` (a host bool)."""


@pytest.fixture(scope="module")
def world_of_one():
    from torchtitan_ext.training import prepare

    prepare()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


def _step(layer, inputs) -> tuple[torch.Tensor, ...]:
    x = inputs["x"].clone().requires_grad_()
    scores = inputs["scores"].clone().requires_grad_()
    out = layer(x, Routing(scores, inputs["ids"]))
    out.backward(inputs["grad_out"])
    return out.detach().clone(), x.grad, scores.grad


@pytest.mark.parametrize("backend", GRAPH_BREAKS)
def test_a_compiled_ep_layer_computes_as_eager_with_its_graph_breaks(world_of_one, backend):
    inputs = global_inputs(CASE)
    layer = _experts(CASE, inputs, grouped_mm=True)
    parallelize_module(layer, world_of_one, make_style(backend, CASE, 1))
    eager = _step(layer, inputs)  # builds the kernel buffer, as a job's first step does
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=GRAPH_BREAKS[backend] == 0)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as torchtitan's compile.enable sets it
        got = _step(compiled, inputs)
    assert sum(counters["graph_break"].values()) == GRAPH_BREAKS[backend], dict(counters["graph_break"])
    for expected, actual in zip(eager, got):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
