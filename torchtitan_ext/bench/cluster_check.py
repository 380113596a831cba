"""The first check on a CUDA machine: the real deep_ep kernels against this harness, in one report.

    python -m torchtitan_ext.bench cluster_check [--report outputs/cluster_check.md] [--steps 10] [--skip-training]
    (that is: python -m torchtitan_ext.bench cluster_check [args], in the environment of ./run_train.sh)

On any machine it first prints what deep_ep needs there (the CUDA toolkit
for the kernels compiled at first use, NCCL >= 2.30.4 for V2, NVSHMEM, writable
kernel caches, the multi-node HybridEP prerequisites, pynvml, whether deep_ep
imports): one line each, "ok", "missing" with the fix, or "not checkable here".
Without CUDA it stops there (exit 0) and says what only a GPU node can tell. On
CUDA it then runs, and writes into one markdown report with those lines:

1. versions: torch, CUDA, NCCL, GPUs, deep_ep (its version and which of
   ``Buffer``, ``ElasticBuffer``, ``EPBuffer``, ``HybridEPBuffer`` it has, or why it cannot
   be imported);
2. the tests marked ``deep_ep`` and ``gpu`` (tests/ep/test_deep_ep.py): every
   backend the build serves against the dense MoE, pass / fail / skip with
   the reason;
3. ``python -m torchtitan_ext.bench ep`` in bf16 on all local GPUs (up to 8) for nccl and the
   backend variants whose deep_ep class the build has: medians and GB/s;
4. a short training run per backend variant through ``./run_train.sh`` on
   DeepSeek-V3 16B's shapes cut to 4 layers (flavour ``16B_4layers``,
   embedded corpus): losses and the median step time after 3 warm-up steps (metrics.jsonl).
"""

import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from torchtitan_ext.bench import ROOT
from torchtitan_ext.ep.backends import backend_variants, LIBRARY_VARIANTS as VARIANTS_OF_CLASS
from torchtitan_ext.records.metrics import read_metrics
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.jobs import JobResult, run_job

LIBRARY_VARIANTS = {library_class: variants[0] for library_class, variants in VARIANTS_OF_CLASS.items()}
"""deep_ep class -> the backend variant that runs on it in its default settings."""


def run(command: list[str], timeout: float, **env: str) -> JobResult:
    return run_job(command, cwd=ROOT, env={**os.environ, **env}, timeout_s=timeout, check=False)


def versions() -> tuple[list[str], list[str]]:
    """(report lines, the deep_ep classes available)."""
    import torch

    lines = [
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
        f"- GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
    ]
    from torchtitan_ext.ep.kernels import import_library, KernelUnavailable

    try:
        library = import_library()
    except KernelUnavailable as e:
        lines.append(f"- deep_ep: cannot be used: {e}")
        return lines, []
    classes = [name for name in LIBRARY_VARIANTS if hasattr(library, name)]
    lines.append(f"- deep_ep {getattr(library, '__version__', '(no __version__)')}: has {', '.join(classes) or 'none'}")
    return lines, classes


def tests() -> list[str]:
    result = run([sys.executable, "-m", "pytest", "-m", "deep_ep or gpu", "-rA", "-q", "tests/ep/test_deep_ep.py"],
                 3600)
    summary = [line for line in result.output.splitlines() if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))]
    return [f"exit status {result.returncode}", "", "```", *summary, result.output.strip().splitlines()[-1], "```"]


def bench(classes: list[str], gpus: int) -> list[str]:
    labels = ["nccl"] + [f"{LIBRARY_VARIANTS[name]}_lib" for name in classes]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "bench_ep.json"
        result = run([
            sys.executable, "-m", "torchtitan_ext.bench", "ep", "--nproc", str(gpus), "--tokens", "4096",
            "--hidden", "2048", "--experts", "64", "--top-k", "6", "--dtype", "bfloat16", "--backends", *labels,
            "--no-progress", "--json", str(rows_file),
        ], 3600)
        if result.returncode != 0:
            return [f"bench ep failed (exit {result.returncode}):", "", "```", result.output[-3000:], "```"]
        rows = json.loads(rows_file.read_text())["rows"]
    return ["| backend | tokens | EP | median ms | bare median ms | ratio | GB/s sent |", "|---|---|---|---|---|---|---|",
            *(f"| {r['backend']} | {r['tokens']} | {r['ep']} | {r['median_ms']:.2f} | {r['bare_median_ms']:.2f} | "
              f"{r['ratio']:.2f} | {r['gbps']:.2f} |"
              for r in rows)]


def training(classes: list[str], gpus: int, steps: int) -> list[str]:
    variants = ["nccl"] + [LIBRARY_VARIANTS[name] for name in classes]
    lines = ["| backend | exit | losses | median step time (s) |", "|---|---|---|---|"]
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            result = run([
                "./run_train.sh", "--job.config_file", "train_configs/deepseek_v3_16b.toml",
                "--model.flavor", "16B_4layers", "--model.hf_assets_path", "./assets/embedded",
                "--training.dataset", "stdlib_code", "--training.steps", str(steps), "--metrics.log_freq", "1",
                "--parallelism.expert_parallel_degree", str(gpus), "--job.dump_folder", tmp,
                *backend_variants()[variant],
            ], 3600, NGPU=str(gpus))
            logged = read_metrics(tmp)
        losses = " ".join(f"{row['loss_metrics/global_avg_loss']:.3f}" for row in logged)
        times = [row["time_metrics/end_to_end(s)"] for row in logged if row["step"] > 3]
        median = f"{statistics.median(times):.3f}" if times else "n/a"
        outcome = losses or result.output.strip().splitlines()[-1][-200:]
        lines.append(f"| {variant} | {result.returncode} | {outcome} | {median} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--report", type=Path, default=ROOT / "outputs" / "cluster_check.md",
                        help="markdown report to write (default: outputs/cluster_check.md)")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps of each backend's short run (default: 10)")
    parser.add_argument("--skip-training", action="store_true", help="run the kernel tests and benchmarks only")
    args = parser.parse_args(argv)
    import torch

    from torchtitan_ext.ep.kernels.prerequisites import machine_checks

    cuda = torch.cuda.is_available()
    checks = [f"- {check.requirement}: {check.status}: {check.detail}" for check in machine_checks(cuda)]
    print("check_cluster: what deep_ep needs on this machine", *checks, sep="\n")
    if not cuda:
        print("check_cluster: no CUDA device on this machine: the kernels, benchmarks and training are not checked "
              "(the CPU suite is ./test.sh)")
        return 0
    gpus = min(torch.cuda.device_count(), 8)
    version_lines, classes = versions()
    sections = [
        f"# Cluster check ({datetime.datetime.now():%Y-%m-%d %H:%M}, {os.uname().nodename})", "",
        "## Prerequisites", "", *checks, "",
        "## Versions", "", *version_lines, "",
        "## deep_ep conformance (tests/ep/test_deep_ep.py)", "", *tests(), "",
        f"## bench_ep: dispatch + combine, bf16, {gpus} GPUs", "", *bench(classes, gpus), "",
    ]
    if not args.skip_training:
        sections += [f"## Training: DeepSeek-V3 16B shapes, 4 layers, EP={gpus}, {args.steps} steps", "",
                     *training(classes, gpus, args.steps), ""]
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(sections))
    print(f"check_cluster: report written to {args.report}")
    print(json.dumps({"deep_ep_classes": classes, "gpus": gpus}))
    return 0
