"""Qwen3-MoE and GPT-OSS train as the other models do: from one seed nccl and ncclep give the same per-step losses
(the gradient matrix holds every backend to the dense model), and so does each with every expert placed on the other
rank, GPT-OSS with replica slots too; a checkpoint written at EP=2 under nccl resumes under deepep and at EP=1 with
the same next losses (torchtitan DCP reshards the experts, GPT-OSS's biases with them). Debug flavours, fp32, 2
ranks."""

import shutil

import pytest

from tests.helpers import REPO_ROOT, run_distributed
from tests.training.cases import TINY, train_worker
from tests.training.test_training_parity import (crossing_placement, PLACED_TOLERANCE, REPLICAS, replicas_took_pairs,
                                                 RESUME, RESUME_TOLERANCE)
from torchtitan_ext.ep.backends import backend_variants
from torchtitan_ext.models.gpt_oss import DEBUG_SMALL
from torchtitan_ext.models.qwen3 import DEBUG_MOE_SMALL

pytestmark = pytest.mark.slow

STEPS = 4
CONFIGS = {"qwen3": "train_configs/qwen3_moe_debug_model.toml", "gpt_oss": "train_configs/gpt_oss_debug_model.toml"}
PARITY_TOLERANCE = 1e-6


def _job(model: str, folder, *extra):
    return ["--job.config_file", str(REPO_ROOT / CONFIGS[model]), "--training.steps", str(STEPS),
            "--job.dump_folder", str(folder), *TINY, *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    runs = []
    for model in CONFIGS:
        runs.append((f"{model}_nccl", _job(model, tmp / f"{model}_nccl", *backend_variants()["nccl"],
                                           "--checkpoint.enable", "--checkpoint.interval", "2")))
        runs.append((f"{model}_ncclep", _job(model, tmp / f"{model}_ncclep", *backend_variants()["ncclep"])))
    runs.append(("gpt_oss_replicas", _job("gpt_oss", tmp / "gpt_oss_replicas", *backend_variants()["nccl"], *REPLICAS)))
    # every layer of both models is MoE
    for model, args in (("qwen3", DEBUG_MOE_SMALL), ("gpt_oss", DEBUG_SMALL)):
        folder = tmp / f"{model}_placement"
        folder.mkdir()
        crossing = crossing_placement(folder, range(args["n_layers"]), args["moe_args"].num_experts)
        runs.append((f"{model}_placed", _job(model, tmp / f"{model}_placed", *backend_variants()["nccl"],
                                             "--expert_placement.file", crossing)))
    return run_distributed(2, train_worker, runs, None, replicas_took_pairs)[0], tmp


def test_backends_agree_from_one_seed(trained):
    losses, _ = trained
    for model in CONFIGS:
        reference = losses[f"{model}_nccl"]
        assert list(reference) == list(range(1, STEPS + 1))
        for step, loss in reference.items():
            assert losses[f"{model}_ncclep"][step] == pytest.approx(loss, rel=PARITY_TOLERANCE), (model, step)


def test_gpt_oss_trains_with_replicas_as_without(trained):
    """2 replica slots per rank, re-chosen every step, that take pairs from the second step on (its experts' biases
    fetched with their weights, their gradients summed at home): the losses of the run without them."""
    losses, _ = trained
    for step, loss in losses["gpt_oss_nccl"].items():
        assert losses["gpt_oss_replicas"][step] == pytest.approx(loss, rel=PLACED_TOLERANCE), step


@pytest.mark.parametrize("model", CONFIGS)
def test_trains_placed_as_unplaced(trained, model):
    """Every expert in a slot of the other rank from the start (its optimizer state, and GPT-OSS's biases, moved with
    its weights): the losses of the unplaced run."""
    losses, _ = trained
    assert list(losses[f"{model}_placed"]) == list(losses[f"{model}_nccl"])
    for step, loss in losses[f"{model}_nccl"].items():
        assert losses[f"{model}_placed"][step] == pytest.approx(loss, rel=PLACED_TOLERANCE), step


def test_checkpoint_resumes_under_another_backend_and_ep_degree(trained, tmp_path):
    losses, tmp = trained
    runs = []
    for model in CONFIGS:
        for name, args in (("deepep_ep2", backend_variants()["deepep"]),
                           ("nccl_ep1", ["--parallelism.expert_parallel_degree", "1"])):
            folder = tmp_path / f"{model}_{name}"
            shutil.copytree(tmp / f"{model}_nccl" / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
            runs.append((f"{model}_{name}", _job(model, folder, *args, *RESUME)))
    resumed = run_distributed(2, train_worker, runs)[0]
    for run, got in resumed.items():
        model = run.rsplit("_", 2)[0]
        assert list(got) == [3, 4], (run, got)
        for step, loss in got.items():
            assert loss == pytest.approx(losses[f"{model}_nccl"][step], rel=RESUME_TOLERANCE), (run, step)
