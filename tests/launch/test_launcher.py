"""run_train.sh: overrides pass through, bad input fails once with one clear line."""

import socket
import subprocess

import pytest

from tests.helpers import launcher_env, REPO_ROOT, run_launcher
from torchtitan_ext.launch.supervisor import Supervisor
from torchtitan_ext.metrics_file import MetricsFile, read_metrics


DEFAULT_CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    assert lines and lines[-1].startswith("error: "), result.stdout[-3000:]
    return lines[-1]


def _check_error(capsys, main, argv: list[str]) -> str:
    """The one line a launcher check (``python -m torchtitan_ext.launch.preflight`` or ``.planning.dry_run``, as
    run_train.sh calls them) prints for bad input, run in this process: exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), lines
    return lines[-1]


@pytest.mark.slow
def test_a_bad_config_stops_the_launcher_in_one_line():
    """End to end, the README's example: the config validation's line, before any process starts."""
    line = _error_line(run_launcher("--training.stepz", "3", timeout=120))
    assert line == "error: unknown config key 'training.stepz' in the command line: did you mean 'steps'?"


@pytest.mark.slow
def test_launcher_passes_ngpu_to_its_checks():
    line = _error_line(run_launcher(timeout=120, NGPU="two"))
    assert "NGPU='two' is not an integer" in line


@pytest.mark.slow
def test_config_file_given_twice_is_one_line():
    """run_train.sh passes CONFIG_FILE and the user's --job.config_file; both at once is refused."""
    line = _error_line(run_launcher(
        "--job.config_file", "train_configs/llama4_debug_model.toml", timeout=120, CONFIG_FILE="train_configs/debug_model.toml",
    ))
    assert (
        "--job.config_file is given twice ('train_configs/debug_model.toml' and 'train_configs/llama4_debug_model.toml')"
        in line
    )


@pytest.mark.slow
def test_port_clash_is_reported():
    with socket.socket() as busy:
        busy.bind(("localhost", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _error_line(run_launcher(timeout=120, MASTER_PORT=str(port)))
    assert f"port {port} (MASTER_PORT) is in use" in line


@pytest.mark.slow
def test_fake_backend_is_a_dry_run(tmp_path):
    result = run_launcher("--job.dump_folder", str(tmp_path), timeout=300, COMM_MODE="fake_backend", NGPU="8",
                          LOG_RANK="0")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dry run: deepseek_v3 debugmodel on 8 ranks" in result.stdout
    assert "mesh: batch=8 loss=8 fsdp=8 ep=2 efsdp=4" in result.stdout
    assert read_metrics(tmp_path) == [], "a dry run trains no step"


@pytest.mark.slow
def test_config_file_on_the_command_line_is_the_job():
    """./run_train.sh --job.config_file X runs X, not the default config."""
    result = run_launcher(
        "--job.config_file", "train_configs/llama4_debug_model.toml", timeout=300, COMM_MODE="fake_backend", NGPU="2"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dry run: llama4 debugmodel on 2 ranks" in result.stdout


def test_dry_run_rejects_bad_degrees(capsys):
    from torchtitan_ext.planning import dry_run

    line = _check_error(
        capsys, dry_run.main, ["--world-size", "8", "--", *DEFAULT_CONFIG, "--parallelism.tensor_parallel_degree", "3"]
    )
    assert "world size 8 is not a multiple of dp_replicate x cp x tp x pp = 3" in line


TORCHRUN_REPORT = """\
============================================================
torchtitan_ext.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_10:00:03
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4321)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4321
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_10:00:02
  host      : node
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4320)
  error_file: /tmp/error.json
  traceback : RuntimeError: Connection closed by peer
============================================================
"""


@pytest.mark.parametrize(
    "report, named",
    [
        (TORCHRUN_REPORT, "rank 1 (pid 4321) was killed by SIGKILL"),
        (
            "W1122 10:00:33 api.py:1029] Sending process 4321 closing signal SIGTERM\n" + TORCHRUN_REPORT,
            "rank 0 (pid 4320) exited with status 1",
        ),
    ],
    ids=["signal_before_status", "torchrun_stop_not_a_cause"],
)
def test_supervisor_names_the_rank_that_caused_the_failure(report, named, tmp_path):
    """torchrun observes a SIGKILLed rank's failure after its peer's status-1 exit; the signal is the cause. The
    last step is the job's metrics.jsonl's."""
    MetricsFile(tmp_path).write(3, {"loss_metrics/global_avg_loss": 7.5})
    supervisor = Supervisor([], checkpoint_folder=None, dump_folder=tmp_path)
    for line in report.splitlines():
        supervisor._read(line)
    assert supervisor.explain(1) == (
        f"error: {named}; the job stopped after step 3 (exit 1); "
        "checkpointing is off (checkpoint.enable): a rerun starts over"
    )


@pytest.mark.slow
def test_ngpu_counts_gpus_not_mig_instances(tmp_path):
    """nvidia-smi -L lists each MIG instance under its GPU; `wc -l` counted them as GPUs. A job that needs 3
    processes is refused naming the world size the launcher counted: 2."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "printf 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)\\n  MIG 3g.40gb     Device  0: (UUID: MIG-1)\\n"
        "  MIG 3g.40gb     Device  1: (UUID: MIG-2)\\nGPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-2)\\n'\n"
    )
    fake.chmod(0o755)
    env = launcher_env()
    env.pop("NGPU")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    result = subprocess.run(["./run_train.sh", "--parallelism.data_parallel_shard_degree", "3"], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert "but the world size is 2: set parallelism.data_parallel_shard_degree = -1 or NGPU = 3" in _error_line(result)


@pytest.mark.slow
def test_a_value_that_mentions_the_config_flag_is_not_the_flag():
    """--job.description "see --job.config_file docs" used to drop the default config (the whole
    command line was matched as one string)."""
    result = run_launcher("--job.description", "see --job.config_file docs", timeout=300,
                          COMM_MODE="fake_backend", NGPU="2")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dry run: deepseek_v3 debugmodel on 2 ranks" in result.stdout


@pytest.mark.slow
def test_tp_parity_check_never_empties_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("kept")
    result = subprocess.run(["./scripts/check_tp_parity.sh", str(tmp_path)], cwd=REPO_ROOT, env=launcher_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: work folder '{tmp_path}' is not empty and was not made by this script: "
                                      "pass a new or empty folder")
    assert (tmp_path / "precious.txt").read_text() == "kept"
