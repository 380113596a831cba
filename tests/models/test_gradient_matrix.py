"""Training parity: gradients under every parallelism equal a dense single-process MoE model.

For every EP backend (nccl, deepep, hybridep blocking, hybridep non-blocking at
a factor that cannot drop) and both scoring styles (DeepSeek-V3: scores after
the experts; Llama4: before), a tiny model's loss, every parameter's gradient
(router gate, routed and shared experts, attention, embeddings: the inputs'
gradients flow into all of them) and the gradient norm before clipping equal
those of one process computing the whole batch densely, under: EP with FSDP
(fp32 and bf16 mixed precision), EP borrowing TP (batch 1 and 2), expert TP,
TP alone, EP with PP, every activation-checkpointing mode, the grouped-GEMM
expert path, uneven tokens per rank and a rank whose experts receive nothing;
and with expert replication (1 and 2 replica slots per rank, every backend;
2 slots with nccl under bf16, EP borrowing TP, each checkpointing mode, the
grouped GEMM and PP, and after a plan change: a first pass under other
replicas, then the checked one), where the replicas must take some of the pairs.
The gradient norm at DP=2 equals the single process's (DP=1) on the same
global batch: gloo's sum-only FSDP reduction keeps the gradient's scale.

Tolerances: fp32, 1e-5 relative per tensor. Where bf16 computes (mixed
precision, the grouped GEMM), a gradient's error against fp32 may be at most
twice that of the same model computed in bf16 on one process, or one bf16
rounding (2^-8 relative) if that is larger; loss and gradient norm within one
bf16 rounding; and the scores every backend receives must still be fp32.

Where TP shards the gradients, torchtitan's clipping scales every gradient,
TP-sharded, expert-sharded or replicated, by the coefficient the dense
model's norm gives (max_norm / (norm + 1e-6)), within the same tolerances.

A control re-introduces an old defect (EP borrowing TP without gathering the
split tokens' gradients) and must fail the comparison.
"""

import pytest

from tests.models.gradient_cases import CLIP_MAX_NORM, cells, full_gradients, matrix_worker
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow

FP32_TOLERANCE = 1e-5
BF16_NOISE_FACTOR = 2.0
BF16_ROUNDING = 2.0**-8
"""One bf16 rounding, relative: the least any bf16 result may differ from fp32."""
CELLS = [cell for cell in cells() if cell.mutant is None]
CONTROLS = [cell for cell in cells() if cell.mutant is not None]
TP_CELLS = [cell for cell in CELLS if "--parallelism.tensor_parallel_degree" in cell.overrides]


@pytest.fixture(scope="module")
def results():
    by_world = {}
    for world_size in sorted({cell.world_size for cell in cells()}):
        group = [cell for cell in cells() if cell.world_size == world_size]
        by_world[world_size] = run_distributed(world_size, matrix_worker, group, deadline_s=400)
    return by_world


def _gathered(results, cell):
    """(loss, {name: gradient} over all ranks, gradient norm, reference, bf16 reference or None, scores' dtypes)."""
    ranks = [rank_results[cell.id] for rank_results in results[cell.world_size]]
    grads = full_gradients([rank["grads"] for rank in ranks])
    losses = {rank["loss"] for rank in ranks if "loss" in rank}
    dtypes = {dtype for rank in ranks for dtype in rank["score_dtypes"]}
    return losses, grads, ranks[0]["grad_norm"], ranks[0]["reference"], ranks[0].get("reference_bf16"), dtypes


def _errors(cell, grads, reference, reference_bf16) -> dict[str, tuple[float, float]]:
    """{parameter: (error, allowed)} in the Frobenius norm."""
    errors = {}
    for name, truth in reference["grads"].items():
        allowed = FP32_TOLERANCE * float(truth.norm()) + 1e-12
        if reference_bf16 is not None:
            noise = float((reference_bf16["grads"][name] - truth).norm())
            allowed += max(BF16_NOISE_FACTOR * noise, BF16_ROUNDING * float(truth.norm()))
        errors[name] = (float((grads[name] - truth).norm()), allowed)
    return errors


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.id)
def test_gradients_equal_dense_single_process(results, cell, record_property):
    losses, grads, grad_norm, reference, reference_bf16, dtypes = _gathered(results, cell)
    assert set(grads) == set(reference["grads"]), "every parameter has a gradient"
    errors = _errors(cell, grads, reference, reference_bf16)
    name, (error, allowed) = max(errors.items(), key=lambda item: item[1][0] / item[1][1])
    relative = error / float(reference["grads"][name].norm())
    record_property(
        "measured", f"worst gradient: {name}, relative error {relative:.2e} ({error / allowed:.2f} of the allowed)"
    )
    failed = {name: error for name, error in errors.items() if error[0] > error[1]}
    assert not failed, failed
    tolerance = FP32_TOLERANCE + (BF16_ROUNDING if reference_bf16 is not None else 0.0)
    assert len(losses) == 1 and losses.pop() == pytest.approx(reference["loss"], rel=tolerance)
    # torchtitan's grad_norm before clipping, at this cell's DP degree against DP=1
    assert grad_norm == pytest.approx(reference["grad_norm"], rel=tolerance)
    if cell.backend is not None:
        assert dtypes == {"torch.float32"}, "routing scores reach the backend in fp32"
    if cell.replicas:
        replica_pairs = sum(rank_results[cell.id]["replica_pairs"] for rank_results in results[cell.world_size])
        assert replica_pairs > 0, "the replicas must compute some pairs for the cell to check them"


@pytest.mark.parametrize("cell", TP_CELLS, ids=lambda cell: cell.id)
def test_tp_sharded_gradients_clip_as_dense(results, cell):
    ranks = [rank_results[cell.id] for rank_results in results[cell.world_size]]
    clipped = full_gradients([rank["clipped_grads"] for rank in ranks])
    reference = ranks[0]["reference"]
    assert reference["grad_norm"] > 100 * CLIP_MAX_NORM, "the clipping must scale"
    coefficient = CLIP_MAX_NORM / (reference["grad_norm"] + 1e-6)
    scaled = [None if ref is None else {"grads": {name: grad * coefficient for name, grad in ref["grads"].items()}}
              for ref in (reference, ranks[0].get("reference_bf16"))]
    errors = _errors(cell, clipped, *scaled)
    failed = {name: error for name, error in errors.items() if error[0] > error[1]}
    assert not failed, failed


@pytest.mark.parametrize("cell", CONTROLS, ids=lambda cell: cell.id)
def test_reintroduced_defect_is_caught(results, cell):
    _, grads, _, reference, reference_bf16, _ = _gathered(results, cell)
    errors = _errors(cell, grads, reference, reference_bf16)
    worst = max(error / allowed for error, allowed in errors.values())
    assert worst > 100, f"the matrix must fail with {cell.mutant}; worst error / allowed = {worst:.1f}"
