"""The conformance suite against the real kernel libraries (deep_ep, NCCL EP), and the nccl backend on a GPU.

These run only on CUDA machines; elsewhere they are skipped with the reason
(tests/ep/test_deep_ep_double.py runs the same adapters against a double of the
library on every machine). On one GPU every backend runs at EP = 1, DeepEP and
HybridEP on the reference kernels. On a cluster with DeepEP built (main at v2.1 for
the V2 and v1 APIs; V2.5 for EPBuffer; its hybrid-ep branch for HybridEP, one
build at a time):

    ./test.sh -m "deep_ep or gpu" -rs

DeepEP's kernels take bf16 activations, so the comparison with the fp32
dense MoE uses bf16 tolerances; the runs on one GPU stay in fp32.
Every rank's result of every case is compared: outputs, and the gradients of
tokens, scores and expert weights.
"""

import pytest
import torch

from tests.ep.cases import cases_for, conformance_worker, dense_moe, global_inputs
from torchtitan_ext.ep.backends import CPU_VARIANTS, variant_backend, VARIANTS
from tests.helpers import run_distributed
from torchtitan_ext.ep.kernels import deep_ep_unavailable_reason, nccl_ep

BF16_TOLERANCE = dict(rtol=2e-2, atol=2e-2)


def _compare(results, backend, ep, tolerance):
    cases = cases_for(ep)
    assert cases
    for case in cases:
        if VARIANTS[backend].may_drop_when_padded and case.pad_multiple > 1:
            continue  # capacity 1.0 with padding drops pairs by design (tests/ep/test_drop_rule.py)
        inputs = global_inputs(case)
        # DeepEP does not send picks whose score is exactly 0 (torchtitan's masking)
        keep = inputs["scores"] != 0 if backend.startswith("deepep") else None
        truth = dense_moe(inputs, case.score_before_experts, keep=keep)
        for rank_result in results:
            got = rank_result[(case.name, backend)]
            rows, experts = got["rows"], got["experts"]
            torch.testing.assert_close(got["out"], truth["out"][rows], **tolerance)
            torch.testing.assert_close(got["grad_x"], truth["grad_x"][rows], **tolerance)
            torch.testing.assert_close(got["grad_scores"], truth["grad_scores"][rows], **tolerance)
            for weight in ("w1", "w2", "w3"):
                torch.testing.assert_close(got[f"grad_{weight}"], truth[f"grad_{weight}"][experts], **tolerance)


@pytest.mark.deep_ep
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, library, class_name",
    [(name, variant_backend(name), variant.library_class) for name, variant in VARIANTS.items() if variant.library_class],
)
def test_real_library_matches_dense_moe(backend, library, class_name):
    reason = deep_ep_unavailable_reason(library, class_name)
    if reason is None and torch.cuda.device_count() < 2:
        reason = "needs at least 2 GPUs (DeepEP's intranode kernels run on 2, 4 or 8 ranks)"
    if reason:
        # Skipped, not passed: the real kernels only exist on CUDA machines with deep_ep built.
        pytest.skip(f"deep_ep {class_name}: {reason}")
    ep = 4 if torch.cuda.device_count() >= 4 else 2
    results = run_distributed(ep, conformance_worker, (backend,), "deep_ep", "cuda", torch.bfloat16, device="cuda")
    _compare(results, backend, ep, BF16_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_VARIANTS)
def test_every_backend_on_one_gpu(backend):
    """nccl, and the reference kernels standing for DeepEP and HybridEP, on CUDA tensors in a NCCL group of one."""
    if not torch.cuda.is_available():
        # Skipped, not passed: NCCL needs a CUDA device; the CPU suite covers the same code over gloo.
        pytest.skip("no CUDA device")
    results = run_distributed(1, conformance_worker, (backend,), "reference", "cuda", torch.float32, device="cuda")
    _compare(results, backend, 1, dict(rtol=1e-4, atol=1e-4))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", [name for name in VARIANTS if variant_backend(name) == "ncclep"])
def test_real_nccl_ep_matches_dense_moe(backend):
    """The same cases on NCCL EP itself (the nccl-extensions wheel, ``implementation = "nccl_ep"``) over every GPU
    here up to 4 (one GPU: a group of one, which the library may refuse: its own error is then the failure), fp32
    tokens. tests/ep/test_conformance.py runs them on NCCL EP's double on every machine."""
    reason = nccl_ep.unavailable_reason()
    if reason:
        # Skipped, not passed: the real library runs on CUDA with the wheel installed (docs/ncclep.md#installing)
        pytest.skip(f"NCCL EP: {reason}")
    ep = min(1 << (torch.cuda.device_count().bit_length() - 1), 4)
    results = run_distributed(ep, conformance_worker, (backend,), "nccl_ep", "cuda", torch.float32, device="cuda")
    _compare(results, backend, ep, dict(rtol=1e-4, atol=1e-4))
