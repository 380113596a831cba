"""Conformance: every backend (and every EP degree) equals a dense single-process MoE.

Random routing with zero-token experts and uneven splits, top_k 1 to 4,
1 to 4 local experts, scores before or after the experts, and a case padded to
32 rows per group. Outputs and gradients of tokens, scores and expert weights
are compared in fp32, at EP = 1, 2 and 4.
"""

import pytest
import torch

from tests.ep.cases import CASES, cases_for, conformance_worker, dense_moe, global_inputs
from torchtitan_ext.ep.backends import CPU_VARIANTS, VARIANTS
from tests.helpers import run_distributed

EP_DEGREES = (1, 2, 4)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def results():
    return {ep: run_distributed(ep, conformance_worker) for ep in EP_DEGREES}


@pytest.fixture(scope="module")
def ground_truth():
    """Dense results per case; "masked" leaves out picks with score exactly 0, which
    DeepEP does not send (so those scores get no gradient there)."""
    truth = {}
    for case in CASES:
        inputs = global_inputs(case)
        truth[case.name] = dense_moe(inputs, case.score_before_experts)
        truth[case.name, "masked"] = dense_moe(inputs, case.score_before_experts, keep=inputs["scores"] != 0)
    return truth


def _skip_if_padding_can_drop(case, backend):
    # Not a dense-MoE case: with padding, capacity 1.0 drops pairs by design, and
    # test_drop_rule compares exactly those runs with the dense MoE over the kept pairs.
    if VARIANTS[backend].may_drop_when_padded and case.pad_multiple > 1:
        pytest.skip("a capacity factor of 1.0 with padding may drop pairs; test_drop_rule covers it")


def _cases_and_degrees():
    return [(case, ep) for ep in EP_DEGREES for case in cases_for(ep)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_VARIANTS)
@pytest.mark.parametrize("case, ep", _cases_and_degrees(), ids=lambda v: v.name if hasattr(v, "name") else f"ep{v}")
def test_matches_dense_moe(results, ground_truth, case, ep, backend):
    _skip_if_padding_can_drop(case, backend)
    truth = ground_truth[case.name, "masked"] if backend.startswith("deepep") else ground_truth[case.name]
    for rank_result in results[ep]:
        got = rank_result[(case.name, backend)]
        rows, experts = got["rows"], got["experts"]
        torch.testing.assert_close(got["out"], truth["out"][rows], **TOLERANCE)
        torch.testing.assert_close(got["grad_x"], truth["grad_x"][rows], **TOLERANCE)
        torch.testing.assert_close(got["grad_scores"], truth["grad_scores"][rows], **TOLERANCE)
        for weight in ("w1", "w2", "w3"):
            torch.testing.assert_close(got[f"grad_{weight}"], truth[f"grad_{weight}"][experts], **TOLERANCE)
        assert got.get("dropped_pairs", 0) == 0


def test_guard_of_the_suites_coverage_cases_span_the_contract():
    """A guard of the suite's own coverage, not of the product: the cases above exercise top_k 1/2/4, 1-4 local
    experts, empty experts, padding and both score modes, so an edit of CASES cannot quietly drop one."""
    assert {case.top_k for case in CASES} >= {1, 2, 4}
    assert {case.num_experts // ep for case, ep in _cases_and_degrees()} >= {1, 2, 3, 4}
    assert {case.score_before_experts for case in CASES} == {True, False}
    assert any(case.pad_multiple == 32 for case in CASES)
    for case in CASES:
        if case.top_k < case.num_experts:
            ids = global_inputs(case)["ids"]
            assert torch.bincount(ids.view(-1), minlength=case.num_experts).eq(0).any(), case.name
    assert any((global_inputs(case)["scores"] == 0).any() for case in CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case, ep", _cases_and_degrees(), ids=lambda v: v.name if hasattr(v, "name") else f"ep{v}")
def test_ncclep_on_its_double_is_the_nccl_backend_bit_for_bit(results, case, ep):
    """The double sums each token's picks as the nccl backend does and NCCL EP's zones pad as nccl's groups, so on a
    CPU the two backends give the same outputs and gradients, bit for bit (what lets a training run on either give
    the same losses over many steps)."""
    for rank_result in results[ep]:
        for variant in ("ncclep", "ncclep_static"):
            got, nccl = rank_result[(case.name, variant)], rank_result[(case.name, "nccl")]
            for key in ("out", "grad_x", "grad_scores", "grad_w1", "grad_w2", "grad_w3"):
                assert torch.equal(got[key], nccl[key]), (variant, key)
