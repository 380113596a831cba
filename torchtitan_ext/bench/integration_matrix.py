"""torchtitan 0.2.2's own DeepSeek-V3 and Llama4 integration tests, on CPU, for every EP backend.

    python -m torchtitan_ext.bench integration_matrix [--steps 2] [--only NAME ...] [--backends VARIANT ...]
        [--markdown FILE] [--logs DIR]

torchtitan's tests/integration_tests/models.py (v0.2.2) runs these combinations
of parallelisms on 4 or 8 GPUs. Each is run here through ``./run_train.sh``
with the same process count (gloo, CPU), once per backend variant (one per kernel
family, ``MATRIX_VARIANTS``), with a short sequence and few steps.
A combination must either train (exit 0, every step in its metrics.jsonl) or be refused
before any process starts, in one line naming the setting (exit 2). Anything
else (a traceback, a hang past ``--timeout``) fails.

Results go to ``--markdown`` with the command, one row per run.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from torchtitan_ext.bench import ROOT
from torchtitan_ext.ep.backends import backend_variants, MATRIX_VARIANTS
from torchtitan_ext.records.metrics import logged_losses
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import JobFailed, run_job


COMBINATIONS = {
    "deepseek_v3_fsdp+ep+compile": (4, ["--model.name", "deepseek_v3", "--parallelism.data_parallel_shard_degree", "4",
                                        "--parallelism.expert_parallel_degree", "2", "--compile.enable"]),
    "pp_dualpipev": (4, ["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.expert_parallel_degree", "2",
                         "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                         "--activation_checkpoint.mode", "none"]),
    "pp_dualpipev_no_overlap": (4, ["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2",
                                             "--parallelism.expert_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                                             "--activation_checkpoint.mode", "none",
                                             "--parallelism.no-pipeline-parallel-expert-parallel-overlap"]),
    "deepseek_v3_pp+fsdp+tp+ep": (8, ["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                      "--parallelism.data_parallel_shard_degree", "2",
                                      "--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.expert_parallel_degree", "4",
                                      "--parallelism.expert_tensor_parallel_degree", "1"]),
    "deepseek_v3_pp+fsdp+tp+ep+etp": (8, ["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2",
                                          "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                          "--parallelism.data_parallel_shard_degree", "2",
                                          "--parallelism.tensor_parallel_degree", "2",
                                          "--parallelism.expert_parallel_degree", "2",
                                          "--parallelism.expert_tensor_parallel_degree", "2"]),
    "deepseek_v3_flex+pp+fsdp+ep+sacop": (8, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_flex_attn",
                                              "--parallelism.data_parallel_shard_degree", "4",
                                              "--parallelism.pipeline_parallel_degree", "2",
                                              "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                              "--parallelism.expert_parallel_degree", "4",
                                              "--activation_checkpoint.mode", "selective",
                                              "--activation_checkpoint.selective_ac_option", "op"]),
    "llama4_pp+fsdp+tp+ep+compile": (8, ["--model.name", "llama4", "--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                         "--parallelism.data_parallel_shard_degree", "2",
                                         "--parallelism.tensor_parallel_degree", "2",
                                         "--parallelism.expert_parallel_degree", "4",
                                         "--parallelism.expert_tensor_parallel_degree", "1", "--compile.enable"]),
}
"""name (torchtitan's test id): (processes, overrides), as in torchtitan v0.2.2's models.py; the
row marked "(ours)" is what the CPU refusal of DualPipeV's overlap points to."""

DEFAULT_VARIANTS = MATRIX_VARIANTS
"""The backend variants (``torchtitan_ext.ep.backends.backend_variants``) each combination runs with by default."""


def outcome(returncode: int | None, output: str, losses: dict[int, float], steps: int) -> tuple[str, str]:
    """(outcome, detail) of one run that exited with ``returncode`` (None: killed at the timeout), printed
    ``output`` and logged ``losses`` ({step: loss}, its metrics.jsonl): "trains" with the losses, "refused" with
    the one-line message, or "FAILED" / "TIMEOUT" with the last error line."""
    lines = [line for line in output.splitlines() if line.strip()]
    if returncode == 0 and sorted(losses) == list(range(1, steps + 1)):
        return "trains", " ".join(f"{losses[s]:.4f}" for s in sorted(losses))
    if returncode == 2 and lines and lines[-1].startswith("error: ") and "Traceback" not in output:
        return "refused", lines[-1].removeprefix("error: ")
    errors = [line for line in lines if "Error" in line or "error" in line]
    detail = (errors[-1] if errors else (lines[-1] if lines else "no output"))[-300:]
    return "FAILED" if returncode is not None else "TIMEOUT", detail


def run(name: str, variant: str, steps: int, timeout: float, dump_folder: str) -> dict:
    nproc, overrides = COMBINATIONS[name]
    env = dict(os.environ, NGPU=str(nproc), PYTHONUNBUFFERED="1")
    env.pop("CONFIG_FILE", None)
    command = [
        "./run_train.sh", *overrides, *backend_variants()[variant],
        "--training.steps", str(steps), "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--job.dump_folder", dump_folder,
    ]
    started = time.monotonic()
    try:
        result = run_job(command, cwd=ROOT, env=env, timeout_s=timeout, check=False)
        output, returncode = result.output, result.returncode
    except JobFailed as e:  # past its timeout: stopped with every process it started
        output, returncode = e.result.output, None
    elapsed = time.monotonic() - started
    result, detail = outcome(returncode, output, logged_losses(dump_folder), steps)
    return {"name": name, "backend": variant, "nproc": nproc, "outcome": result, "detail": detail,
            "seconds": elapsed, "output": output}


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(
        description=__doc__,
        epilog="combinations (--only):\n" + "\n".join(f"  {name}" for name in sorted(COMBINATIONS)),
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--only", nargs="*", choices=sorted(COMBINATIONS), metavar="NAME",
                        help="combinations to run (default: all; listed below)")
    parser.add_argument("--backends", nargs="*", choices=list(backend_variants()), default=list(DEFAULT_VARIANTS),
                        metavar="VARIANT", help=f"backend variants to run each combination with, among "
                        f"{', '.join(backend_variants())} (default: {', '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--markdown", type=Path, help="write the results table to this markdown file")
    parser.add_argument("--logs", type=Path, help="folder for each run's full output")
    args = parser.parse_args(argv)
    command = "python -m torchtitan_ext.bench integration_matrix " + " ".join(
        argv if argv is not None else sys.argv[1:])
    runs = [(name, variant) for name in (args.only or COMBINATIONS) for variant in args.backends]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in tqdm(runs, desc="integration matrix", unit="run"):
            result = run(name, variant, args.steps, args.timeout, f"{tmp}/{name}-{variant}")
            results.append(result)
            tqdm.write(f"{name} [{variant}]: {result['outcome']} in {result['seconds']:.0f} s: {result['detail']}")
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{name}-{variant}.log").write_text(result["output"])
    if args.markdown is not None:
        table = "".join(
            f"| {r['name']} | {r['backend']} | {r['nproc']} | {r['outcome']} | {r['seconds']:.0f} | "
            f"{r['detail'].replace('|', '/')} |\n"
            for r in results
        )
        args.markdown.write_text(
            "# torchtitan 0.2.2's DeepSeek-V3 and Llama4 integration tests on CPU\n\n"
            "Generated by `python -m torchtitan_ext.bench integration_matrix` (see its docstring): each\n"
            "combination of torchtitan v0.2.2's `tests/integration_tests/models.py` for these models, run\n"
            "through `./run_train.sh` with its process count on a CPU (gloo), per EP backend variant, seq_len 64,\n"
            f"local batch 4, {args.steps} steps. *trains*: every step in metrics.jsonl, exit 0 (losses shown);\n"
            "*refused*: one line before any process started, exit 2.\n\n"
            f"`{command}`\n\n"
            "| combination | backend | processes | outcome | seconds | losses or message |\n"
            "|---|---|---|---|---|---|\n" + table
        )
        print(f"results written to {args.markdown}")
    return 0 if all(r["outcome"] in ("trains", "refused") for r in results) else 1
