"""End-to-end training through run_train.sh: 2 gloo processes, EP=2, loss falls."""

import subprocess
import threading

import pytest

from tests.helpers import REPO_ROOT, launcher_env, run_launcher, step_losses

STEPS = 5
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "64"]


@pytest.mark.parametrize(
    "model, shape", [("deepseek_v3", []), ("llama4", SMALL)], ids=["deepseek_v3_default_job", "llama4_small"]
)
def test_two_process_run_loss_falls(model, shape, tmp_path):
    """The README's quick start (the default job, 5 of its steps), and Llama4 at a small shape."""
    result = run_launcher(
        "--model.name", model,
        "--training.steps", str(STEPS),
        "--metrics.disable_color_printing",
        "--job.dump_folder", str(tmp_path),
        *shape,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    losses = step_losses(result.stdout)
    assert list(losses) == list(range(1, STEPS + 1)), "the steps override must pass through"
    assert losses[STEPS] < losses[1] - 0.5, losses
    step_lines = [line for line in result.stdout.splitlines() if "step:" in line and "loss:" in line]
    assert all("tps:" in line and "step_time:" in line for line in step_lines)
    assert "training on CPU with the gloo backend" in result.stdout
    # the suite runs as on a CPU without bf16 matrix units: the default job must pick fp32
    assert "CPU precision: training.mixed_precision_param = float32 instead of the default bfloat16" in result.stdout


def test_two_runs_share_a_machine(tmp_path):
    results = {}

    def run(name):
        results[name] = subprocess.run(
            ["./run_train.sh", "--model.name", "llama4", "--training.steps", "2", *SMALL,
             "--job.dump_folder", str(tmp_path / name)],
            cwd=REPO_ROOT, env=launcher_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=600,
        )

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results.values():
        assert result.returncode == 0, result.stdout[-3000:]
        assert list(step_losses(result.stdout)) == [1, 2]
