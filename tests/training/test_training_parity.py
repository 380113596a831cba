"""Training parity across backends, expert placements, multi-process layouts, and checkpoints.

Same seed, deterministic algorithms, fp32, 2 ranks at EP=2; DeepSeek-V3's debug model with its small attention, cut
to its dense layer and 2 MoE layers ("debugmodel_small_3layers"). Backends: the variants of :data:`PARITY_VARIANTS`
(one per kernel family, on the reference kernels).
One training per job, shared by the tests that read it, and the jobs of one world size in as few sets of processes
as their order allows (the ``parity``, ``from_step_2`` and ``four_processes`` fixtures): each new set of processes
pays its start and its first step's one-time work again:

- 4 steps under every backend with an expert placement that moves every expert to the other rank
  (``[expert_placement] file``) and 2 replica slots per rank re-chosen every step: the first step, before any
  replica is chosen, runs the placement alone, the next three the replicas over it. nccl also runs the placement
  alone, 1 slot re-chosen every 3 steps without it, and the replicated job with its model compiled (where no plan
  change may compile a new graph). Per-step losses agree with nccl's without a placement or replicas within 1e-5
  relative. The placed and unplaced nccl runs export their weights at the last step (model
  only): the placed export holds the experts in logical order. (Llama4's scoring style is the gradient
  matrix's: tests/models/test_gradient_matrix.py.)
- Checkpoints (torchtitan DCP) written by those runs under one backend, EP degree, placement and replication
  resume under another with the same next-step loss: the state has the same keys, DCP reshards the experts and
  the recorded placement tells where each expert is; what differs is only the order of floating-point sums.
"""

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import REPO_ROOT, run_distributed
from tests.training.cases import TINY, train_worker
from torchtitan_ext.ep.backends import backend_variants, MATRIX_VARIANTS

pytestmark = pytest.mark.slow

STEPS = 5
PLACED_STEPS = 4
PLACED_TOLERANCE = 1e-5
CONFIG = str(REPO_ROOT / "train_configs/debug_model.toml")
MOE_LAYERS = [1, 2]
PARITY_VARIANTS = MATRIX_VARIANTS
"""One variant per kernel family: each variant's layer against the dense one is tests/ep/test_conformance.py's."""
BACKENDS = {name: backend_variants()[name] for name in PARITY_VARIANTS}


def _job(tmp, *extra, steps=STEPS):
    return ["--job.config_file", CONFIG, "--model.flavor", "debugmodel_small_3layers", "--training.steps", str(steps),
            "--job.dump_folder", str(tmp), *TINY, *extra]


def _placement(folder: Path, name: str, slots, layers=MOE_LAYERS, num_experts=8) -> str:
    """A placement file for a debug model at EP=2 (by default DeepSeek-V3's, 8 experts, whose MoE layers are
    ``MOE_LAYERS``): ``slots(layer)`` per MoE layer."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({
        "num_experts": num_experts, "expert_parallel_degree": 2,
        "layers": {str(layer): list(slots(layer)) for layer in layers},
    }))
    return str(path)


def crossing_placement(folder: Path, layers=MOE_LAYERS, num_experts=8) -> str:
    """Every expert on the other rank: slot s holds num_experts - 1 - s, the halves rotated by the layer id."""
    half = num_experts // 2
    def slots(layer):
        return [num_experts - 1 - ((s + layer) % half + half * (s // half)) for s in range(num_experts)]

    return _placement(folder, "crossing", slots, layers, num_experts)


CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
"""Checkpoints at steps 2, 4, ... (the tests below resume from step 2), and the last step's model-only export."""
REPLICAS = ["--expert_replication.slots_per_rank", "2", "--expert_replication.adapt_every", "1",
            "--expert_replication.min_gain", "0"]
"""Replicas on every step from the first choice (never set aside), so that parity checks them."""
COMPILED = ["--compile.enable", "--compile.components", "model", "--compile.backend", "aot_eager"]
"""torchtitan's compile of the model (a MoE block's attention, router and shared experts; on a CPU the experts run
without the grouped GEMM it would compile) with dynamo's graphs run by aot_eager: the same operators as eager, so
parity holds at the same tolerance."""


def replicas_took_pairs(trainer) -> None:
    """After each step of a replicated run from the first with a plan (chosen before the step after its window
    closed): some replica computed pairs in it."""
    chooser = trainer.replica_chooser
    if chooser is None or trainer.step < chooser.first_replicated_step:
        return
    taken = sum(int(moe.replicas.last_quotas[:, 1:].sum()) for moe in chooser.layers.values()
                if moe.replicas.last_quotas is not None)
    assert taken > 0, f"step {trainer.step}: the replicas took no pairs"
    if trainer.job_config.compile.enable:
        # the plans change every step: none may compile a graph that the first replicated step did not
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0, "compile.enable compiled nothing"
        if trainer.step == chooser.first_replicated_step:
            trainer.graphs_at_first_plan = graphs
        assert graphs == trainer.graphs_at_first_plan, f"step {trainer.step}: a plan change compiled new graphs"


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """{run: {step: loss}} of every parity run, and their dump folders' parent."""
    tmp = tmp_path_factory.mktemp("parity")
    placement = crossing_placement(tmp)
    job = partial(_job, steps=PLACED_STEPS)
    runs = [("nccl", job(tmp / "nccl", *BACKENDS["nccl"], *CHECKPOINT))]
    runs.append(("placed_nccl", job(tmp / "placed_nccl", *BACKENDS["nccl"], "--expert_placement.file", placement,
                                    *CHECKPOINT)))
    runs += [
        (f"replicated_{name}", job(tmp / f"replicated_{name}", *args, "--expert_placement.file", placement, *REPLICAS,
                                   *(CHECKPOINT if name == "nccl" else [])))
        for name, args in BACKENDS.items()
    ]
    runs.append(("replicated_1_every_3_nccl", job(
        tmp / "replicated_1_every_3", *BACKENDS["nccl"], "--expert_replication.slots_per_rank", "1",
        "--expert_replication.adapt_every", "3", "--expert_replication.min_gain", "0",
    )))
    # last: torchtitan's compile sets dynamo's configuration and patches its grouped GEMM for the process
    runs.append(("compiled_replicated_nccl", job(tmp / "compiled_replicated_nccl", *BACKENDS["nccl"],
                                                 "--expert_placement.file", placement, *REPLICAS, *COMPILED)))
    return run_distributed(2, train_worker, runs, None, replicas_took_pairs)[0], tmp


def test_losses_agree_across_backends_and_placements(parity):
    losses, _ = parity
    reference = losses["nccl"]
    assert list(reference) == list(range(1, PLACED_STEPS + 1))
    assert len(losses) == len(BACKENDS) + 4
    for run, got in losses.items():
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=PLACED_TOLERANCE), (run, step, got, reference)


def test_placed_export_holds_experts_in_logical_order(parity, tmp_path):
    """Every expert row of the placed run's last-step export is its logical expert's: within 5% of the
    unplaced run's same row (training differs only in the order of sums; a router near-tie flipped by that
    moved a layer's experts by ~1e-2 in the 6-layer model), while the physical order would be a different row."""
    _, tmp = parity
    exports = {}
    for run in ("nccl", "placed_nccl"):
        dcp_to_torch_save(str(tmp / run / f"checkpoint/step-{PLACED_STEPS}"), str(tmp_path / f"{run}.pt"))
        exports[run] = torch.load(tmp_path / f"{run}.pt", weights_only=False)
    crossing = json.loads(Path(crossing_placement(tmp_path)).read_text())["layers"]
    keys = [key for key in exports["nccl"] if ".moe.experts." in key]
    assert len(keys) == 3 * len(MOE_LAYERS)
    for key in keys:
        placed, unplaced = exports["placed_nccl"][key], exports["nccl"][key]
        physical = placed[crossing[key.split(".")[1]]]

        def relative(a, b):
            return float((a - b).flatten(1).norm(dim=1).div(b.flatten(1).norm(dim=1)).max())

        assert relative(placed, unplaced) < 0.05, key
        assert relative(physical, unplaced) > 0.5, key


RESUME = ["--checkpoint.enable", "--checkpoint.load_step", "2"]
RESUME_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def from_step_2(parity, tmp_path_factory):
    """The runs that start from the parity runs' step 2, in one set of processes: resumed under other backends, EP
    degree and placement (:func:`test_checkpoint_resumes_under_another_backend_ep_degree_and_placement`), and a
    model-only load of the placed and unplaced checkpoints
    (:func:`test_a_model_only_load_reads_the_recorded_placement`)."""
    _, tmp = parity
    folder = tmp_path_factory.mktemp("from_step_2")
    written = tmp / "replicated_nccl"
    other = _placement(folder, "other", lambda layer: [(3 * s + layer) % 8 for s in range(8)])
    runs = []
    for name, args in (("resumed_hybridep_ep2", [*BACKENDS["hybridep"], "--expert_placement.file", other]),
                       ("resumed_ncclep_ep2", [*BACKENDS["ncclep"], "--expert_placement.file", other]),
                       ("resumed_nccl_ep1", ["--parallelism.expert_parallel_degree", "1"])):
        shutil.copytree(written / "checkpoint" / "step-2", folder / name / "checkpoint" / "step-2")
        runs.append((name, _job(folder / name, *args, *RESUME, steps=PLACED_STEPS)))
    runs += [
        (f"from_{name}", _job(folder / f"from_{name}", "--checkpoint.enable",
                              "--checkpoint.initial_load_path", str(tmp / run / "checkpoint/step-2"), steps=1))
        for name, run in (("placed", "placed_nccl"), ("unplaced", "nccl"))
    ]
    return run_distributed(2, train_worker, runs)[0]


def test_checkpoint_resumes_under_another_backend_ep_degree_and_placement(parity, from_step_2):
    """Step 2 of the parity run written at EP=2 under nccl with the crossing placement and 2 replica slots per
    rank, resumed at EP=2 under hybridep and under ncclep with another placement and no replicas, and at EP=1 (no
    placement: the experts go back to logical order)."""
    losses, tmp = parity
    recorded = FileSystemReader(str(tmp / "replicated_nccl/checkpoint/step-2")).read_metadata().state_dict_metadata
    assert "expert_placement.expert_at_slot" in recorded
    resumed_runs = {name: resumed for name, resumed in from_step_2.items() if name.startswith("resumed_")}
    assert len(resumed_runs) == 3
    for name, resumed in resumed_runs.items():
        assert list(resumed) == list(range(3, PLACED_STEPS + 1)), (name, resumed)
        for step in resumed:
            assert resumed[step] == pytest.approx(losses["replicated_nccl"][step], rel=RESUME_TOLERANCE), (
                name, step, resumed, losses["replicated_nccl"])


def test_a_model_only_load_reads_the_recorded_placement(parity, from_step_2):
    """torchtitan's initial_load_path loads the model only (initial_load_model_only), without the
    placement record: the placed checkpoint's experts were taken as logical order, scrambled (first-step
    losses 4.2e-3 apart in the 6-layer model). A model-only load of the parity runs' step 2, placed and not, gives
    the same first-step loss."""
    losses, tmp = parity
    assert losses["placed_nccl"][2] == pytest.approx(losses["nccl"][2], rel=RESUME_TOLERANCE)
    recorded = FileSystemReader(str(tmp / "placed_nccl/checkpoint/step-2")).read_metadata().state_dict_metadata
    assert "expert_placement.expert_at_slot" in recorded
    assert from_step_2["from_placed"][1] == pytest.approx(from_step_2["from_unplaced"][1], rel=RESUME_TOLERANCE), (
        from_step_2)


def _write_initial_weights(trainer, dump_folders: tuple[str, ...]) -> None:
    """Every parameter whole, before the first step, into the job's dump folder (rank 0; a setup hook, for the jobs
    whose dump folder is named in ``dump_folders``)."""
    from torch.distributed.tensor import DTensor

    folder = Path(trainer.job_config.job.dump_folder)
    if folder.name not in dump_folders:
        return
    weights = {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
               for name, param in trainer.model_parts[0].named_parameters()}
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(weights, folder / "initial_weights.pt")


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """The jobs on 4 ranks, in one set of processes: (each rank's {job: {step: loss}}, ``tmp``, the folder of their
    dump folders).

    - "four_processes": 1 step at EP=2, its initial weights written (:func:`_write_initial_weights`);
    - "fsdp4_ep2": FSDP+EP with the crossing placement, checkpoints every 2 steps; "fsdp4_ep4" resumes its step 2
      at EP=4 under another placement;
    - "pp2_fsdp2_ep2": PP+EP under hybridep, 4 microbatches of one sequence per step (with 2 the 5-step loss curve
      is too noisy to show a clear fall on every corpus: the embedded corpus depends on the Python build's standard
      library).
    """
    tmp = tmp_path_factory.mktemp("four_processes")
    folder = tmp / "fsdp"
    ep4_placement = tmp / "ep4.json"
    ep4_placement.write_text(json.dumps({
        "num_experts": 8, "expert_parallel_degree": 4,
        "layers": {str(layer): [(5 * s + layer) % 8 for s in range(8)] for layer in MOE_LAYERS},
    }))
    pipeline_args = [
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--training.local_batch_size", "4",
    ]
    runs = [
        ("four_processes", _job(tmp / "four_processes", steps=1)),
        ("fsdp4_ep2", _job(folder, *CHECKPOINT, "--expert_placement.file", crossing_placement(tmp))),
        ("fsdp4_ep4", _job(folder, "--parallelism.expert_parallel_degree", "4", *RESUME,
                           "--expert_placement.file", str(ep4_placement))),
        ("pp2_fsdp2_ep2", _job(tmp / "pp", *pipeline_args, "--parallelism.expert_parallel_comm_backend", "hybridep")),
    ]
    write_weights = partial(_write_initial_weights, dump_folders=("four_processes",))
    return run_distributed(4, train_worker, runs, write_weights), tmp


def test_a_sharded_job_starts_from_one_process_weights(four_processes, tmp_path):
    """At EP=2 on 4 ranks (FSDP shards every parameter over 4 ranks, the experts over 2 within each EP rank's
    share) the job's initial weights are the one-process job's, bit for bit: on a CPU, where DTensor would fill
    every rank's shard from the same seed (evenly sharded parameters starting as copies of one shard), each rank
    draws the whole tensor and keeps its shard."""
    _, tmp = four_processes
    one = tmp_path / "one_process"
    run_distributed(1, train_worker, [("one", _job(one, "--parallelism.expert_parallel_degree", "1", steps=1))],
                    partial(_write_initial_weights, dump_folders=(one.name,)))
    expected, got = (torch.load(folder / "initial_weights.pt") for folder in (one, tmp / "four_processes"))
    assert got.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


def test_four_process_fsdp_ep_and_pipeline_ep(four_processes):
    """FSDP+EP on 4 ranks: a checkpoint written at EP=2 x expert FSDP 2 under a placement resumes at EP=4
    under another, with the same losses; and PP+EP (:func:`four_processes`), whose gradients against a dense model
    are the gradient matrix's ep2_pp2_fsdp2 cells."""
    results, _ = four_processes
    written, resumed = results[0]["fsdp4_ep2"], results[0]["fsdp4_ep4"]
    assert list(written) == list(range(1, STEPS + 1)) and written[STEPS] < written[1] - 0.3
    assert list(resumed) == [3, 4, 5]
    for step in resumed:
        assert resumed[step] == pytest.approx(written[step], rel=RESUME_TOLERANCE), (step, resumed, written)
    # with PP the loss lives on the last stage's first rank: (world / pp) * (pp - 1) = 2
    pipeline = results[2]["pp2_fsdp2_ep2"]
    assert list(pipeline) == list(range(1, STEPS + 1)) and pipeline[STEPS] < pipeline[1] - 0.3, pipeline
