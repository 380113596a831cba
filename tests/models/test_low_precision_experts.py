"""The low-precision routed experts (torchtitan_ext.models.converters) against independent references written from
each recipe's definition (tests/models/mx_reference.py, tests/models/float8_reference.py), for the standard experts
and GPT-OSS's: alone, with groups left unpadded, under EP with every backend, and through GPT-OSS's plan (the
standard experts' with a replica: tests/ep/test_replication.py).

The plain (unquantized) grouped GEMM misses the references by about 6% on these shapes: the tolerance below, a
hundredth of that, can only be met by quantizing as the recipe does."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.moe.moe import _run_experts_grouped_mm

from tests.ep.cases import Case, global_inputs, make_style
from torchtitan_ext.ep.backends import DROPLESS_WHEN_PADDED
from tests.helpers import planned_experts, run_distributed
from tests.models import float8_reference, mx_reference
from torchtitan_ext.ep.base import Routing
from torchtitan_ext.ep.experts import run_gpt_oss_experts_grouped_mm, UnboundLoopExperts
from torchtitan_ext.models.converters import LowPrecisionGroupedMM, _torchao_config

MATCH = 1e-3
"""Largest relative error (Frobenius) of the converted experts against the reference: bf16 roundings of sums taken
in another order."""
UNQUANTIZED = 2e-2
"""Smallest relative error of the unquantized GEMMs against the reference on the same inputs."""
CASE = Case("mx_e4_top2", num_experts=4, top_k=2, score_before_experts=False, seed=11, total_tokens=64, hidden=64,
            ffn=96, pad_multiple=32)
"""A DeepSeek-V3-like MoE (scores after the experts) whose dimensions are multiples of the MXFP8 block."""
EP_BACKENDS = DROPLESS_WHEN_PADDED
"""Every variant that keeps every pair at the padding the recipe needs."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


REFERENCES = {"quantize.grouped_mm.mx": mx_reference, "quantize.grouped_mm.float8": float8_reference}
"""Each grouped converter's independent reference."""


def _recipe(converter: str, pad_groups: bool = False) -> LowPrecisionGroupedMM:
    """The converter's recipe on a CPU, groups padded by torchao when ``pad_groups`` (MXFP8; the float8 emulation
    takes groups of any size)."""
    float8 = converter.endswith(".float8")
    return LowPrecisionGroupedMM(_torchao_config(converter, "cpu", pad_groups and not float8),
                                 pad_with_torchtitan=False, emulate_float8=float8)


def _outputs_and_grads(run, weights, x, counts, grad):
    leaves = [t.clone().requires_grad_() for t in (*weights, x)]
    out = run(*leaves, counts)
    out.backward(grad)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def _weights(generator, experts=3, dim=64, hidden=96):
    return [torch.randn(shape, generator=generator) * 0.1
            for shape in ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))]


@pytest.mark.parametrize("converter", sorted(REFERENCES))
def test_the_experts_match_the_independent_reference_and_not_the_plain_gemms(converter):
    """Groups padded by the backend (a multiple of 32 each, one empty): output and the gradients of the tokens and
    of every weight."""
    generator = torch.Generator().manual_seed(0)
    weights, counts = _weights(generator), torch.tensor([64, 0, 32])
    x, grad = torch.randn(96, 64, generator=generator), torch.randn(96, 64, generator=generator)
    got = _outputs_and_grads(_recipe(converter).run_experts, weights, x, counts, grad)
    expected = _outputs_and_grads(REFERENCES[converter].experts, weights, x, counts, grad)
    plain = _outputs_and_grads(_run_experts_grouped_mm, weights, x, counts, grad)
    for name, value, truth, unquantized in zip(("out", "w1", "w2", "w3", "x"), got, expected, plain):
        assert _relative(value, truth) < MATCH, name
        assert _relative(unquantized, truth) > UNQUANTIZED, name


GPT_OSS_GRADIENTS = ("out", "mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias", "x")
SWIGLU_LIMIT = 0.3
"""Clamps a share of the GPT-OSS tests' pre-activations."""


def _gpt_oss_parameters(generator, experts=3, dim=64, hidden=96):
    return [torch.randn(shape, generator=generator) * 0.1
            for shape in ((experts, 2 * hidden, dim), (experts, 2 * hidden), (experts, dim, hidden), (experts, dim))]


def _gpt_oss(run, routed: int | None = None):
    """``run`` (GPT-OSS's experts, torchtitan's signature) on the leaves _outputs_and_grads makes: the four
    parameters, the tokens, the counts; the output's first ``routed`` rows (grouped GEMMs leave the padding rows'
    outputs undefined: nothing flows back from them)."""
    def experts(*leaves):
        return run(*leaves[:4], SWIGLU_LIMIT, leaves[4], leaves[5])[:routed]
    return experts


@pytest.mark.parametrize("converter", sorted(REFERENCES))
def test_gpt_oss_experts_match_the_independent_reference_and_not_the_plain_gemms(converter):
    """GPT-OSS's biased, clamped experts, groups padded by the backend (one empty, padding rows after the last):
    output and the gradients of the tokens (the routed rows') and of every parameter. mlp2's bias gradient is the
    output gradient summed per expert (no GEMM on its path): the plain GEMMs give it too."""
    generator = torch.Generator().manual_seed(3)
    parameters, counts = _gpt_oss_parameters(generator), torch.tensor([64, 0, 32])
    x, grad = torch.randn(128, 64, generator=generator), torch.randn(96, 64, generator=generator)
    got, expected, plain = [
        _outputs_and_grads(_gpt_oss(run, routed=96), parameters, x, counts, grad)
        for run in (_recipe(converter).run_gpt_oss_experts, REFERENCES[converter].gpt_oss_experts,
                    run_gpt_oss_experts_grouped_mm)]
    for results in (got, expected, plain):
        results[-1] = results[-1][:96]
    for name, value, truth, unquantized in zip(GPT_OSS_GRADIENTS, got, expected, plain):
        assert _relative(value, truth) < MATCH, name
        if name != "mlp2_bias":
            assert _relative(unquantized, truth) > UNQUANTIZED, name


def test_the_gpt_oss_plan_runs_its_experts_in_the_recipe(world_of_one):
    """The GPT-OSS debug job with quantize.grouped_mm.mx, converted and parallelized as training does (EP = 1): every
    MoE layer computes its experts as the independent reference on groups of the MXFP8 block."""
    from torchtitan.components.quantization import MXFP8_GROUP_ALIGNMENT_SIZE

    layers = planned_experts("gpt_oss_debug_model.toml", "--model.converters", "quantize.grouped_mm.mx",
                             "--quantize.grouped_mm.mx.fqns", "experts", seed=4, scale=0.1)
    assert layers
    generator = torch.Generator().manual_seed(4)
    for experts in layers:
        parameters = list(experts.parameters())
        counts = torch.full((experts.num_experts,), MXFP8_GROUP_ALIGNMENT_SIZE)
        x = torch.randn(int(counts.sum()), parameters[0].shape[-1], generator=generator)
        with torch.no_grad():
            expected = mx_reference.gpt_oss_experts(*parameters, experts.swiglu_limit, x, counts)
            assert _relative(experts(x, counts), expected) < MATCH


def _padded(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group padded to 32 rows: the padded counts, and where each of the unpadded rows lands."""
    padded_counts = (counts + 31) // 32 * 32
    rows = torch.cat([torch.arange(start, start + count) for start, count in
                      zip((torch.cumsum(padded_counts, 0) - padded_counts).tolist(), counts.tolist())])
    return padded_counts, rows


@pytest.mark.parametrize("converter", sorted(REFERENCES))
def test_unpadded_groups_are_computed_as_padded_ones(converter):
    """Without EP nothing pads the groups: torchao pads each to 32 rows for MXFP8 (the float8 emulation scales each
    group as it is), as the reference does with zero rows."""
    generator = torch.Generator().manual_seed(1)
    weights, counts = _weights(generator), torch.tensor([40, 0, 25])
    x, grad = torch.randn(65, 64, generator=generator), torch.randn(65, 64, generator=generator)
    got = _outputs_and_grads(_recipe(converter, pad_groups=True).run_experts, weights, x, counts, grad)
    padded_counts, rows = _padded(counts)

    def padded_reference(w1, w2, w3, x, counts):
        grouped = x.new_zeros(int(padded_counts.sum()), x.shape[1]).index_copy(0, rows, x)
        return REFERENCES[converter].experts(w1, w2, w3, grouped, padded_counts)[rows]

    expected = _outputs_and_grads(padded_reference, weights, x, counts, grad)
    for name, value, truth in zip(("out", "w1", "w2", "w3", "x"), got, expected):
        assert _relative(value, truth) < MATCH, name


@pytest.mark.parametrize("converter", sorted(REFERENCES))
def test_gpt_oss_unpadded_groups_are_computed_as_padded_ones(converter):
    """As above for GPT-OSS's experts. torchao pads each GEMM's input with zero rows; the reference pads the tokens,
    so its second GEMM's padding rows hold the SwiGLU of the first bias instead: their outputs are dropped (no
    gradient flows from them), and they reach no result but the scales of the weight gradient's blocks along the
    tokens, which, powers of two, leave a value's e4m3 rounding unchanged (short of saturation and subnormals)."""
    generator = torch.Generator().manual_seed(5)
    parameters, counts = _gpt_oss_parameters(generator), torch.tensor([40, 0, 25])
    x, grad = torch.randn(65, 64, generator=generator), torch.randn(65, 64, generator=generator)
    got = _outputs_and_grads(_gpt_oss(_recipe(converter, pad_groups=True).run_gpt_oss_experts), parameters, x,
                             counts, grad)
    padded_counts, rows = _padded(counts)

    def padded_reference(*leaves):
        *weights, x, counts = leaves
        grouped = x.new_zeros(int(padded_counts.sum()), x.shape[1]).index_copy(0, rows, x)
        return REFERENCES[converter].gpt_oss_experts(*weights, SWIGLU_LIMIT, grouped, padded_counts)[rows]

    expected = _outputs_and_grads(padded_reference, parameters, x, counts, grad)
    for name, value, truth in zip(GPT_OSS_GRADIENTS, got, expected):
        assert _relative(value, truth) < MATCH, name


FORMS = {
    "swiglu": (("w1", "w2", "w3"), lambda reference, weights, x, counts: reference.experts(*weights, x, counts)),
    "gpt_oss": (("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias"),
                lambda reference, weights, x, counts: reference.gpt_oss_experts(*weights, SWIGLU_LIMIT, x, counts)),
}
"""The experts' forms under EP: their parameters, and how a reference computes them."""


def _ep_inputs() -> dict[str, torch.Tensor]:
    """CASE's tokens, routing and standard experts, and GPT-OSS experts of its sizes."""
    inputs = global_inputs(CASE)
    gpt_oss = _gpt_oss_parameters(torch.Generator().manual_seed(CASE.seed), CASE.num_experts, CASE.hidden, CASE.ffn)
    return inputs | dict(zip(FORMS["gpt_oss"][0], gpt_oss))


def _dense_moe(inputs, form: str, reference) -> dict[str, torch.Tensor]:
    """The MoE on the whole batch with ``reference``'s experts of ``form``: each expert's pairs in ascending token
    order (as every backend lays out an expert's rows), its group padded to 32 rows; scores multiply the expert
    outputs."""
    names, run = FORMS[form]
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("x", "scores", *names)}
    ids = inputs["ids"]
    tokens, picks, counts = [], [], []
    for expert in range(CASE.num_experts):
        token, pick = (ids == expert).nonzero(as_tuple=True)
        tokens.append(token)
        picks.append(pick)
        counts.append(token.numel())
    counts = torch.tensor(counts)
    padded = (counts + 31) // 32 * 32
    starts = (torch.cumsum(padded, 0) - padded).tolist()
    rows = torch.cat([torch.arange(start, start + count) for start, count in zip(starts, counts.tolist())])
    token, pick = torch.cat(tokens), torch.cat(picks)
    grouped = leaves["x"].new_zeros(int(padded.sum()), leaves["x"].shape[1]).index_copy(0, rows, leaves["x"][token])
    results = run(reference, [leaves[name] for name in names], grouped, padded)[rows]
    out = torch.zeros_like(leaves["x"]).index_add(0, token, results * leaves["scores"][token, pick].unsqueeze(1))
    out.backward(inputs["grad_out"])
    return {"out": out.detach(), **{f"grad_{name}": leaf.grad for name, leaf in leaves.items()}}


def _ep_worker(rank: int, ep: int) -> dict:
    from torchtitan_ext.ep.experts import GptOssExperts

    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    inputs = _ep_inputs()
    rows = slice(rank * CASE.tokens_per_rank(ep), (rank + 1) * CASE.tokens_per_rank(ep))
    results = {}
    for form, converter, backend in [(form, converter, backend) for form in FORMS for converter in sorted(REFERENCES)
                                     for backend in EP_BACKENDS]:
        if form == "swiglu":
            experts = UnboundLoopExperts(CASE.hidden, CASE.ffn, CASE.num_experts, use_grouped_mm=False)
        else:
            experts = GptOssExperts(CASE.hidden, CASE.ffn, CASE.num_experts, SWIGLU_LIMIT, use_grouped_mm=False)
        names = FORMS[form][0]
        with torch.no_grad():
            for name in names:
                getattr(experts, name).copy_(inputs[name])
        experts.low_precision = _recipe(converter)
        parallelize_module(experts, mesh, make_style(backend, CASE, ep))
        x = inputs["x"][rows].clone().requires_grad_()
        scores = inputs["scores"][rows].clone().requires_grad_()
        out = experts(x, Routing(scores, inputs["ids"][rows]))
        out.backward(inputs["grad_out"][rows])
        results[form, converter, backend] = {
            "out": out.detach().clone(), "grad_x": x.grad, "grad_scores": scores.grad,
            **{f"grad_{name}": getattr(experts, name).grad.to_local() for name in names}}
    return results


@pytest.mark.slow
def test_the_experts_under_ep_match_the_dense_reference_on_every_backend():
    """EP=2, both recipes, the standard experts and GPT-OSS's: every backend's dispatch pads each expert's group to 32
    rows in ascending (source rank, token) order, so each rank's scaling blocks and groups are the dense
    reference's."""
    ep = 2
    inputs = _ep_inputs()
    truths = {(form, converter): _dense_moe(inputs, form, reference)
              for form in FORMS for converter, reference in REFERENCES.items()}
    local = CASE.local_experts(ep)
    for rank, per_backend in enumerate(run_distributed(ep, _ep_worker)):
        rows = slice(rank * CASE.tokens_per_rank(ep), (rank + 1) * CASE.tokens_per_rank(ep))
        experts = slice(rank * local, (rank + 1) * local)
        for (form, converter, backend), got in per_backend.items():
            truth = truths[form, converter]
            for name in ("out", "grad_x", "grad_scores"):
                assert _relative(got[name], truth[name][rows]) < MATCH, (form, backend, rank, name)
            for name in FORMS[form][0]:
                assert _relative(got[f"grad_{name}"], truth[f"grad_{name}"][experts]) < MATCH, (form, backend, rank,
                                                                                                 name)


@pytest.mark.gpu
@pytest.mark.slow  # torchao's kernels are triton's: its first kernel runs ldconfig, each compile ptxas
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("converter", ["quantize.grouped_mm.mx", "quantize.grouped_mm.float8"])
def test_the_gpu_kernels_quantize_as_the_recipe_says(converter, experts):
    """On a GPU the recipes run torchao's kernels, against the independent references, for the standard experts and
    GPT-OSS's: MXFP8 (sm100) within the CPU's tolerance, float8 (sm90, sm100) within 1% (its GEMMs accumulate in
    fast, lower precision). A GPU outside a recipe's range gets its one-line refusal."""
    from torchtitan_ext.models.converters import RECIPES, recipe_problem

    problem = recipe_problem(RECIPES[converter], "cuda", torch.cuda.get_device_capability())
    if problem:
        pytest.skip(problem)
    generator = torch.Generator().manual_seed(0)
    recipe = LowPrecisionGroupedMM(_torchao_config(converter, "cuda", False), pad_with_torchtitan=False)
    if experts == "swiglu":
        weights, run, reference, names = _weights(generator), recipe.run_experts, REFERENCES[converter].experts, (
            "out", "w1", "w2", "w3", "x")
    else:
        weights, run, reference, names = (_gpt_oss_parameters(generator), _gpt_oss(recipe.run_gpt_oss_experts),
                                          _gpt_oss(REFERENCES[converter].gpt_oss_experts), GPT_OSS_GRADIENTS)
    counts = torch.tensor([64, 0, 32])
    x, grad = torch.randn(96, 64, generator=generator), torch.randn(96, 64, generator=generator)
    cuda = [t.cuda() for t in (*weights, x, grad)]
    got = [t.cpu() for t in _outputs_and_grads(run, cuda[:-2], cuda[-2], counts.cuda(), cuda[-1])]
    expected = _outputs_and_grads(reference, weights, x, counts, grad)
    for name, value, truth in zip(names, got, expected):
        assert _relative(value, truth) < (MATCH if converter.endswith(".mx") else 1e-2), name


def test_mxfp8_linear_layers_match_the_independent_reference():
    """quantize.linear.mx: a linear layer whose dimensions are multiples of 32 computes as one MXFP8 GEMM (a group of
    all its tokens), output and gradients; a layer its filter names, or of other dimensions, stays as it was."""
    from types import SimpleNamespace

    from torchtitan_ext.models.converters import MXLinearConverter

    job_config = SimpleNamespace(model=SimpleNamespace(converters=["quantize.linear.mx"]),
                                 quantize=SimpleNamespace(linear=SimpleNamespace(mx=SimpleNamespace(
                                     filter_fqns=["output"], recipe_name="mxfp8_cublas",
                                     mxfp8_dim1_cast_kernel_choice="triton"))))
    generator = torch.Generator().manual_seed(2)
    model = torch.nn.ModuleDict({"up": torch.nn.Linear(64, 96, bias=False), "odd": torch.nn.Linear(64, 48, bias=False),
                                 "output": torch.nn.Linear(64, 64, bias=False)})
    weights = {name: torch.randn(layer.weight.shape, generator=generator) * 0.1 for name, layer in model.items()}
    with torch.no_grad():
        for name, layer in model.items():
            layer.weight.copy_(weights[name])
    MXLinearConverter(job_config, SimpleNamespace()).convert(model)
    x, grad = torch.randn(64, 64, generator=generator), torch.randn(64, 96, generator=generator)

    def reference(weight, x):
        return mx_reference.MXGroupedMM.apply(x, weight.t().unsqueeze(0), [x.shape[0]], x.dtype)

    leaf = x.clone().requires_grad_()
    out = model["up"](leaf)
    out.backward(grad)
    expected_weight, expected_x = weights["up"].clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(expected_weight, expected_x)
    expected.backward(grad)
    for value, truth in ((out, expected), (leaf.grad, expected_x.grad), (model["up"].weight.grad, expected_weight.grad)):
        assert _relative(value.detach(), truth.detach()) < MATCH
    for name in ("odd", "output"):
        assert torch.equal(model[name](x), x @ weights[name].t()), name
