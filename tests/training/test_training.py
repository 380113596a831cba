"""End-to-end training through run_train.sh: 2 gloo processes, EP=2, loss falls."""

import threading

from tests.helpers import run_launcher, step_losses

STEPS = 5
SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "64"]
JOBS = {"deepseek_v3": [], "llama4": SMALL}


def test_two_jobs_share_a_machine_and_their_losses_fall(tmp_path):
    """The README's quick start (the default job, 5 of its steps) and Llama4 at a small shape, at once on
    one machine: each picks a free rendezvous port, and each trains."""
    results = {}

    def run(model: str) -> None:
        results[model] = run_launcher(
            "--model.name", model,
            "--training.steps", str(STEPS),
            "--metrics.disable_color_printing",
            "--job.dump_folder", str(tmp_path / model),
            *JOBS[model],
            timeout=600,
        )

    threads = [threading.Thread(target=run, args=(model,)) for model in JOBS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(JOBS)
    for model, result in results.items():
        assert result.returncode == 0, (model, result.stdout[-4000:])
        losses = step_losses(result.stdout)
        assert list(losses) == list(range(1, STEPS + 1)), "the steps override must pass through"
        assert losses[STEPS] < losses[1] - 0.5, (model, losses)
        step_lines = [line for line in result.stdout.splitlines() if "step:" in line and "loss:" in line]
        assert all("step_time:" in line and len(line) < 120 for line in step_lines), step_lines
        assert "training on CPU with the gloo backend" in result.stdout
        # a fresh run warns only about the job: here the 5 steps that cut the LR schedule's warm-up and decay
        warnings = [line for line in result.stdout.splitlines() if " WARNING " in line]
        assert warnings and all("steps" in line and "exceed total steps" in line for line in warnings), warnings
        # the banner follows the overrides: model.name on the command line, not the config's description
        assert f"Starting job: {model} {'debugmodel'}, nccl EP=2, 2 ranks (train_configs/debug_model.toml)" in result.stdout
        # the suite runs as on a CPU without bf16 matrix units: the default job must pick fp32
        assert "CPU precision: training.mixed_precision_param = float32 instead of the default bfloat16" in result.stdout
