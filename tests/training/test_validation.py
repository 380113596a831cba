"""Validation (``validation.enable``): the loss of the held-out split, as one process computes it, under every
parallelism; training goes on as if it had not run.

DeepSeek-V3's debug model (its small attention, 3 layers) trains 3 steps from one process's checkpoint (torchtitan
seeds each pipeline stage's initialization apart) and validates after each (2 batches of 2 x 32 tokens). Layouts
with one data-parallel rank read the same batches as a single process (EP=1), and their validation losses equal its; with
two, each rank reads its own share, so EP=2 under two backends (a blocking pass, and a non-blocking one with its
capacity) equals FSDP without EP on the same shares. Llama4, Qwen3-MoE (SDPA) and GPT-OSS (FlexAttention, which
takes the masks the trainer builds) validate after a step at EP=2. In every run the experts' load counts are the same after each
validation as before it, and a single process's training losses with validation are those without it. fp32.
"""

import math

import pytest
import torch

from tests.helpers import REPO_ROOT, run_distributed
from tests.training.cases import TINY, train_worker
from torchtitan_ext.ep.backends import backend_variants
from torchtitan_ext.records.metrics import read_metrics, VALIDATION_FILE

pytestmark = pytest.mark.slow

STEPS = 3
"""A validation's expert counts, were they left, would reach the routing bias at the next step's optimizer step,
and the losses from the step after it."""
TOLERANCE = 1e-5
VALIDATION = ["--validation.enable", "--validation.freq", "1", "--validation.steps", "2",
              "--validation.local_batch_size", "2", "--validation.seq_len", "32"]
"""Half the training's dispatch (TINY's 2 x 64 tokens): HybridEP pads it to the size its buffers are made for."""
CONFIGS = {"deepseek_v3": "debug_model.toml", "llama4": "llama4_debug_model.toml",
           "qwen3": "qwen3_moe_debug_model.toml", "gpt_oss": "gpt_oss_debug_model.toml"}
ONE_RANK_PER_BATCH = {
    "tp2_ep2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "1",
            "--parallelism.data_parallel_shard_degree", "1"],
}
"""Layouts whose ranks all read the single process's batches (data-parallel degree 1)."""
EP_UNDER_DP2 = ("nccl", "hybridep_non_blocking")


def _job(folder, model: str = "deepseek_v3", *extra: str, steps: int = STEPS) -> list[str]:
    flavor = ["--model.flavor", "debugmodel_small_3layers"] if model == "deepseek_v3" else []
    return ["--job.config_file", str(REPO_ROOT / "train_configs" / CONFIGS[model]), *flavor,
            "--training.steps", str(steps), "--job.dump_folder", str(folder), *TINY, *extra]


def load_counts_untouched(trainer) -> None:
    """Around each validation: every MoE layer's ``tokens_per_expert`` after it equals before it."""
    validate = trainer.validator.validate if trainer.job_config.validation.enable else None

    def checked(model_parts, step):
        before = {name: buffer.clone() for part in model_parts for name, buffer in part.named_buffers()
                  if name.endswith("tokens_per_expert")}
        validate(model_parts, step)
        after = {name: buffer for part in model_parts for name, buffer in part.named_buffers()
                 if name.endswith("tokens_per_expert")}
        assert before and all(torch.equal(after[name], count) for name, count in before.items()), step

    if validate is not None:
        trainer.validator.validate = checked


def _validation_losses(folder) -> dict[int, float]:
    return {row["step"]: row["validation_metrics/loss"] for row in read_metrics(folder, VALIDATION_FILE)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    one = ["--parallelism.expert_parallel_degree", "1"]
    start = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp / "seed" / "checkpoint" / "step-1")]
    single = [("seed", _job(tmp / "seed", "deepseek_v3", *one, "--checkpoint.enable", steps=1)),
              ("one", _job(tmp / "one", "deepseek_v3", *VALIDATION, *one, *start)),
              ("one_unvalidated", _job(tmp / "one_unvalidated", "deepseek_v3", *one, *start))]
    pairs = [(name, _job(tmp / name, "deepseek_v3", *VALIDATION, *args, *start))
             for name, args in ONE_RANK_PER_BATCH.items()]
    pairs.append(("dp2", _job(tmp / "dp2", "deepseek_v3", *VALIDATION, "--parallelism.expert_parallel_degree", "1",
                              *start)))
    pairs += [(f"dp2_ep2_{variant}", _job(tmp / f"dp2_ep2_{variant}", "deepseek_v3", *VALIDATION,
                                          *backend_variants()[variant], *start)) for variant in EP_UNDER_DP2]
    pairs += [(f"{model}_ep2", _job(tmp / f"{model}_ep2", model, *VALIDATION, *backend_variants()["nccl"], steps=1))
              for model in CONFIGS if model != "deepseek_v3"]
    losses = run_distributed(1, train_worker, single, load_counts_untouched)[0]
    run_distributed(2, train_worker, pairs, load_counts_untouched)
    return losses, {name: _validation_losses(tmp / name) for name, _ in single + pairs}


def test_the_validation_loss_is_the_single_processs_under_every_parallelism(runs):
    _, validated = runs
    reference = validated["one"]
    assert list(reference) == list(range(1, STEPS + 1)) and not validated["one_unvalidated"]
    for layout in ONE_RANK_PER_BATCH:
        assert validated[layout] == pytest.approx(reference, rel=TOLERANCE), layout
    assert list(validated["dp2"]) == list(reference)
    for variant in EP_UNDER_DP2:
        assert validated[f"dp2_ep2_{variant}"] == pytest.approx(validated["dp2"], rel=TOLERANCE), variant


def test_every_model_validates_under_expert_parallelism(runs):
    _, validated = runs
    for model in CONFIGS:
        if model != "deepseek_v3":
            losses = validated[f"{model}_ep2"]
            assert list(losses) == [1] and math.isfinite(losses[1]), model


def test_training_goes_on_as_if_validation_had_not_run(runs):
    losses, _ = runs
    assert losses["one"] == losses["one_unvalidated"]
