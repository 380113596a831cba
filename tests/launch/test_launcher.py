"""run_train.sh: overrides pass through, bad input fails once with one clear line."""

import os
import sys
from functools import partial

import pytest

from tests.helpers import JobResult, launcher_env, REPO_ROOT, run_job, run_launcher
from torchtitan_ext.runtime import cgroups
from torchtitan_ext.launch.supervisor import Supervisor
from torchtitan_ext.records.metrics import MetricsFile, read_metrics


DEFAULT_CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]


def _error_line(result: JobResult) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert lines and lines[-1].startswith("error: "), result.output[-3000:]
    return lines[-1]


def _check_error(capsys, main, argv: list[str]) -> str:
    """The one line a launcher check (``python -m torchtitan_ext.launch.preflight`` or ``.measuring.dry_run``, as
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
def test_fake_backend_is_a_dry_run(tmp_path):
    result = run_launcher("--job.dump_folder", str(tmp_path), timeout=300, COMM_MODE="fake_backend", NGPU="8",
                          LOG_RANK="0")
    assert result.returncode == 0, result.output[-3000:]
    assert "dry run: deepseek_v3 debugmodel on 8 ranks" in result.output
    assert "mesh: batch=8 loss=8 fsdp=8 ep=2 efsdp=4" in result.output
    assert read_metrics(tmp_path) == [], "a dry run trains no step"


STUB_PYTHON = """#!/bin/sh
# env.sh asks whether this interpreter has the package: it has
[ "$1" = "-c" ] && exit 0
{ printf '%s\\037' "$@"; printf '\\036'; } >> "$STUB_CALLS"
case " $* " in
    *" --print-launch-info "*) echo "export TTE_LOSS_RANK=0 TTE_CHECKPOINT_FOLDER= TTE_DUMP_FOLDER=./outputs" ;;
    *" --help "*) echo "usage: /site-packages/torchtitan_ext/launch/preflight.py [-h] [OPTIONS]" ;;
esac
"""


def launched(tmp_path, *args: str, fake_gpus: str | None = None, **env: str) -> list[list[str]]:
    """The python commands ``./run_train.sh args`` runs (preflight, then the supervisor or the dry run), with a
    ``python`` that only records them: what the launcher's shell hands the package, in a fraction of a second.
    ``fake_gpus``: what ``nvidia-smi -L`` prints."""
    return launched_with_output(tmp_path, *args, fake_gpus=fake_gpus, **env)[0]


def launched_with_output(tmp_path, *args: str, fake_gpus: str | None = None, **env: str) -> tuple[list[list[str]], str]:
    """:func:`launched`'s commands, and what the launcher printed."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    (stub / "python").write_text(STUB_PYTHON)
    (stub / "python").chmod(0o755)
    if fake_gpus is not None:
        (stub / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{fake_gpus}'\n")
        (stub / "nvidia-smi").chmod(0o755)
    calls = tmp_path / "calls"
    launch_env = launcher_env(STUB_CALLS=str(calls), **env)
    launch_env["PATH"] = f"{stub}{os.pathsep}{launch_env['PATH']}"
    if fake_gpus is not None:
        launch_env.pop("NGPU")
    result = run_job(["./run_train.sh", *args], cwd=REPO_ROOT, env=launch_env, timeout_s=60, check=False)
    assert result.returncode == 0, result.output
    return [call.split("\037")[:-1] for call in calls.read_text().split("\036")[:-1]], result.output


def _train_args(call: list[str]) -> list[str]:
    """The job's arguments: a check's after "--", the supervisor's after torchrun's module."""
    return call[call.index("torchtitan_ext.train" if "torchtitan_ext.train" in call else "--") + 1:]


@pytest.mark.slow
def test_the_launcher_hands_ngpu_port_and_log_rank_to_its_checks(tmp_path):
    preflight, supervisor = launched(tmp_path, "--training.steps", "3", NGPU="two", MASTER_PORT="29555", LOG_RANK="1")
    assert preflight[:preflight.index("--")] == [
        "-m", "torchtitan_ext.launch.preflight", "--ngpu", "two", "--port", "29555", "--log-rank", "1",
        "--print-launch-info",
    ]
    assert _train_args(preflight) == [*DEFAULT_CONFIG, "--training.steps", "3"]
    assert "--nproc_per_node=two" in supervisor and "--rdzv_endpoint=localhost:29555" in supervisor
    assert supervisor[supervisor.index("--local-ranks-filter") + 1] == "1"


@pytest.mark.slow
def test_help_is_the_launchers_usage_then_the_config_options_under_its_name(tmp_path):
    """Before, the pre-flight's help went into the launch info the launcher evaluates: "usage:: command not found"."""
    (preflight,), output = launched_with_output(tmp_path, "--training.steps", "3", "--help")
    assert _train_args(preflight) == [*DEFAULT_CONFIG, "--training.steps", "3", "--help"]
    lines = output.splitlines()
    assert lines[0] == "Launch a training job, torchtitan style." and "  MASTER_PORT  rendezvous port; unset picks" in output
    assert lines[-1] == "usage: ./run_train.sh [-h] [OPTIONS]"


def test_a_launch_that_asks_for_help_is_refused_where_the_launcher_evaluates_the_output(capsys):
    from torchtitan_ext.launch import preflight

    for flag in ("--print-launch-info", "--print-env"):
        assert _check_error(capsys, preflight.main, ["--ngpu", "2", flag, "--", *DEFAULT_CONFIG, "-h"]).startswith(
            "error: --help is among the job's config overrides: the launchers list their options with ")


LLAMA4_CONFIG = ["--job.config_file", "train_configs/llama4_debug_model.toml"]


@pytest.mark.slow
@pytest.mark.parametrize("args, env, job", [
    ([], {}, DEFAULT_CONFIG),
    (LLAMA4_CONFIG, {}, LLAMA4_CONFIG),
    ([], {"CONFIG_FILE": LLAMA4_CONFIG[1]}, LLAMA4_CONFIG),
    # both: the config parser names the two files in one line
    (LLAMA4_CONFIG, {"CONFIG_FILE": DEFAULT_CONFIG[1]}, [*DEFAULT_CONFIG, *LLAMA4_CONFIG]),
    # a value that mentions the flag is not the flag
    (["--job.description", "see --job.config_file docs"], {},
     [*DEFAULT_CONFIG, "--job.description", "see --job.config_file docs"]),
], ids=["default", "on_the_command_line", "in_config_file", "both", "mentioned_in_a_value"])
def test_the_job_config_reaches_every_check_once(tmp_path, args, env, job):
    for mode in ("", "fake_backend"):
        calls = launched(tmp_path / (mode or "train"), *args, COMM_MODE=mode, **env)
        assert [_train_args(call) for call in calls] == [job] * len(calls), calls
        assert calls[-1][1] == ("torchtitan_ext.measuring.dry_run" if mode else "torchtitan_ext.supervise")


@pytest.mark.slow
def test_ngpu_counts_gpus_not_mig_instances(tmp_path):
    """nvidia-smi -L lists each MIG instance under its GPU; `wc -l` counted them as GPUs."""
    preflight, _ = launched(tmp_path, fake_gpus="GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)\\n"
                            "  MIG 3g.40gb     Device  0: (UUID: MIG-1)\\n  MIG 3g.40gb     Device  1: (UUID: MIG-2)\\n"
                            "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-2)\\n")
    assert preflight[preflight.index("--ngpu") + 1] == "2"


def _complete_step_2(dump_folder) -> None:
    (dump_folder / "checkpoint" / "step-2").mkdir(parents=True)
    (dump_folder / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")


def _embedding(other_model: bool = False) -> dict:
    """The default job's model's embedding weight, by the name and of the shape torchtitan saves it under; or, for
    ``other_model``, one of half its width (a model of another hidden size)."""
    import torch

    from torchtitan_ext.config import parse, shared_meta_model

    rows, columns = shared_meta_model(parse(DEFAULT_CONFIG)).tok_embeddings.weight.shape
    return {"tok_embeddings.weight": torch.zeros(rows, columns // 2 if other_model else columns)}


def _full_checkpoint(dump_folder, step: int = 2, data_parallel_ranks: int = 2, other_model: bool = False) -> None:
    """A full checkpoint of ``step`` as torchtitan writes one (the model's weights under their own names), its data
    loader's state saved by ``data_parallel_ranks`` ranks (as torchtitan's ParallelAwareDataloader keys it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    data_loader = {f"dp_rank_{rank}": torch.tensor(0) for rank in range(data_parallel_ranks)}
    dcp.save({**_embedding(other_model), "train_state": {"step": torch.tensor(step)},
              "dataloader": {**data_loader, "world_size": torch.tensor(data_parallel_ranks)}},
             checkpoint_id=str(dump_folder / "checkpoint" / f"step-{step}"), no_dist=True)


def _model_only_last_step(dump_folder) -> None:
    """A finished job's folder: a full checkpoint at step 2, its last step (4) saved model-only."""
    import torch.distributed.checkpoint as dcp

    _full_checkpoint(dump_folder)
    dcp.save(_embedding(), checkpoint_id=str(dump_folder / "checkpoint" / "step-4"), no_dist=True)


def _tokenizer_file(folder) -> None:
    folder.write_text("{}")


def _folder_without_tokenizer(folder) -> None:
    folder.mkdir()
    (folder / "config.json").write_text("{}")


def _tokenizer_folder(folder) -> None:
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")


def _hf_checkpoint(folder) -> None:
    (folder / "hf").mkdir()
    (folder / "hf" / "model.safetensors").write_bytes(b"")


# (what the job's files hold, its overrides ({tmp}: the test's folder), the error line's start; None: it starts)
LAUNCHES = {
    "no tokenizer folder": (None, ["--model.hf_assets_path", "{tmp}/assets"],
                            "model.hf_assets_path = '{tmp}/assets' does not exist"),
    "a tokenizer file": (_tokenizer_file, ["--model.hf_assets_path", "{tmp}/assets"],
                         "model.hf_assets_path = '{tmp}/assets' is a file"),
    "no tokenizer": (_folder_without_tokenizer, ["--model.hf_assets_path", "{tmp}/assets"],
                     "model.hf_assets_path = '{tmp}/assets' holds no tokenizer"),
    "a missing load step": (_complete_step_2, ["--checkpoint.enable", "--checkpoint.load_step", "4"],
                            "checkpoint.load_step = 4, but {tmp}/checkpoint holds no complete checkpoint of that step "
                            "(complete: 2)"),
    "a model-only last step": (_model_only_last_step, ["--checkpoint.enable"],
                               "checkpoint {tmp}/checkpoint/step-4 holds the model only (checkpoint.last_save_model_only "
                               "saves a job's last step so), and a job resuming in {tmp}/checkpoint loads it whole: "
                               "move it aside (mv {tmp}/checkpoint/step-4 {tmp}/checkpoint/model_only_step_4) to resume "
                               "from the last full one, step 2, or start from its weights"),
    "a full checkpoint named by its step": (_model_only_last_step, ["--checkpoint.enable", "--checkpoint.load_step", "2"],
                                            None),
    "a model-only last step loaded as the model": (
        _model_only_last_step,
        ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader,train_state"],
        None),
    "a checkpoint of four data-parallel ranks": (
        partial(_full_checkpoint, data_parallel_ranks=4), ["--checkpoint.enable"],
        "checkpoint {tmp}/checkpoint/step-2 holds the data loader of 4 data-parallel ranks, and this job has 2 "
        "(data_parallel_replicate x data_parallel_shard): torchtitan's data loader cannot reshard its state"),
    "a checkpoint of four data-parallel ranks without its data loader": (
        partial(_full_checkpoint, data_parallel_ranks=4),
        ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader"], None),
    "a start from a checkpoint of four data-parallel ranks": (
        partial(_full_checkpoint, data_parallel_ranks=4),
        ["--checkpoint.enable", "--checkpoint.folder", "fresh", "--checkpoint.initial_load_path",
         "{tmp}/checkpoint/step-2", "--checkpoint.no_initial_load_model_only"],
        "checkpoint {tmp}/checkpoint/step-2 holds the data loader of 4 data-parallel ranks"),
    "a start from the model of a checkpoint of four data-parallel ranks": (
        partial(_full_checkpoint, data_parallel_ranks=4),
        ["--checkpoint.enable", "--checkpoint.folder", "fresh", "--checkpoint.initial_load_path",
         "{tmp}/checkpoint/step-2"], None),
    "a checkpoint of another model": (
        partial(_full_checkpoint, other_model=True), ["--checkpoint.enable"],
        "checkpoint {tmp}/checkpoint/step-2 was saved by another model: its tok_embeddings.weight is [2048, 128], "
        "which this job's model (model.name = 'deepseek_v3', flavor 'debugmodel') makes [2048, 256]: run the model it "
        "was saved by, or give this job another checkpoint.folder"),
    "no initial checkpoint": (None, ["--checkpoint.enable", "--checkpoint.initial_load_path", "{tmp}/initial"],
                              "checkpoint.initial_load_path = '{tmp}/initial' is not a folder"),
    "a tokenizer folder as the HF checkpoint": (
        _tokenizer_folder,
        ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--model.hf_assets_path", "{tmp}/assets"],
        "model.hf_assets_path = '{tmp}/assets' holds no .safetensors file, and the job starts from the HF checkpoint "
        "there (checkpoint.initial_load_in_hf loads from there where checkpoint.initial_load_path is unset)"),
    "an HF checkpoint loaded as DCP": (_hf_checkpoint, ["--checkpoint.enable", "--checkpoint.initial_load_path", "{tmp}/hf"],
                                       "checkpoint.initial_load_path = '{tmp}/hf' holds no complete DCP checkpoint (no "
                                       ".metadata), and the job starts from it: it holds HF safetensors: add "
                                       "--checkpoint.initial_load_in_hf"),
    "an HF checkpoint with the optimizer": (
        _hf_checkpoint,
        ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "{tmp}/hf",
         "--checkpoint.no_initial_load_model_only"],
        "checkpoint.initial_load_in_hf loads the model only, but checkpoint.initial_load_model_only is off"),
    "a quantized checkpoint not in HF": (None, ["--checkpoint.enable", "--checkpoint.initial_load_in_hf_quantized"],
                                         "checkpoint.initial_load_in_hf_quantized reads a quantized HF checkpoint, "
                                         "but checkpoint.initial_load_in_hf is off"),
    "an HF checkpoint": (_hf_checkpoint,
                         ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
                          "{tmp}/hf"], None),
    "a one-process comm mode": (None, ["--comm.mode", "local_tensor"],
                                "comm.mode = 'local_tensor': the launcher starts the job's training processes"),
    "a dataset torchtitan's package lacks": (None, ["--training.dataset", "c4_test"],
                                              "training.dataset = 'c4_test' reads 'tests/assets/c4_test' (relative to "),
    "a missing dataset folder": (None, ["--training.dataset", "c4", "--training.dataset_path", "{tmp}/c4"],
                                 "training.dataset_path = '{tmp}/c4' is not a folder here, and the job loads its data "
                                 "from it"),
    "a dataset on the Hub": (None, ["--training.dataset", "c4"], None),
    "a missing custom import": (None, ["--experimental.custom_import", "no_such_module_here.datasets"],
                                "experimental.custom_import = 'no_such_module_here.datasets' is not a module"),
    "a custom import": (None, ["--experimental.custom_import", "json"], None),
    "a dump folder that is a file": (lambda folder: (folder / "taken").write_text(""),
                                     ["--job.dump_folder", "{tmp}/taken"],
                                     "job.dump_folder = '{tmp}/taken' is a file: give a folder"),
    "a dump folder that cannot be made": (lambda folder: (folder / "taken").write_text(""),
                                          ["--job.dump_folder", "{tmp}/taken/outputs"],
                                          "job.dump_folder = '{tmp}/taken/outputs' cannot be made a folder (Not a "
                                          "directory): give a folder this user can write, or one it can create"),
    "W&B without wandb": (None, ["--metrics.enable_wandb"], "metrics.enable_wandb is set, but this machine's Python "
                                                           "has no wandb: pip install wandb"),
    "more than the machine's memory": (None, [], "model.flavor = 'debugmodel' has "),
}


@pytest.mark.parametrize("case", LAUNCHES)
def test_a_launch_its_ranks_would_fail_stops_in_one_line(case, capsys, monkeypatch, tmp_path):
    """What torchtitan's ranks find out only once started (a tokenizer, a checkpoint, a module missing; a CPU job
    that cannot fit), each a traceback or an OOM kill per rank, the pre-flight says in one line, torchtitan's own
    warning of a missing tokenizer folder left out."""
    from torchtitan_ext import data
    from torchtitan_ext.launch import preflight

    # the weights, gradients and Adam's two moments of the debug model's 33M parameters take 528 MB (two copies
    # would take 264 MB): more than a machine of 400 MB
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 4 * 10**8 if case.startswith("more than") else 10**15)
    monkeypatch.setitem(sys.modules, "wandb", None)  # a machine without it, whatever this one has
    monkeypatch.setattr(data, "_check_hub_dataset", lambda *args: None)  # the Hub reached, whatever this machine's network
    make, overrides, error = LAUNCHES[case]
    if make is not None:
        make(tmp_path / "assets" if "tokenizer" in case else tmp_path)
    argv = ["--ngpu", "2", "--", *DEFAULT_CONFIG, "--job.dump_folder", str(tmp_path),
            *(value.format(tmp=tmp_path) for value in overrides)]
    if error is None:
        preflight.main(argv)
        return
    with pytest.raises(SystemExit) as exit_info:
        preflight.main(argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {error.format(tmp=tmp_path)}"), lines


def test_a_folder_with_any_file_torchtitan_builds_a_tokenizer_from_passes(tmp_path):
    """tokenizer.json, or vocab.json or vocab.txt (with merges.txt, a BPE)."""
    from torchtitan_ext.config import parse
    from torchtitan_ext.data import check_tokenizer_folder

    for name in ("tokenizer.json", "vocab.json", "vocab.txt"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("{}")
        check_tokenizer_folder(parse([*DEFAULT_CONFIG, "--model.hf_assets_path", str(folder)]))


def test_dry_run_rejects_bad_degrees(capsys):
    from torchtitan_ext.measuring import dry_run

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
    last step is the one the job logged in its metrics.jsonl: here a run resumed at step 3, where an earlier one
    had logged up to step 5."""
    MetricsFile(tmp_path).write(5, {"loss_metrics/global_avg_loss": 7.0})
    supervisor = Supervisor([], checkpoint_folder=None, dump_folder=tmp_path)
    MetricsFile(tmp_path).write(3, {"loss_metrics/global_avg_loss": 7.5})
    for line in report.splitlines():
        supervisor._read(line)
    assert supervisor.explain(1) == (
        f"error: {named}; the job stopped after step 3 (exit 1); "
        "checkpointing is off (checkpoint.enable): a rerun starts over"
    )


@pytest.mark.parametrize("before, after, clause", [
    ("oom_kill 2", "oom_kill 2", ""),
    ("oom_kill 2", "oom_kill 4", ", most likely out of memory: the kernel's out-of-memory killer ended 2 processes "
                                 "on this machine (oom_kill in "),
    ("pgfault 10", "pgfault 12", ""),  # a kernel that does not count them
], ids=["none_ended", "two_ended", "not_counted"])
def test_a_rank_killed_while_the_oom_killer_ran_is_said_to_be_out_of_memory(before, after, clause, tmp_path, monkeypatch):
    """The kernel's out-of-memory killer sends SIGKILL: the supervisor names it where its count grew while the job
    ran (here the machine's: the process is in no control group), and only there."""
    vmstat = tmp_path / "vmstat"
    monkeypatch.setattr(cgroups, "PROC_CGROUP", tmp_path / "no_cgroups")
    monkeypatch.setattr(cgroups, "VMSTAT", vmstat)
    vmstat.write_text(f"nr_free_pages 100\n{before}\n")
    supervisor = Supervisor([], checkpoint_folder=None, dump_folder=None)
    vmstat.write_text(f"nr_free_pages 100\n{after}\n")
    for line in TORCHRUN_REPORT.splitlines():
        supervisor._read(line)
    explained = supervisor.explain(1)
    assert explained.startswith(f"error: rank 1 (pid 4321) was killed by SIGKILL{clause}")
    assert ("out of memory" in explained) == bool(clause)


def test_an_earlier_runs_steps_are_not_the_failed_jobs(tmp_path):
    """A job that failed before logging a step, in a dump folder where an earlier run logged steps 1 to 3."""
    MetricsFile(tmp_path).write(1, {"loss_metrics/global_avg_loss": 7.5})
    MetricsFile(tmp_path).write(3, {"loss_metrics/global_avg_loss": 7.0})
    supervisor = Supervisor([], checkpoint_folder=None, dump_folder=tmp_path)
    for line in TORCHRUN_REPORT.splitlines():
        supervisor._read(line)
    assert " the job stopped before logging a step (exit 1); " in supervisor.explain(1)


def test_a_job_that_failed_in_its_start_is_rerun_once_the_cause_is_fixed(tmp_path):
    """Stopped before its first step, a job failed in its start (a rerun repeats that): the line says to fix the
    cause before the rerun that resumes."""
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    supervisor = Supervisor([], checkpoint_folder=tmp_path / "checkpoint", dump_folder=tmp_path)
    for line in TORCHRUN_REPORT.splitlines():
        supervisor._read(line)
    assert supervisor.explain(1).endswith(
        "the job stopped before logging a step (exit 1); fix the cause above and rerun the same command to resume "
        f"from the last complete checkpoint, step 2 ({tmp_path / 'checkpoint' / 'step-2'})")


def test_a_command_line_torchrun_refuses_is_the_cause_and_no_earlier_runs_step(tmp_path):
    """torch 2.11's torchrun has no --shutdown-timeout: argparse's two lines, exit 2, no rank started. The dump
    folder's metrics are an earlier run's, so no step or checkpoint is offered."""
    MetricsFile(tmp_path).write(3, {"loss_metrics/global_avg_loss": 7.5})
    supervisor = Supervisor([], checkpoint_folder=None, dump_folder=tmp_path)
    for line in ["usage: torchrun [-h] [--nnodes NNODES] [--nproc-per-node NPROC_PER_NODE]",
                 "torchrun: error: unrecognized arguments: --shutdown-timeout"]:
        supervisor._read(line)
    assert supervisor.explain(2) == ("error: torchrun refused its command line: unrecognized arguments: "
                                     "--shutdown-timeout (exit 2); no rank started")
