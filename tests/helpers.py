"""Helpers shared by the tests: repository paths, the launcher, worker processes.

Nothing here waits without a deadline: workers are joined against a deadline and killed past it
(:mod:`torchtitan_ext.runtime.workers`), and launcher output is read against a deadline.
"""

import os
import re
import sys
import time
from pathlib import Path

from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.jobs import descendants, JobFailed, JobResult, run_job, RunningJob  # noqa: F401
from torchtitan_ext.runtime.workers import DEADLINE_S, run_workers, WorkersFailed  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
DEBUG_FLAVOURS = {"deepseek_v3": "debugmodel", "llama4": "debugmodel", "qwen3": "debugmodel_moe_small",
                  "gpt_oss": "debugmodel_small"}
"""Each model family's debug flavour (the one its shipped debug config trains)."""


def launcher_env(**overrides: str) -> dict[str, str]:
    """Environment for run_train.sh: this interpreter first on PATH, 2 processes, unbuffered output."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MASTER_PORT", None)
    env.pop("CONFIG_FILE", None)
    env["NGPU"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def run_launcher(*args: str, timeout: float = 600, **env: str) -> JobResult:
    """Run ./run_train.sh from the repository root to its end (the one job launcher), its output kept."""
    return run_job(["./run_train.sh", *args], timeout_s=timeout, check=False, cwd=REPO_ROOT, env=launcher_env(**env))


class LauncherProcess(RunningJob):
    """./run_train.sh (or another ``program``) running in the background (the one job launcher's
    :class:`~torchtitan_ext.runtime.jobs.RunningJob`), with what the tests wait for: a line, a logged step."""

    def __init__(self, *args: str, program: tuple[str, ...] = ("./run_train.sh",), **env: str):
        super().__init__([*program, *args], cwd=REPO_ROOT, env=launcher_env(**env))

    def wait_for(self, pattern: str, timeout: float) -> str:
        """The first new line matching ``pattern`` (a regex); AssertionError past ``timeout`` s or at EOF."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.next_line(deadline)
            except TimeoutError:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-3000:]}") from None
            if line is None:
                raise AssertionError(f"output ended without {pattern!r}:\n{self.output[-3000:]}")
            if re.search(pattern, ANSI_ESCAPE.sub("", line)):
                return line

    def wait_for_step(self, dump_folder: Path, step: int, timeout: float) -> dict:
        """The metrics of ``step`` once the job has logged it in ``dump_folder``'s metrics.jsonl; AssertionError past
        ``timeout`` s or when the job ends first."""
        deadline = time.monotonic() + timeout
        while True:
            logged = [row for row in read_metrics(dump_folder) if row["step"] >= step]
            if logged:
                return logged[0]
            code = self.process.poll()
            if code is not None:
                logged = [row for row in read_metrics(dump_folder) if row["step"] >= step]
                if logged:  # written between the read above and its exit
                    return logged[0]
                self._reader.join(timeout=10)  # the output to its end, as finish() reads it
                raise AssertionError(f"the job ended (exit status {code}) before logging step {step}:\n"
                                     f"{self.output[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step} not logged within {timeout} s:\n{self.output[-3000:]}")
            time.sleep(0.2)

    def finish(self, timeout: float) -> int:
        """Its exit status; AssertionError (after stopping it) past ``timeout`` s."""
        try:
            return super().finish(timeout_s=timeout)
        except JobFailed as e:
            raise AssertionError(str(e)) from None

    def kill(self) -> None:
        """SIGKILL the launcher and every process under it, at once."""
        self.stop(grace_s=0.0)


WORKER_PRELOAD = ["torchtitan_ext.train", "tests.training.cases", "tests.ep.cases", "tests.models.gradient_cases"]
"""Modules the workers' fork server imports once for the whole session (:func:`run_distributed`)."""


def run_distributed(world_size: int, fn, *args, device: str = "cpu", deadline_s: float = DEADLINE_S):
    """``fn(rank, world_size, *args)`` on ``world_size`` processes (:func:`torchtitan_ext.runtime.workers.run_workers`),
    CPU workers forked with torch, torchtitan and the test cases already imported."""
    return run_workers(world_size, fn, *args, device=device, deadline_s=deadline_s, preload=WORKER_PRELOAD)


def planned_experts(config: str, *overrides: str, seed: int, scale: float) -> list:
    """Every MoE layer's routed experts of ``train_configs/<config>`` at EP = 1 in one process, as training builds
    them (the model converters, then the parallelize plan), each parameter drawn from a normal distribution times
    ``scale`` (``seed``). Needs a process group of one (the ``world_of_one`` fixture)."""
    import torch
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_ext.config import load_job_config, meta_model
    from torchtitan_ext.training import prepare

    prepare()
    job_config = load_job_config(["--job.config_file", f"train_configs/{config}",
                                  "--parallelism.expert_parallel_degree", "1", *overrides], "cpu", 1)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = meta_model(job_config)
    build_model_converters(job_config, dims).convert(model)
    get_train_spec(job_config.model.name).parallelize_fn(model, dims, job_config)
    layers = [block.moe.experts for block in model.layers.values() if block.moe_enabled]
    generator = torch.Generator().manual_seed(seed)
    for experts in layers:
        experts.to_empty(device="cpu")
        with torch.no_grad():
            for parameter in experts.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return layers
