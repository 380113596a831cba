"""Drop rule of non-blocking HybridEP.

- With enough capacity, non-blocking equals blocking bit for bit.
- With too little, exactly the contract's tail pairs are dropped: the overflow
  flag is set, the reported count equals the dropped pairs, and the output and
  gradients equal a dense MoE over the kept pairs only.
- Capacity factor 1.0 still drops when padding needs more rows (the
  contract's example: R=2, N=48, L=2, K=1, P=32, a 49/47 split).
"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_ext.ep.backends import CPU_VARIANTS
from tests.ep.cases import Case, contract_layout, dense_moe, global_inputs, hybridep_layout_worker, run_backend
from tests.helpers import run_distributed
from torchtitan_ext.ep.hybridep import non_blocking_rows

pytestmark = pytest.mark.slow

EP = 2
SUFFICIENT = Case("drop_sufficient", num_experts=8, top_k=2, score_before_experts=False, seed=21)
TOO_SMALL = Case("drop_too_small", num_experts=8, top_k=2, score_before_experts=True, seed=22)
TOO_SMALL_FACTOR = 0.3
PADDING = Case(
    "contract_example", num_experts=4, top_k=1, score_before_experts=False, seed=23,
    total_tokens=96, pad_multiple=32, routing="contract_example",
)


def _modes_worker(rank, ep, case, factors):
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    results = {"blocking": run_backend(rank, ep, case, "hybridep", mesh)}
    for factor in factors:
        results[factor] = run_backend(rank, ep, case, "hybridep", mesh, capacity_factor=factor)
    return results


@pytest.fixture(scope="module")
def library_level():
    return {
        case.name: run_distributed(EP, hybridep_layout_worker, case, factors)
        for case, factors in ((SUFFICIENT, (1.0,)), (TOO_SMALL, (TOO_SMALL_FACTOR,)), (PADDING, (1.0,)))
    }


@pytest.fixture(scope="module")
def backend_level():
    return {
        case.name: run_distributed(EP, _modes_worker, case, factors)
        for case, factors in ((SUFFICIENT, (1.0,)), (TOO_SMALL, (TOO_SMALL_FACTOR,)), (PADDING, (1.0,)))
    }


def test_sufficient_capacity_equals_blocking_bitwise(library_level, backend_level):
    for rank in range(EP):
        blocking, non_blocking = (library_level[SUFFICIENT.name][rank][f] for f in (None, 1.0))
        rows = blocking["tokens"].shape[0]
        assert non_blocking["tokens"].shape[0] >= rows
        assert torch.equal(non_blocking["tokens"][:rows], blocking["tokens"])
        assert torch.equal(non_blocking["probs"][:rows], blocking["probs"])
        assert torch.equal(non_blocking["tokens_per_expert"], blocking["tokens_per_expert"])
        assert torch.equal(non_blocking["combined"], blocking["combined"])
        assert non_blocking["overflow_flag"] == 0 and non_blocking["num_dropped"] == 0

        backend = backend_level[SUFFICIENT.name][rank]
        for key in ("out", "grad_x", "grad_scores", "grad_w1", "grad_w2", "grad_w3"):
            assert torch.equal(backend[1.0][key], backend["blocking"][key]), key


def _expected_drops(case, factor, rank):
    num_rows = non_blocking_rows(
        case.tokens_per_rank(EP), EP, case.local_experts(EP), case.top_k, factor, case.pad_multiple
    )
    layout, truncated, _, kept = contract_layout(case, EP, rank, num_rows)
    _, _, _, all_pairs = contract_layout(case, EP, rank, None)
    return num_rows, layout, truncated, kept, len(all_pairs) - len(kept)


@pytest.mark.parametrize("case, factor", [(TOO_SMALL, TOO_SMALL_FACTOR), (PADDING, 1.0)], ids=["too_small", "padding"])
def test_exactly_the_tail_pairs_are_dropped(library_level, case, factor):
    inputs = global_inputs(case)
    total_dropped = 0
    for rank in range(EP):
        got = library_level[case.name][rank][factor]
        num_rows, layout, truncated, kept, dropped = _expected_drops(case, factor, rank)
        assert got["tokens"].shape[0] == num_rows
        assert got["tokens_per_expert"].tolist() == truncated
        for row, (token, _) in layout.items():
            assert torch.equal(got["tokens"][row], inputs["x"][token])
        assert got["num_dropped"] == dropped
        assert got["overflow_flag"] == int(dropped > 0)
        total_dropped += dropped
    assert total_dropped > 0


def test_padding_drops_at_capacity_factor_one(library_level):
    """The contract's example: M = 96 rows, but 49/47 tokens pad to 64 + 64 = 128."""
    num_rows, _, truncated, _, dropped = _expected_drops(PADDING, 1.0, rank=0)
    assert num_rows == 96 and truncated == [64, 32] and dropped == 47 - 32
    got = library_level[PADDING.name][0][1.0]
    assert got["overflow_flag"] == 1 and got["num_dropped"] == 15


def _kept_picks(case, factor):
    """[T, K] mask of the picks the contract keeps, over all ranks."""
    inputs = global_inputs(case)
    keep = torch.zeros_like(inputs["ids"], dtype=torch.bool)
    local = case.local_experts(EP)
    for rank in range(EP):
        for token, expert in _expected_drops(case, factor, rank)[3]:
            keep[token] |= inputs["ids"][token] == rank * local + expert
    return keep


@pytest.mark.parametrize("case, factor", [(TOO_SMALL, TOO_SMALL_FACTOR), (PADDING, 1.0)], ids=["too_small", "padding"])
def test_dropped_pairs_contribute_nothing(backend_level, case, factor):
    truth = dense_moe(global_inputs(case), case.score_before_experts, keep=_kept_picks(case, factor))
    for rank in range(EP):
        got = backend_level[case.name][rank][factor]
        rows, experts = got["rows"], got["experts"]
        torch.testing.assert_close(got["out"], truth["out"][rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad_x"], truth["grad_x"][rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad_scores"], truth["grad_scores"][rows], rtol=1e-5, atol=1e-5)
        for weight in ("w1", "w2", "w3"):
            torch.testing.assert_close(got[f"grad_{weight}"], truth[f"grad_{weight}"][experts], rtol=1e-5, atol=1e-5)
        assert got["dropped_pairs"] == _expected_drops(case, factor, rank)[4]


SKEWED = Case(
    "all_to_one", num_experts=8, top_k=2, score_before_experts=False, seed=24,
    total_tokens=2048, hidden=256, ffn=64, routing="all_to_one",
)
"""The debug model's sizes (1024 tokens per rank, hidden 256, 8 experts, top 2), every token to experts 0 and 1."""
SKEWED_FACTOR = 0.25


def _skewed_worker(rank, ep, case):
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    results = {backend: run_backend(rank, ep, case, backend, mesh)
               for backend in CPU_VARIANTS}
    results["drops"] = run_backend(rank, ep, case, "hybridep", mesh, capacity_factor=SKEWED_FACTOR)
    return results


def test_all_tokens_to_one_expert():
    """The most skewed routing at the debug size: every blocking backend (and non-blocking at 1.0)
    equals the dense MoE; non-blocking at 0.25 drops exactly the contract's tail pairs and counts them."""
    results = run_distributed(EP, _skewed_worker, SKEWED)
    truth = dense_moe(global_inputs(SKEWED), SKEWED.score_before_experts)
    kept_truth = dense_moe(global_inputs(SKEWED), SKEWED.score_before_experts, keep=_kept_picks(SKEWED, SKEWED_FACTOR))
    def close(got, expected, key):
        # 2048 tokens summed into the same experts: compare in norm (elementwise sums cancel near zero)
        if expected.norm() == 0:  # e.g. rank 1's tokens, all dropped, or its idle experts
            assert not got.any(), key
            return
        error = float((got - expected).norm() / expected.norm())
        assert error < 1e-5, (key, error)

    total_dropped = 0
    for rank, rank_results in enumerate(results):
        for backend in CPU_VARIANTS:
            got = rank_results[backend]
            rows, experts = got["rows"], got["experts"]
            close(got["out"], truth["out"][rows], (backend, "out"))
            close(got["grad_x"], truth["grad_x"][rows], (backend, "grad_x"))
            for weight in ("w1", "w2", "w3"):
                close(got[f"grad_{weight}"], truth[f"grad_{weight}"][experts], (backend, weight))
            assert got.get("dropped_pairs", 0) == 0
        dropped = rank_results["drops"]
        close(dropped["out"], kept_truth["out"][dropped["rows"]], "dropped out")
        expected = _expected_drops(SKEWED, SKEWED_FACTOR, rank)[4]
        assert dropped["dropped_pairs"] == expected
        total_dropped += expected
    # rank 0 holds experts 0 and 1: 2 x 2048 pairs for 1024 rows
    assert total_dropped == 2 * 2048 - 1024
