"""End-to-end training through run_train.sh: the README's quick start trains, as a user sees it."""

import errno
import socket

import pytest

from tests.helpers import run_launcher
from torchtitan_ext.records.metrics import logged_losses

STEPS = 2
DEFAULT_PORTS = (29500, 29400)
"""torchrun's default rendezvous port, and that of its c10d rendezvous without a port."""


@pytest.mark.slow
def test_quick_start_trains_beside_another_job(tmp_path):
    """The default job (2 of its steps) while another process listens on torchrun's default rendezvous ports, as
    a job started before it would: it picks a free port, so jobs share a machine. The default job's overrides pass
    through, its loss falls and its console is as documented."""
    other_job = []
    try:
        for port in DEFAULT_PORTS:
            listener = socket.socket()
            other_job.append(listener)
            # a connection closed lately (TIME_WAIT) does not hold a port; a listener does, as here
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("", port))
                listener.listen()
            except OSError as error:  # another process listens there already, as the test needs
                assert error.errno == errno.EADDRINUSE, error
        result = run_launcher("--metrics.disable_color_printing", "--job.dump_folder", str(tmp_path),
                              "--training.steps", str(STEPS), timeout=600)
    finally:
        for listener in other_job:
            listener.close()
    # the output's end in full (the assertion's own repr would cut it to a few lines)
    assert result.returncode == 0, f"the job failed; its output ends:\n{result.output[-4000:]}"
    losses = logged_losses(tmp_path)
    assert list(losses) == list(range(1, STEPS + 1)), "the steps override must pass through"
    assert losses[STEPS] < losses[1] - 0.3, losses
    output = result.output
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
