"""The flagship GB200 recipe (train_configs/deepseek_v3_671b_gb200.toml: HybridEP, MXFP8 experts, full activation
checkpointing) trains on a CPU at debug size, its MXFP8 experts on torchao's emulated kernels: only the size, the
data and what a CPU cannot do (compile, asynchronous checkpoints) are overridden.

It trains in two test workers, as ``python -m torchtitan_ext.train`` does: the launchers' own part for this config
(its pre-flight, the library environment they export) is tests/launch/test_slurm.py's, and a launch on a CPU the
quick start's (tests/training/test_training.py)."""

import pytest

from tests.helpers import run_distributed
from tests.training.cases import console_of_a_run
from torchtitan_ext.records.metrics import logged_losses

AT_DEBUG_SIZE = (
    "--model.flavor", "debugmodel", "--model.hf_assets_path", "./assets/embedded",
    "--training.dataset", "stdlib_code", "--training.local_batch_size", "2", "--training.seq_len", "128",
    "--parallelism.expert_parallel_degree", "2", "--hybridep.ranks_per_nvlink_domain", "2",
    "--lr_scheduler.warmup_steps", "1", "--checkpoint.no-enable", "--compile.no-enable",
)
STEPS = 3


@pytest.mark.slow
def test_the_gb200_recipe_trains_at_debug_size_with_mxfp8_experts(tmp_path):
    console = run_distributed(2, console_of_a_run, [
        "--job.config_file", "train_configs/deepseek_v3_671b_gb200.toml", *AT_DEBUG_SIZE,
        "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)])[0]
    assert any("quantize.grouped_mm.mx: 5 routed experts modules run their grouped GEMMs in MXFP8TrainingOpConfig "
               "(emulated kernels (CPU))" in line for line in console), console
    losses = logged_losses(tmp_path)
    assert list(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], losses
