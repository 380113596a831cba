"""torchtitan 0.2.2's own DeepSeek-V3 and Llama4 integration tests, on CPU, for every EP backend.

    python scripts/integration_matrix.py [--steps 2] [--only NAME ...] [--markdown FILE]

torchtitan's tests/integration_tests/models.py (v0.2.2) runs these combinations
of parallelisms on 4 or 8 GPUs. Each is run here through ``./run_train.sh``
with the same process count (gloo, CPU), once per backend (nccl, deepep,
hybridep blocking, hybridep non-blocking), with a short sequence and few steps.
A combination must either train (exit 0, every step logged) or be refused
before any process starts, in one line naming the setting (exit 2). Anything
else (a traceback, a hang past ``--timeout``) fails.

Results go to ``--markdown`` with the command, one row per run.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")

COMBINATIONS = {
    "deepseek_v3_fsdp+ep+compile": (4, ["--model.name", "deepseek_v3", "--parallelism.data_parallel_shard_degree", "4",
                                        "--parallelism.expert_parallel_degree", "2", "--compile.enable"]),
    "pp_dualpipev": (4, ["--model.name", "deepseek_v3", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.expert_parallel_degree", "2",
                         "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--activation_checkpoint.mode", "none"]),
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

BACKENDS = {
    "nccl": ["--parallelism.expert_parallel_comm_backend", "nccl"],
    "deepep": ["--parallelism.expert_parallel_comm_backend", "deepep"],
    "hybridep": ["--parallelism.expert_parallel_comm_backend", "hybridep"],
    "hybridep_nb": ["--parallelism.expert_parallel_comm_backend", "hybridep",
                    "--hybridep.non_blocking_capacity_factor", "1.0"],
}


def run(name: str, backend: str, steps: int, timeout: float, dump_folder: str) -> dict:
    nproc, overrides = COMBINATIONS[name]
    env = dict(os.environ, NGPU=str(nproc), PYTHONUNBUFFERED="1")
    env.pop("CONFIG_FILE", None)
    command = [
        "./run_train.sh", *overrides, *BACKENDS[backend],
        "--training.steps", str(steps), "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--job.dump_folder", dump_folder,
    ]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=timeout, start_new_session=True)
        output, returncode = result.stdout, result.returncode
    except subprocess.TimeoutExpired as e:
        output, returncode = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
    elapsed = time.monotonic() - started
    losses = {int(step): float(loss) for step, loss in STEP.findall(output)}
    lines = [line for line in output.splitlines() if line.strip()]
    if returncode == 0 and sorted(losses) == list(range(1, steps + 1)):
        outcome, detail = "trains", " ".join(f"{losses[s]:.4f}" for s in sorted(losses))
    elif returncode == 2 and lines and lines[-1].startswith("error: ") and "Traceback" not in output:
        outcome, detail = "refused", lines[-1].removeprefix("error: ")
    else:
        errors = [line for line in lines if "Error" in line or "error" in line]
        outcome = "FAILED" if returncode is not None else "TIMEOUT"
        detail = (errors[-1] if errors else (lines[-1] if lines else "no output"))[-300:]
    return {"name": name, "backend": backend, "nproc": nproc, "outcome": outcome, "detail": detail,
            "seconds": elapsed, "output": output}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="combinations (--only):\n" + "\n".join(f"  {name}" for name in sorted(COMBINATIONS)),
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--only", nargs="*", choices=sorted(COMBINATIONS), metavar="NAME",
                        help="combinations to run (default: all; listed below)")
    parser.add_argument("--backends", nargs="*", choices=sorted(BACKENDS), default=list(BACKENDS), metavar="BACKEND",
                        help=f"backends to run each combination with (default: all: {', '.join(BACKENDS)})")
    parser.add_argument("--markdown", type=Path, help="write the results table to this markdown file")
    parser.add_argument("--logs", type=Path, help="folder for each run's full output")
    args = parser.parse_args(argv)
    command = "python scripts/integration_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = [(name, backend) for name in (args.only or COMBINATIONS) for backend in args.backends]
    results = []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, backend in tqdm(runs, desc="integration matrix", unit="run"):
            result = run(name, backend, args.steps, args.timeout, f"{tmp}/{name}-{backend}")
            results.append(result)
            tqdm.write(f"{name} [{backend}]: {result['outcome']} in {result['seconds']:.0f} s: {result['detail']}")
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{name}-{backend}.log").write_text(result["output"])
    if args.markdown is not None:
        table = "".join(
            f"| {r['name']} | {r['backend']} | {r['nproc']} | {r['outcome']} | {r['seconds']:.0f} | "
            f"{r['detail'].replace('|', '/')} |\n"
            for r in results
        )
        args.markdown.write_text(
            "# torchtitan 0.2.2's DeepSeek-V3 and Llama4 integration tests on CPU\n\n"
            "Generated by `scripts/integration_matrix.py` (see its docstring): each combination of\n"
            "torchtitan v0.2.2's `tests/integration_tests/models.py` for these models, run through\n"
            "`./run_train.sh` with its process count on a CPU (gloo), per EP backend, seq_len 64,\n"
            f"local batch 4, {args.steps} steps. *trains*: every step logged, exit 0 (losses shown);\n"
            "*refused*: one line before any process started, exit 2.\n\n"
            f"`{command}`\n\n"
            "| combination | backend | processes | outcome | seconds | losses or message |\n"
            "|---|---|---|---|---|---|\n" + table
        )
        print(f"results written to {args.markdown}")
    return 0 if all(r["outcome"] in ("trains", "refused") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
