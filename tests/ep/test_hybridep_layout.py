"""HybridEP layout: the reference's dispatch_with_permute equals the contract, bit for bit.

The i-th global token (g = s * N + t, ascending) routed to local expert e is
row offset_e + i with offset_e = sum_{j<e} roundup(c_j, P); pad rows are zero
with prob 0; tokens_per_expert holds padded counts. Checked with P = 1 and 32.
"""

import pytest
import torch

from tests.ep.cases import Case, contract_layout, dense_routing, global_inputs, hybridep_layout_worker
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow

EP = 2
CASES = {
    pad: Case(f"layout_pad{pad}", num_experts=8, top_k=3, score_before_experts=False, seed=11, pad_multiple=pad)
    for pad in (1, 32)
}


@pytest.fixture(scope="module")
def layouts():
    return {pad: run_distributed(EP, hybridep_layout_worker, case, ()) for pad, case in CASES.items()}


@pytest.mark.parametrize("pad", sorted(CASES))
@pytest.mark.parametrize("rank", range(EP))
def test_layout_is_the_contract(layouts, pad, rank):
    case = CASES[pad]
    got = layouts[pad][rank][None]
    layout, padded_counts, num_rows, _ = contract_layout(case, EP, rank, num_rows=None)
    inputs = global_inputs(case)
    _, probs = dense_routing(inputs["ids"], inputs["scores"], case.num_experts)
    local = case.local_experts(EP)

    assert got["tokens"].shape == (num_rows, case.hidden)
    assert got["tokens_per_expert"].tolist() == padded_counts
    assert all(count % pad == 0 for count in padded_counts)
    expected_tokens = torch.zeros(num_rows, case.hidden)
    expected_probs = torch.zeros(num_rows)
    for row, (token, expert) in layout.items():
        expected_tokens[row] = inputs["x"][token]
        expected_probs[row] = probs[token, rank * local + expert]
    assert torch.equal(got["tokens"], expected_tokens)
    assert torch.equal(got["probs"], expected_probs)
    pad_rows = [row for row in range(num_rows) if row not in layout]
    assert (pad > 1) == bool(pad_rows)
    assert not got["tokens"][pad_rows].any()
    assert got["overflow_flag"] == 0 and got["num_dropped"] == 0
    assert got["regrowths"] == 0


def test_combine_sums_each_tokens_rows(layouts):
    """Rows combined unweighted: with rows = tokens, a token comes back times its pick count."""
    case = CASES[32]
    inputs = global_inputs(case)
    n = case.tokens_per_rank(EP)
    for rank in range(EP):
        got = layouts[32][rank][None]
        picks = inputs["ids"][rank * n : (rank + 1) * n]
        expected = inputs["x"][rank * n : (rank + 1) * n] * picks.shape[1]
        torch.testing.assert_close(got["combined"], expected, rtol=1e-6, atol=1e-6)
        _, probs = dense_routing(picks, inputs["scores"][rank * n : (rank + 1) * n], case.num_experts)
        assert torch.equal(got["combined_probs"], probs)
