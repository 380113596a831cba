"""End-to-end training through run_train.sh: the README's quick start trains, as a user sees it."""

import threading

import pytest

from tests.helpers import run_launcher
from torchtitan_ext.records.metrics import logged_losses

STEPS = 2
TINY = ["--model.flavor", "debugmodel_small", "--training.local_batch_size", "2", "--training.seq_len", "64",
        "--training.steps", "1", "--parallelism.expert_parallel_degree", "1"]
"""One step on one process: a rendezvous of its own is all it needs to show."""


@pytest.mark.slow
def test_quick_start_trains_beside_another_job(tmp_path):
    """The default job (2 of its steps) beside a one-step tiny job, at once on one machine: each picks a free
    rendezvous port. The default job's overrides pass through, its loss falls and its console is as documented."""
    results = {}
    jobs = {"quick_start": (["--training.steps", str(STEPS)], "2"), "beside": (TINY, "1")}

    def run(name: str) -> None:
        overrides, processes = jobs[name]
        results[name] = run_launcher(
            "--metrics.disable_color_printing", "--job.dump_folder", str(tmp_path / name), *overrides, timeout=600,
            NGPU=processes,
        )

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # the output's end in full (the assertion's own repr would cut it to a few lines)
    failed = {name: result.output[-4000:] for name, result in results.items() if result.returncode != 0}
    assert not failed, "\n".join(f"{name} failed; its output ends:\n{output}" for name, output in failed.items())
    assert list(logged_losses(tmp_path / "beside")) == [1]
    losses = logged_losses(tmp_path / "quick_start")
    assert list(losses) == list(range(1, STEPS + 1)), "the steps override must pass through"
    assert losses[STEPS] < losses[1] - 0.3, losses
    output = results["quick_start"].output
    step_lines = [line for line in output.splitlines() if "step:" in line and "loss:" in line]
    assert len(step_lines) == STEPS and all("step_time:" in line and len(line) < 120 for line in step_lines), step_lines
    assert "training on CPU with the gloo backend" in output
    # a fresh run warns only about the job: here the 2 steps that cut the LR schedule's warm-up and decay
    warnings = [line for line in output.splitlines() if " WARNING " in line]
    assert warnings and all("steps" in line and "exceed total steps" in line for line in warnings), warnings
    assert "Starting job: deepseek_v3 debugmodel, nccl EP=2, 2 ranks (train_configs/debug_model.toml)" in output
    # the suite runs as on a CPU without bf16 matrix units: the default job must pick fp32
    assert "CPU precision: training.mixed_precision_param = float32 instead of the default bfloat16" in output


def test_the_banner_follows_the_overrides(monkeypatch):
    """torchtitan's "Starting job:" line shows job.description, which overrides make stale: ours names the
    model, backend and ranks the job runs with."""
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.training.trainer import job_banner

    monkeypatch.setenv("WORLD_SIZE", "2")
    job_config = load_job_config(["--job.config_file", "train_configs/debug_model.toml", "--model.name", "llama4",
                                  "--parallelism.expert_parallel_comm_backend", "hybridep"], "cpu", 2)
    assert job_banner(job_config) == "llama4 debugmodel, hybridep EP=2, 2 ranks (train_configs/debug_model.toml)"
