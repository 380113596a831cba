"""plan --hf-config ... --emit-config writes a job config that run_train.sh runs as written: the model named as
``hf:<config.json>``, read by training itself. For each family the emitted config dry-runs at full size on the
world size it was planned for, then trains a few steps on a CPU at its debug flavour (only the size, the data and
what a CPU cannot do are overridden)."""

import subprocess
import sys

import pytest

from tests.helpers import launcher_env, REPO_ROOT, run_launcher
from torchtitan_ext.records.metrics import logged_losses

FAMILIES = {
    # family: (HF config, the job planned, its world size, topology, debug flavour)
    "qwen3": ("docs/hf_configs/qwen3-30b-a3b.json", "train_configs/qwen3_30b_a3b.toml", 8, "hgx_h100_ib",
              "debugmodel_moe_small"),
    "gpt_oss": ("docs/hf_configs/gpt-oss-120b.json", "train_configs/gpt_oss_120b_gb200.toml", 64, "gb200_nvl72",
                "debugmodel_small"),
}
STEPS = 2


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_emitted_config_dry_runs_and_trains(family, tmp_path):
    hf_config, job, world_size, topology, debug_flavor = FAMILIES[family]
    emitted = tmp_path / "emitted.toml"
    planned = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.plan", "--hf-config", hf_config, "--job.config_file", job,
         "--world-size", str(world_size), "--topology", topology, "--emit-config", str(emitted)],
        cwd=REPO_ROOT, env=launcher_env(), capture_output=True, text=True, timeout=300,
    )
    assert planned.returncode == 0, planned.stderr[-3000:]
    written = emitted.read_text()
    assert f'name = "{family}"' in written and f'flavor = "hf:{hf_config}"' in written

    dry = run_launcher("--job.config_file", str(emitted), timeout=300, COMM_MODE="fake_backend", NGPU=str(world_size))
    assert dry.returncode == 0, dry.output[-3000:]
    assert f"dry run: {family} hf:{hf_config} on {world_size} ranks" in dry.output

    trained = run_launcher(
        "--job.config_file", str(emitted), "--model.flavor", debug_flavor, "--model.hf_assets_path",
        "./assets/embedded", "--training.dataset", "stdlib_code", "--training.local_batch_size", "1",
        "--training.seq_len", "64", "--parallelism.expert_parallel_degree", "2", "--compile.no-enable",
        "--model.converters", "", "--checkpoint.no-enable", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--job.dump_folder", str(tmp_path / "run"), timeout=300,
    )
    assert trained.returncode == 0, trained.output[-3000:]
    assert list(logged_losses(tmp_path / "run")) == list(range(1, STEPS + 1))
