"""Faults injected for real (processes, signals, files), and what the job does about them.

1. A rank dies (SIGKILL mid-run): the job ends quickly, its last line names the rank, the
   signal, the last step and the last complete checkpoint, which the same command resumes from.
2. Preemption (SIGTERM, SIGUSR1 to the launcher, as SLURM sends them): a complete checkpoint at
   the next step boundary and a clean exit (end to end with SIGTERM; both signals through the
   supervisor to the ranks' handler).
3. A checkpoint whose write was interrupted (its .metadata never written): the next start
   says so and the same command resumes from the last complete one with the losses of an
   uninterrupted run.
4. Non-finite values: a NaN in a router's output stops the run naming the step and the MoE
   layer, or, with faults.on_nonfinite = "skip_step", skips exactly that step's update; the
   EP counters and routing statistics stay finite.
5. A stuck rank (SIGSTOP): the other fails within comm.train_timeout_seconds with a message
   naming the collective.
6. All tokens to one expert (tests/ep/test_drop_rule.py::test_all_tokens_to_one_expert).

All runs: the debug model with its small attention cut to 3 layers, 2 processes, fp32, deterministic, short sequences.
"""

import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from torchtitan_ext.runtime import collectives
from tests.helpers import LauncherProcess, descendants, run_distributed, run_launcher
from torchtitan_ext.records.metrics import logged_losses, read_metrics
from tests.training.cases import train_worker

pytestmark = pytest.mark.slow

STEPS = 6
FAST = [
    "--model.flavor", "debugmodel_small_3layers", "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    "--debug.deterministic", "--metrics.disable_color_printing", "--metrics.log_freq", "1",
    "--training.steps", str(STEPS),
]
CHECKPOINT_EVERY_2 = ["--checkpoint.enable", "--checkpoint.interval", "2"]
RESUME_TOLERANCE = 1e-6


def _job(folder: Path, *extra: str) -> list[str]:
    return [*FAST, "--job.dump_folder", str(folder), *extra]


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """{global rank: pid} of the training processes under a launcher."""
    workers = {}
    for pid in descendants(launcher_pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"torchtitan_ext.train" not in cmdline:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                workers[int(entry.split(b"=")[1])] = pid
    return workers


def _longest_step_s(dump_folder: Path) -> float:
    """The longest step time the job logged: bounds on how fast it reacts scale with this machine's speed."""
    return max((row["time_metrics/end_to_end(s)"] for row in read_metrics(dump_folder)), default=0.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The job run without a fault: its losses, and its checkpoint folder (steps 2, 4 and 6). It runs
    in test processes (the launcher's own start is what the other tests check)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    args = ["--job.config_file", "train_configs/debug_model.toml", *_job(folder, *CHECKPOINT_EVERY_2)]
    losses = run_distributed(2, train_worker, [("run", args)])[0]["run"]
    assert list(losses) == list(range(1, STEPS + 1))
    return losses, folder / "checkpoint"


def _assert_resumes(dump_folder: Path, first_step: int, uninterrupted: dict[int, float]) -> None:
    """The resumed run's losses (its metrics.jsonl from ``first_step`` on) against the uninterrupted run's."""
    losses = {step: loss for step, loss in logged_losses(dump_folder).items() if step >= first_step}
    assert list(losses) == list(range(first_step, STEPS + 1)), losses
    for step, loss in losses.items():
        assert loss == pytest.approx(uninterrupted[step], rel=RESUME_TOLERANCE), (step, losses, uninterrupted)


def test_a_killed_rank_is_named_with_the_checkpoint_to_resume_from(tmp_path, record_property):
    job = _job(tmp_path, *CHECKPOINT_EVERY_2)
    launcher = LauncherProcess(*job)
    try:
        launcher.wait_for_step(tmp_path, 3, timeout=300)
        workers = _worker_pids(launcher.process.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        returncode = launcher.finish(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        launcher.kill()
    bound = 60 + 5 * _longest_step_s(tmp_path)
    record_property("measured", f"the job stopped {elapsed:.1f} s after SIGKILL (bound {bound:.0f} s)")
    assert returncode != 0
    assert elapsed < bound, f"the job took {elapsed:.0f} s to stop"
    assert not any(_alive(pid) for pid in workers.values())
    # torchrun's own traceback of the failed rank is left out; its failure report and the summary stay
    assert "ChildFailedError" not in launcher.output and "Root Cause" in launcher.output
    last = launcher.output.strip().splitlines()[-1]
    match = re.fullmatch(
        # the out-of-memory clause only where the kernel's count grew meanwhile (another process's kill)
        r"error: rank 1 \(pid (\d+)\) was killed by SIGKILL(?:, most likely out of memory: [^;]+)?; "
        r"the job stopped after step (\d+) \(exit \d+\); "
        r"rerun the same command to resume from the last complete checkpoint, step (\d+) \((.+)\)",
        last,
    )
    assert match, last
    assert int(match.group(1)) == workers[1]
    stopped_after, resume_step = int(match.group(2)), int(match.group(3))
    assert stopped_after >= 3 and resume_step in (2, 4) and resume_step <= stopped_after + 1
    named = tmp_path / "checkpoint" / f"step-{resume_step}"
    # complete, so the same command loads it: resuming from a complete checkpoint with the uninterrupted run's
    # losses is test_an_interrupted_checkpoint_is_never_loaded's contract
    assert Path(match.group(4)) == named and (named / ".metadata").is_file()


def test_preemption_saves_and_exits_cleanly(tmp_path, record_property):
    """SIGTERM to the launcher, end to end. SIGUSR1 takes the same path in the supervisor and in the
    ranks: the two tests below check that part for both signals without a training run. The same command
    resuming from a complete checkpoint with the uninterrupted run's losses is
    test_an_interrupted_checkpoint_is_never_loaded's contract."""
    job = _job(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "100")
    launcher = LauncherProcess(*job)
    try:
        launcher.wait_for_step(tmp_path, 2, timeout=300)
        os.kill(launcher.process.pid, signal.SIGTERM)  # the launcher is what SLURM signals
        signalled = time.monotonic()
        returncode = launcher.finish(timeout=120)
        elapsed = time.monotonic() - signalled
    finally:
        launcher.kill()
    record_property("measured", f"checkpoint saved and the job ended {elapsed:.1f} s after SIGTERM")
    assert returncode == 0, launcher.output[-3000:]
    saved = re.search(
        r"preempted \(SIGTERM\) at the end of step (\d+): checkpoint saved in (\S+); rerun the same command to resume",
        launcher.output,
    )
    assert saved, launcher.output[-3000:]
    step = int(saved.group(1))
    assert 2 <= step < STEPS
    assert (Path(saved.group(2)) / ".metadata").is_file()
    assert max(logged_losses(tmp_path)) == step, "no step after the one it saved"


def test_a_preemption_signal_that_reaches_torchrun_itself_saves_too(tmp_path):
    """scancel and process-group kills signal torchrun directly, not through the supervisor. SIGUSR1
    (SLURM's warning) killed torchrun outright, and the ranks with it, nothing saved; torchrun now
    passes it on to the ranks (--signals-to-handle) and waits for their checkpoint (--shutdown-timeout).
    torchrun's part is the same for any number of ranks: one runs here (the ranks agreeing on the step they
    save is the SIGTERM test's)."""
    job = _job(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "100",
               "--parallelism.expert_parallel_degree", "1")
    launcher = LauncherProcess(*job, NGPU="1")
    try:
        launcher.wait_for_step(tmp_path, 2, timeout=300)
        torchrun = [pid for pid in descendants(launcher.process.pid)
                    if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()
                    or b"/torchrun\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(torchrun) == 1, torchrun
        os.kill(torchrun[0], signal.SIGUSR1)
        launcher.finish(timeout=300)
    finally:
        launcher.kill()
    saved = re.search(r"preempted \(SIGUSR1\) at the end of step (\d+): checkpoint saved in (\S+);", launcher.output)
    assert saved, launcher.output[-3000:]
    assert (Path(saved.group(2)) / ".metadata").is_file()


FAKE_TORCHRUN = """\
import signal, subprocess, sys
for signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(signum, lambda n, f: print("torchrun got", signal.Signals(n).name, flush=True))
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[1]]))
"""
FAKE_RANK = """\
import signal, time
from torchtitan_ext.runtime.preemption import PreemptionRequest
request = PreemptionRequest()
request.install()
print("rank ready", flush=True)
while request.signal_name is None:
    time.sleep(0.01)
print("rank got", request.signal_name, flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_the_supervisor_passes_preemption_to_the_ranks_not_to_torchrun(tmp_path, signum):
    """torchrun, given SIGTERM, kills its ranks after 30 s, and SIGUSR1 kills torchrun: the supervisor
    sends either signal to the ranks only, whose PreemptionRequest records it. Here "torchrun" is a
    stand-in that reports any signal it gets; its one child is a rank's signal handling."""
    torchrun = tmp_path / "torchrun.py"
    torchrun.write_text(FAKE_TORCHRUN)
    supervised = LauncherProcess(
        "--", sys.executable, str(torchrun), FAKE_RANK, program=(sys.executable, "-m", "torchtitan_ext.supervise")
    )
    try:
        supervised.wait_for("rank ready", timeout=60)
        os.kill(supervised.process.pid, signum)
        returncode = supervised.finish(timeout=60)
    finally:
        supervised.kill()
    assert returncode == 0, supervised.output
    reports = [line for line in supervised.output.splitlines() if line.startswith(("rank ", "torchrun "))]
    assert reports == ["rank ready", f"rank got {signal.Signals(signum).name}"], supervised.output


def _preempted_worker(rank: int, world_size: int, args: list[str]) -> dict:
    """Train with SIGTERM's flag raised after step 2; report what the preemption claimed and what was on
    disk at that moment. Every checkpoint write is held up 2 s before its .metadata, as a slow disk would."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from torchtitan_ext.training import faults
    from torchtitan_ext.training.trainer import Trainer

    finish = dcp_filesystem.FileSystemWriter.finish

    def slow_finish(self, *a, **k):
        time.sleep(2)
        return finish(self, *a, **k)

    dcp_filesystem.FileSystemWriter.finish = slow_finish
    claimed = {}
    preempted = Trainer._preempted

    def preempted_and_checked(trainer):
        error = preempted(trainer)
        path = re.search(r"checkpoint saved in (\S+);", str(error))
        claimed.update(message=str(error), on_disk=bool(path) and (Path(path.group(1)) / ".metadata").is_file())
        return error

    Trainer._preempted = preempted_and_checked

    def preempt_after_step_2(trainer):
        if trainer.step == 2:
            trainer.preemption.signal_name = "SIGTERM"

    try:
        train_worker(rank, world_size, [("run", args)], after_step=preempt_after_step_2)
    except faults.Preempted:
        return claimed
    return {}


@pytest.mark.parametrize("async_mode", ["async", "disabled"])
def test_a_preemption_save_is_complete_before_it_is_reported(tmp_path, async_mode):
    """With --checkpoint.async_mode async (the 671B config's) the save used to be only staged when
    "checkpoint saved" was logged, and the process exited under it: nothing on disk. The routing
    statistics of the steps since their last save are written too."""
    args = ["--job.config_file", "train_configs/debug_model.toml",
            *_job(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.async_mode", async_mode,
                  "--routing_stats.enable", "--routing_stats.save_every", "100")]
    claimed = run_distributed(2, _preempted_worker, args)
    for rank in (0, 1):
        assert claimed[rank]["message"].startswith("preempted (SIGTERM) at the end of step 3: checkpoint saved in "), claimed
        assert claimed[rank]["on_disk"], claimed
    assert [path.name for path in (tmp_path / "routing_stats").iterdir()] == ["routing_step000001-000003.npz"]


def test_an_interrupted_checkpoint_is_never_loaded(tmp_path, uninterrupted_run):
    """The uninterrupted run's steps 2 and 4, step 4's write torn (DCP writes .metadata last): the
    start says so and resumes from step 2, with the uninterrupted run's losses."""
    losses, saved = uninterrupted_run
    for step in (2, 4):
        shutil.copytree(saved / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}")
    torn = tmp_path / "checkpoint" / "step-4"
    assert (torn / ".metadata").is_file() and any(torn.glob("*.distcp"))
    (torn / ".metadata").unlink()

    resumed = run_launcher(*_job(tmp_path, *CHECKPOINT_EVERY_2), timeout=600)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert (f"Checkpoint {torn} is incomplete (no .metadata: its write was interrupted); set aside as "
            f"{torn.parent / 'incomplete_step_4'}, never loaded or counted; training resumes from step 2") in resumed.output
    _assert_resumes(tmp_path, 3, losses)


def test_a_stuck_rank_fails_the_others_within_the_timeout(tmp_path, record_property):
    """Once the surviving rank has reported, the stopped one is continued: torchrun's SIGTERM cannot
    stop a stopped process, and waiting out its 30 s SIGKILL grace would check torchrun, not us."""
    timeout_s = 8
    launcher = LauncherProcess(*_job(tmp_path, "--comm.train_timeout_seconds", str(timeout_s), "--training.steps", "500"))
    try:
        launcher.wait_for_step(tmp_path, 2, timeout=300)
        workers = _worker_pids(launcher.process.pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        # the surviving rank's own line, relayed by torchrun with its rank prefix
        line = launcher.wait_for(r"^\[rank0\]:error: ", timeout=timeout_s + 60).split(":", 1)[1]
        reported = time.monotonic() - stopped
        os.kill(workers[1], signal.SIGCONT)
        returncode = launcher.finish(timeout=120)
        ended = time.monotonic() - stopped
    finally:
        for pid in _worker_pids(launcher.process.pid).values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        launcher.kill()
    # the stop can land anywhere in a step: the rest of that step comes on top of the timeout
    margin = 20 + 5 * _longest_step_s(tmp_path)
    record_property(
        "measured",
        f"comm.train_timeout_seconds = {timeout_s}: the error {reported:.1f} s after SIGSTOP (bound {timeout_s + margin:.0f} s), "
        f"the job's end {ended:.1f} s after (bound: the error's time + {timeout_s + margin + 10:.0f} s)",
    )
    assert returncode != 0, launcher.output[-3000:]
    # the rank that stopped is named, not the healthy one whose collective timed out (it exits first, status 1)
    last = launcher.output.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 (pid {workers[1]}) stopped making progress: it was stopped (SIGSTOP or a "
                           "debugger) when its peers' collective timed out; the job stopped after step"), last
    assert reported < timeout_s + margin, f"the error came {reported:.0f} s after the rank stopped"
    # the continued rank's own collective then times out (its peer is gone), and torchrun ends the job
    assert ended < reported + timeout_s + margin + 10, f"the job ended {ended:.0f} s after the rank stopped:\n{launcher.output[-3000:]}"
    # where the surviving rank waits depends on when the stop landed: any of the three namings
    assert re.match(
        r"error: (MoE layer \d+ (dispatch|combine) \(\w+ExpertParallel\)|FSDP's all-gather or reduce-scatter"
        r"|a collective called from \w+ \(torchtitan(_ext)?/[\w/]+\.py:\d+\)) "
        r"failed: a peer did not answer in time, likely a stuck or dead rank",
        line,
    ), line


def _timeout_raised_in(filename: str, function: str) -> RuntimeError:
    code = compile(f"def {function}():\n    raise RuntimeError('Timed out waiting 8000ms for recv operation to complete')", filename, "exec")
    namespace = {}
    exec(code, namespace)
    try:
        namespace[function]()
    except RuntimeError as error:
        return error


@pytest.mark.parametrize(
    "filename, function, named",
    [
        ("/venv/site-packages/torchtitan/distributed/utils.py", "clip_grad_norm_",
         "a collective called from clip_grad_norm_ (torchtitan/distributed/utils.py:2) failed"),
        ("/venv/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather",
         "FSDP's all-gather or reduce-scatter failed"),
        ("/venv/site-packages/torch/distributed/distributed_c10d.py", "all_reduce", "a collective failed"),
    ],
)
def test_a_collective_outside_the_moe_layers_is_named_by_its_caller(filename, function, named):
    failed = collectives.name_other_collective(_timeout_raised_in(filename, function))
    assert str(failed).startswith(f"{named}: a peer did not answer in time, likely a stuck or dead rank (Timed out"), failed
    assert collectives.name_other_collective(RuntimeError("shape mismatch")) is None


def _nan_worker(rank: int, world_size: int, folder: str, on_nonfinite: str) -> dict:
    """Train 4 steps with a NaN injected into MoE layer 2's router output at step 2."""
    import torch

    from torchtitan_ext.training.faults import NonFiniteLoss

    logged = {}

    def inject(trainer):
        gate = trainer.model_parts[0].layers["2"].moe.router.gate

        def nan_at_step_2(module, inputs, output):
            return output * float("nan") if trainer.step == 2 and module.training else output

        gate.register_forward_hook(nan_at_step_2)
        log = trainer.metrics_processor.logger.log
        trainer.metrics_processor.logger.log = lambda metrics, step: (logged.update({step: dict(metrics)}), log(metrics, step))

    snapshots = {}

    def snapshot(trainer):
        local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model_parts[0].parameters()]
        snapshots[trainer.step] = torch.cat([t.detach().reshape(-1).float() for t in local]).sum().item()

    args = ["--job.config_file", "train_configs/debug_model.toml", *FAST, "--training.steps", "4",
            "--job.dump_folder", folder, "--faults.on_nonfinite", on_nonfinite,
            "--routing_stats.enable", "--routing_stats.save_every", "1"]
    try:
        result = train_worker(rank, world_size, [("run", args)], setup=inject, after_step=snapshot)["run"]
    except NonFiniteLoss as e:
        return {"error": str(e)}
    ep_metrics = {step: {k: v for k, v in metrics.items() if k.startswith("ep/")} for step, metrics in logged.items()}
    return {"losses": result, "snapshots": snapshots, "ep_metrics": ep_metrics}


def test_nan_stops_the_run_naming_step_and_layer(tmp_path):
    results = run_distributed(2, _nan_worker, str(tmp_path), "stop")
    for result in results:
        assert result["error"].startswith(
            "non-finite loss at step 2 (the router of MoE layer 2 produced non-finite scores first): stopped"
        ), result


def test_nan_step_is_skipped_and_counters_stay_finite(tmp_path):
    results = run_distributed(2, _nan_worker, str(tmp_path), "skip_step")
    for result in results:
        losses, snapshots = result["losses"], result["snapshots"]
        assert math.isnan(losses[2]) and all(math.isfinite(losses[s]) for s in (1, 3, 4)), losses
        assert snapshots[2] == snapshots[1], "step 2's update was skipped"
        assert snapshots[3] != snapshots[2] and math.isfinite(snapshots[4])
        assert result["ep_metrics"][2] and all(math.isfinite(v) for m in result["ep_metrics"].values() for v in m.values())
    for path in sorted((tmp_path / "routing_stats").glob("*.npz")):
        with np.load(path) as data:
            for key in data.files:
                assert np.isfinite(data[key]).all(), (path.name, key)
    assert sorted(p.name for p in (tmp_path / "routing_stats").glob("*.npz"))[-1] == "routing_step000004-000004.npz"
