"""run_train.sh: overrides pass through, bad input fails once with one clear line."""

import os
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import LauncherProcess, REPO_ROOT, run_launcher, step_losses


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    assert lines and lines[-1].startswith("error: "), result.stdout[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    "args, env, expected",
    [
        ((), {"CONFIG_FILE": "train_configs/missing.toml"}, "config file 'train_configs/missing.toml' not found"),
        (("--training.stepz", "3"), {}, "unknown config key 'training.stepz' in the command line: did you mean 'steps'?"),
        ((), {"NGPU": "999"}, "NGPU=999 but this machine"),
        ((), {"NGPU": "two"}, "NGPU='two' is not an integer"),
        (("--parallelism.expert_parallel_degree", "3"), {}, "does not divide the model's 8 experts"),
        (("--job.config_file", "train_configs/llama4_debug_model.toml"), {"CONFIG_FILE": "train_configs/debug_model.toml"},
         "--job.config_file is given twice ('train_configs/debug_model.toml' and 'train_configs/llama4_debug_model.toml')"),
        (("--model.name", "gpt9"), {}, "model.name = 'gpt9' is not a registered model"),
        (("--training.steps", "0"), {}, "training.steps = 0: use a value >= 1"),
    ],
)
def test_bad_input_is_one_line(args, env, expected):
    line = _error_line(run_launcher(*args, timeout=120, **env))
    assert expected in line


def test_unknown_toml_key_names_section_and_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(
        (REPO_ROOT / "train_configs/debug_model.toml").read_text()
        + "\n[hybridep]\nnon_blocking_capacity_facter = 0.5\n"
    )
    line = _error_line(run_launcher(timeout=120, CONFIG_FILE=str(config)))
    assert f"'hybridep.non_blocking_capacity_facter' in {config}" in line
    assert "did you mean 'non_blocking_capacity_factor'?" in line


def test_port_clash_is_reported():
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _error_line(run_launcher(timeout=120, MASTER_PORT=str(port)))
    assert f"port {port} (MASTER_PORT) is in use" in line


def test_fake_backend_is_a_dry_run():
    result = run_launcher(timeout=300, COMM_MODE="fake_backend", NGPU="8", LOG_RANK="0")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dry run: deepseek_v3 debugmodel on 8 ranks" in result.stdout
    assert "mesh: batch=8 loss=8 fsdp=8 ep=2 efsdp=4" in result.stdout
    assert step_losses(result.stdout) == {}


def test_config_file_on_the_command_line_is_the_job():
    """./run_train.sh --job.config_file X runs X, not the default config."""
    result = run_launcher(
        "--job.config_file", "train_configs/llama4_debug_model.toml", timeout=300, COMM_MODE="fake_backend", NGPU="2"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dry run: llama4 debugmodel on 2 ranks" in result.stdout


def test_dry_run_rejects_bad_degrees():
    line = _error_line(run_launcher(
        "--parallelism.tensor_parallel_degree", "3", timeout=120, COMM_MODE="fake_backend", NGPU="8"
    ))
    assert "world size 8 is not a multiple of dp_replicate x cp x tp x pp = 3" in line


def _worker_pids(torchrun_pid: int) -> dict[int, int]:
    """{local rank: pid} of torchrun's worker processes."""
    workers = {}
    for pid in map(int, subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split()):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"LOCAL_RANK="):
                workers[int(entry.split(b"=")[1])] = pid
    return workers


def test_crashed_rank_does_not_leave_others_hanging(tmp_path):
    launcher = LauncherProcess("--training.steps", "500", "--job.dump_folder", str(tmp_path))
    try:
        launcher.wait_for(r"step:\s+2\s", timeout=240)
        workers = _worker_pids(launcher.process.pid)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        returncode = launcher.finish(timeout=90)
        elapsed = time.monotonic() - started
    finally:
        launcher.kill()
    assert returncode != 0
    # well inside comm.train_timeout_seconds (100 s): torchrun tears the job down
    assert elapsed < 60
    assert not any(pid_alive(pid) for pid in workers.values())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
