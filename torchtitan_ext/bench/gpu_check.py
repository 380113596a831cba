"""The one-GPU check: what a CPU cannot show, run on one CUDA device in at most a few minutes.

    python -m torchtitan_ext.bench gpu_check [--out DIR] [--budget-s 330]

Stages, each reported whatever the others did (a stage past the time budget is skipped, said so):

1. the GPU tests (``pytest -m "deep_ep or gpu"``): every backend on CUDA at EP = 1, DeepEP and HybridEP on the
   reference kernels where the library is not built;
2. the device-cost ledger of one MoE call per backend at EP = 1 on CUDA against the same call on the CPU (the
   counts must be equal), the passes budgeted no host sync run under ``torch.cuda.set_sync_debug_mode("error")``;
3. bench ep on CUDA: each backend's dispatch and combine at EP = 1 (local work alone, no traffic);
4. a DeepSeek-V3-16B-shaped training step (flavour "16B_4layers"), ours against upstream torchtitan 0.2.2, as
   a ratio in one run;
5. torch.compile (inductor) of the debug model: two training steps.

Writes ``gpu_check.json`` into ``--out`` (docs/benchmarks.md, "The one-GPU check", quotes it).
"""

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torchtitan_ext

ROOT = Path(torchtitan_ext.__file__).resolve().parents[1]
VARIANTS = ("nccl", "deepep", "deepep_legacy", "hybridep", "hybridep_non_blocking")
MOE_SHAPE = dict(hidden_dim=2048, num_experts=64, top_k=6, max_tokens_per_rank=4096)
"""DeepSeek-V3 16B's MoE layer, at 4,096 tokens per rank."""


def _run(command: list[str], timeout: float) -> dict:
    """A command's status and the end of its output (a stage that starts its own processes)."""
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return {"status": result.returncode, "seconds": round(time.monotonic() - started, 1),
                "output": (result.stdout + result.stderr)[-6000:]}
    except subprocess.TimeoutExpired as e:
        return {"status": "timeout", "seconds": timeout, "output": str(e.output or "")[-6000:]}


def environment() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
            "date": time.strftime("%Y-%m-%d")}


def ledger_on_cuda_and_cpu() -> dict:
    """Per backend variant: the ledger counts of one MoE call on CUDA and on the CPU, and whether they agree."""
    import torch
    import torch.distributed as dist

    from torchtitan_ext.bench.ep import job_args
    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.planning.device_ledger import count_moe_call
    from torchtitan_ext.planning.local_traffic import MoECall
    from torchtitan_ext.training import prepare

    prepare()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cpu_group = dist.new_group([0], backend="gloo")
    shape = MoEShape(**MOE_SHAPE)
    results = {}
    try:
        for variant in VARIANTS:
            job_config = parse(job_args(variant))  # DeepEP and HybridEP on the reference kernels
            counted = {}
            for device, group in (("cuda", dist.group.WORLD), ("cpu", cpu_group)):
                call = MoECall.random(shape, shape.max_tokens_per_rank, torch.bfloat16)
                call = MoECall(call.x.to(device), call.scores.to(device), call.expert_ids.to(device))
                try:
                    costs = count_moe_call(job_config, shape, call, group, sync_debug=device == "cuda")
                    counted[device] = {phase: {"host_syncs": c.syncs, "collectives": c.collective_count(),
                                               "h2d_copies": sum(c.h2d_copies.values()),
                                               "kinds": sorted(k.split(" at ")[0] for k in c.host_syncs)}
                                       for phase, c in costs.items()}
                except Exception:  # a sync the count missed fails the CUDA pass: the finding to report
                    counted[device] = {"error": traceback.format_exc()[-1500:]}
            counted_both = all("error" not in counted[device] for device in counted)
            results[variant] = {**counted, "agree": counted_both and counted["cuda"] == counted["cpu"]}
    finally:
        dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder of gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stages past this many seconds are skipped")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA device: on a CPU the suite covers what runs here", file=sys.stderr)
        return 2
    started = time.monotonic()
    python = sys.executable
    stages = {
        "environment": lambda: environment(),
        "gpu tests": lambda: _run([python, "-m", "pytest", "-m", "deep_ep or gpu", "-rs", "-q", "-n", "0",
                                   "-p", "no:cacheprovider", "tests/ep/test_deep_ep.py"], 150),
        "ledger cuda vs cpu": lambda: _run([python, "-c", "import json; from torchtitan_ext.bench.gpu_check import "
                                            "ledger_on_cuda_and_cpu as f; print('LEDGER' + json.dumps(f()))"], 120),
        "bench ep": lambda: _run([python, "-m", "torchtitan_ext.bench", "ep", "--nproc", "1", "--tokens", "4096",
                                  "16384", "--hidden", "2048", "--experts", "64", "--top-k", "6", "--dtype",
                                  "bfloat16", "--warmup", "3", "--iters", "10", "--no-progress", "--backends",
                                  *VARIANTS, "upstream", "--json", str(args.out / "bench_ep.json")], 120),
        "16B step ours vs upstream": lambda: _run(
            [python, "-m", "torchtitan_ext.bench", "step", "--rounds", "2", "--steps", "6", "--warmup", "2",
             "--nproc", "1", "--config", "train_configs/deepseek_v3_16b.toml", "--no-progress",
             "--json", str(args.out / "bench_step.json"), "--",
             "--model.flavor", "16B_4layers", "--parallelism.expert_parallel_degree", "1",
             "--parallelism.expert_parallel_comm_backend", "nccl",
             "--training.dataset", "stdlib_code", "--model.hf_assets_path", "./assets/embedded",
             "--training.local_batch_size", "2", "--compile.no-enable"], 180),
        "inductor compile, debug model": lambda: _run(
            [python, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan_ext.train",
             "--job.config_file", "train_configs/debug_model.toml",
             "--parallelism.expert_parallel_degree", "1", "--training.steps", "2", "--compile.enable",
             "--compile.components", "model", "--job.dump_folder", str(args.out / "compiled")], 150),
    }
    report = {}
    for name, stage in stages.items():
        elapsed = time.monotonic() - started
        if elapsed > args.budget_s:
            report[name] = {"status": f"skipped: {elapsed:.0f} s spent of {args.budget_s:.0f}"}
            continue
        print(f"[gpu_check] {name} ({elapsed:.0f} s)", flush=True)
        try:
            report[name] = stage()
        except Exception:
            report[name] = {"status": "error", "output": traceback.format_exc()[-3000:]}
        print(json.dumps(report[name])[:3000], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"[gpu_check] done in {time.monotonic() - started:.0f} s; {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
