"""The one-GPU check: what a CPU cannot show, run on one CUDA device in at most a few minutes.

    python -m torchtitan_ext.bench gpu_check [--out DIR] [--budget-s 330] [--campaign FILE] [--dry-run]
        [--stages NAME ...]

Stages, each reported whatever the others did, each run within its own time limit and what is left of
``--budget-s`` (a stage stopped at the budget is reported so, not as failed; none starts once it is spent):

1. the environment: torch, CUDA, the device, the date;
2. the GPU tests (``pytest -m "deep_ep or gpu"``): every backend on CUDA at EP = 1, DeepEP and HybridEP on the
   reference kernels where the library is not built; the low-precision experts on torchao's GPU kernels (MXFP8 on
   sm100 against the independent reference, float8 on sm90 and newer); GPT-OSS's grouped experts with every host
   sync an error;
3. the device-cost ledger of one MoE call per backend at EP = 1 on CUDA against the same call on the CPU (the
   counts must be equal), the passes budgeted no host sync run under ``torch.cuda.set_sync_debug_mode("error")``;
   and so for the same call of a job with a replica slot on every backend (its split and its replicas' fetch
   and return too);
4. a CUDA-graph capture of one MoE call's forward for each backend whose budget claims a sync-free layer (no host
   sync, no host-to-device copy), replayed against the same call run eagerly;
   then two training steps of Qwen3-MoE's debug config, and of GPT-OSS's with its model and loss compiled
   (FlexAttention on the GPU), each at EP = 1;
5. the replica slots' weight concatenation against the routed experts' GEMMs at DeepSeek-V3 671B's shape on one
   rank at EP = 64 (forward and backward, median milliseconds, in one process); and the replicas' per-step split in
   one Triton kernel against its rounds of operators (equal quotas, device milliseconds of each);
6. bench ep on CUDA: each backend's dispatch and combine at EP = 1 (local work alone, no traffic);
7. a DeepSeek-V3-16B-shaped training step (flavour "16B_4layers"), ours against upstream torchtitan 0.2.2, as
   a ratio in one run;
8. torch.compile (inductor) of the debug model: two training steps.

Writes ``gpu_check.json`` into ``--out`` after each stage (a check stopped from outside keeps what finished),
prints a table of the stages, and with ``--campaign`` writes the stages' results as a new campaign file under
``benchmarks/``. Exits 1 when a stage failed (a non-zero status or its time limit), 0 when every stage that ran
passed. ``--dry-run`` prints the stages' commands without running them (any machine). Runs as ``python -m
torchtitan_ext.bench.gpu_check`` too.
"""

import json
import re
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from torchtitan_ext.bench import ROOT
from torchtitan_ext.ep.backends import CPU_VARIANTS
from torchtitan_ext.records.campaign import bench_command, check_new_campaign_path, write_campaign
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import run_and_exit
from torchtitan_ext.runtime.jobs import JobFailed, run_job

VARIANTS = CPU_VARIANTS
"""Every variant the reference kernels run (on a GPU without deep_ep, they run there)."""
MOE_SHAPE = dict(hidden_dim=2048, num_experts=64, top_k=6, max_tokens_per_rank=4096)
REPLICATED_JOB = ("--job.config_file", "train_configs/debug_model.toml", "--parallelism.expert_parallel_degree", "2",
                  "--expert_replication.slots_per_rank", "1")
"""The replicated job counted (its model gives the replicas' expert size; the group is this process alone)."""
"""DeepSeek-V3 16B's MoE layer, at 4,096 tokens per rank."""
RESULT = "RESULT "
"""Prefix of the one line a function stage prints its result on."""


@dataclass(frozen=True)
class Stage:
    name: str
    command: list[str]
    timeout_s: float


def _function_stage(name: str, function: str, timeout_s: float) -> Stage:
    """A stage that runs ``function`` of this module in its own process and prints its result as JSON."""
    code = f"import json; from {__name__} import {function} as f; print({RESULT!r} + json.dumps(f()))"
    return Stage(name, [sys.executable, "-c", code], timeout_s)


def stages(out: Path) -> list[Stage]:
    python = sys.executable
    return [
        _function_stage("environment", "environment", 60),
        Stage("gpu tests", [python, "-m", "pytest", "-m", "deep_ep or gpu", "-k", "not real_nccl_ep", "-rs", "-q", "-n",
                            "0", "-p", "no:cacheprovider", "tests/ep/test_deep_ep.py",
                            "tests/models/test_low_precision_experts.py", "tests/ep/test_experts.py"], 240),
        # the wheel where installed (nothing is installed at run time): skipped with the import's own message else
        Stage("ncclep on nccl.ep", [python, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-n", "0", "-p", "no:cacheprovider",
                                    "tests/ep/test_deep_ep.py::test_real_nccl_ep_matches_dense_moe"], 180),
        _function_stage("ledger cuda vs cpu", "ledger_on_cuda_and_cpu", 240),
        _function_stage("cuda graph capture", "cuda_graph_capture", 120),
        # the families a CPU trains on other kernels: torchtitan's grouped GEMMs, and GPT-OSS's FlexAttention compiled
        # with its blocks (on a CPU its attention runs eagerly on another kernel)
        _debug_steps("qwen3-moe debug steps", "qwen3_moe_debug_model.toml", out),
        _debug_steps("gpt-oss compiled debug steps", "gpt_oss_debug_model.toml", out,
                     "--compile.enable", "--compile.components", "model,loss"),
        _function_stage("replica weights copy", "replica_copy_cost", 90),
        _function_stage("replica split in one kernel", "replica_split_kernel", 120),
        Stage("bench ep", [python, "-m", "torchtitan_ext.bench", "ep", "--nproc", "1", "--tokens", "4096", "16384",
                           "--hidden", "2048", "--experts", "64", "--top-k", "6", "--dtype", "bfloat16", "--warmup",
                           "3", "--iters", "10", "--no-progress", "--backends", *VARIANTS, "upstream", "--json",
                           str(out / "bench_ep.json")], 240),  # one process per backend took 25-45 s on an H100
        Stage("16B step ours vs upstream", [
            python, "-m", "torchtitan_ext.bench", "step", "--rounds", "2", "--steps", "16", "--warmup", "2",
            "--nproc", "1", "--config", "train_configs/deepseek_v3_16b.toml", "--no-progress",
            "--json", str(out / "bench_step.json"), "--",
            "--model.flavor", "16B_4layers", "--parallelism.expert_parallel_degree", "1",
            "--parallelism.expert_parallel_comm_backend", "nccl",
            "--training.dataset", "stdlib_code", "--model.hf_assets_path", "./assets/embedded",
            "--training.local_batch_size", "2", "--compile.no-enable"], 300),
        _debug_steps("inductor compile, debug model", "debug_model.toml", out, "--compile.enable",
                     "--compile.components", "model"),
    ]


def _debug_steps(name: str, config: str, out: Path, *extra: str) -> Stage:
    """Two training steps of a shipped debug config on one GPU (EP = 1: the model and trainer, no EP backend)."""
    return Stage(name, [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan_ext.train",
        "--job.config_file", f"train_configs/{config}", "--parallelism.expert_parallel_degree", "1",
        "--training.steps", "2", "--job.dump_folder", str(out / config.removesuffix(".toml")), *extra], 150)


def _run(stage: Stage) -> dict:
    """A stage's status, seconds, the end of its output and, for a function stage, its result."""
    # the one job launcher: a stage stopped at its limit is stopped with every process it started (torchrun's
    # workers would hold the GPU through the next stages)
    try:
        result = run_job(stage.command, cwd=ROOT, timeout_s=stage.timeout_s, check=False, grace_s=5.0)
    except JobFailed as e:
        return {"status": "timeout", "seconds": stage.timeout_s, "output": e.result.output[-6000:]}
    report = {"status": result.returncode, "seconds": round(result.seconds, 1), "output": result.output[-6000:]}
    stdout = result.output
    results = [line.removeprefix(RESULT) for line in stdout.splitlines() if line.startswith(RESULT)]
    if results:
        report["result"] = json.loads(results[-1])
    return report


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*|E\s+)?[\w.]*(Error|Exception|Failed)\b.*:")
"""The line of a traceback that says what failed (torchrun prefixes it with the rank, pytest with "E")."""

RESULT_LINES = re.compile(r"\b(passed|failed|ratio)\b|\bstep:\s+\d+|\| \w+ \|")
"""Lines that carry a stage's result in its output: pytest's tally, bench's ratio, a training step, a table row."""


def _leaves(result: dict) -> str:
    """A function stage's result in a line: its values, or each variant's flags (agree, captured,
    replay_equals_eager), errors' last lines and why a variant was skipped."""
    if not all(isinstance(found, dict) for found in result.values()):
        return ", ".join(f"{key} {value}" for key, value in result.items())
    parts = []
    for variant, found in result.items():
        flags = [f"{key}={value}" for key, value in found.items() if isinstance(value, bool)]
        errors = [f"{'skipped: ' if key == 'skipped' else ''}{str(value).strip().splitlines()[-1]}"
                  for key, value in found.items() if key in ("error", "skipped")]
        parts.append(f"{variant}: {', '.join(flags + errors)}")
        parts += [f"{variant} {device}: {found[device]['error'].strip().splitlines()[-1]}" for device in ("cuda", "cpu")
                  if isinstance(found.get(device), dict) and "error" in found[device]]
    return "; ".join(parts)


def summary(report: dict) -> str:
    """One line of a stage's report for the markdown table: its result's flags, else the output's line that says
    what failed (a failed stage) or its last result line, else its last line."""
    if "result" in report:
        return _leaves(report["result"])[:400]
    output = re.sub(r"\x1b\[[0-9;]*m", "", str(report.get("output", "")))  # the trainer's colours
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    failed = report.get("status") != 0 and [line for line in lines if ERROR_LINE.match(line)]
    picked = failed or [line for line in lines if RESULT_LINES.search(line)] or lines
    return picked[-1][:300] if picked else ""


def environment() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
            "date": time.strftime("%Y-%m-%d")}


def ledger_on_cuda_and_cpu() -> dict:
    """Per backend variant, without and with expert replication ("nccl with replicas"): the ledger counts of one MoE
    call on CUDA and on the CPU, and whether they agree (where the budget claims no host sync, a sync in the split
    or the replicas' transfers fails the CUDA pass)."""
    import torch
    import torch.distributed as dist

    from torchtitan_ext.measuring.ep_variants import job_args
    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.ep.replication.plan import dispatched_shape
    from torchtitan_ext.measuring.device_ledger import count_moe_call
    from torchtitan_ext.planning.local_traffic import MoECall
    from torchtitan_ext.training import prepare

    prepare()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cpu_group = dist.new_group([0], backend="gloo")
    shape = MoEShape(**MOE_SHAPE)
    results = {}
    try:
        jobs = [(variant, job_args(variant)) for variant in VARIANTS]  # DeepEP and HybridEP on the reference kernels
        jobs += [(f"{variant} with replicas", [*REPLICATED_JOB, *job_args(variant)]) for variant in VARIANTS]
        for variant, args in jobs:
            job_config = parse(args)
            counted = {}
            for device, group in (("cuda", dist.group.WORLD), ("cpu", cpu_group)):
                # tokens pick logical experts; under replication the split sends them to copies
                call = MoECall.random(shape, shape.max_tokens_per_rank, torch.bfloat16)
                call = MoECall(call.x.to(device), call.scores.to(device), call.expert_ids.to(device))
                try:
                    costs = count_moe_call(job_config, dispatched_shape(job_config, shape), call, group,
                                           sync_debug=device == "cuda")
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


def graph_capturable_variants() -> list[str]:
    """The variants whose budget claims a sync-free MoE layer: no host sync and no host-to-device copy in either
    pass (what a CUDA graph can hold)."""
    from torchtitan_ext.measuring.ep_variants import job_args
    from torchtitan_ext.config import parse
    from torchtitan_ext.ep import backend_class

    capturable = []
    for variant in VARIANTS:
        job_config = parse(job_args(variant))
        budget = backend_class(job_config).device_budget(job_config)
        if all(p.host_syncs == 0 and p.h2d_copies == 0 for p in (budget.forward, budget.backward)):
            capturable.append(variant)
    return capturable


def cuda_graph_capture() -> dict:
    """Per sync-free variant: one MoE call's forward (dispatch and combine, the experts as the identity) captured in
    a CUDA graph, replayed, and compared with the same call run eagerly. A backend whose CPU kernels sync the host
    (NCCL EP's double) is captured on its library, or skipped with the reason the library cannot run here."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from torchtitan_ext.measuring.ep_variants import job_args, LIBRARY
    from torchtitan_ext.config import MoEShape, parse
    from torchtitan_ext.ep import backend_class
    from torchtitan_ext.planning.local_traffic import backend_forward, MoECall
    from torchtitan_ext.training import prepare

    def landed(out):
        return out.trigger_wait() if isinstance(out, AsyncCollectiveTensor) else out

    prepare()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    shape = MoEShape(**MOE_SHAPE)
    results = {}
    try:
        for variant in graph_capturable_variants():
            backend = backend_class(parse(job_args(variant)))
            if backend.reference_syncs_host and backend.library_unavailable_reason():
                results[variant] = {"captured": None, "skipped": f"its CPU kernels sync the host, and its library "
                                                                 f"cannot run here: {backend.library_unavailable_reason()}"}
                continue
            job_config = parse(job_args(variant + LIBRARY if backend.reference_syncs_host else variant))
            style = backend_class(job_config).layer_factory(job_config, shape)(score_before_experts=False)
            call = MoECall.random(shape, shape.max_tokens_per_rank, torch.bfloat16)
            call = MoECall(call.x.cuda(), call.scores.cuda(), call.expert_ids.cuda())
            try:
                eager = landed(backend_forward(style, call, shape)).clone()
                side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    landed(backend_forward(style, call, shape))
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = landed(backend_forward(style, call, shape))
                graph.replay()
                torch.cuda.synchronize()
                results[variant] = {"captured": True, "replay_equals_eager": bool(torch.equal(captured, eager))}
            except Exception:
                results[variant] = {"captured": False, "error": traceback.format_exc()[-1500:]}
    finally:
        dist.destroy_process_group()
    return results


REPLICA_SHAPE = dict(dim=7168, hidden_dim=2048, home_experts=4, slots=2, rows=4 * 4096 * 8)
"""DeepSeek-V3 671B's routed experts on one rank of train_configs/deepseek_v3_671b_gb200.toml (EP=64: 4 home
experts) with 2 replica slots, and the rows that job's 4 x 4,096 tokens per rank route at top-8."""


def replica_copy_cost(iters: int = 10) -> dict:
    """Milliseconds (median of ``iters`` after warm-up) of the routed experts' forward and backward (the rows' and
    the weights' gradients) at :data:`REPLICA_SHAPE` in bf16, with the replica slots' weights built as
    ``ExpertsWithReplicas`` builds them (the home experts concatenated with the fetched slots), against the same
    grouped GEMMs on weights that are already one tensor; and the concatenation's forward alone. The rows are
    spread evenly over the L + S groups (the remainder dropped)."""
    import torch
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    from torchtitan_ext.ep.replication.experts import weights_with_replicas

    shape = REPLICA_SHAPE
    experts = shape["home_experts"] + shape["slots"]
    torch.cuda.set_device(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    up, down = (shape["hidden_dim"], shape["dim"]), (shape["dim"], shape["hidden_dim"])
    sizes = [up, down, up]  # w1, w2, w3
    home = [(torch.randn(shape["home_experts"], *size, device=device, dtype=dtype) * 0.02).requires_grad_()
            for size in sizes]
    fetched = (torch.randn(shape["slots"], sum(a * b for a, b in sizes), device=device, dtype=dtype) * 0.02
               ).requires_grad_()
    whole = [(torch.randn(experts, *size, device=device, dtype=dtype) * 0.02).requires_grad_() for size in sizes]
    counts = torch.full((experts,), shape["rows"] // experts, device=device, dtype=torch.int64)
    x = torch.randn(int(counts.sum()), shape["dim"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    leaves = [*home, fetched, *whole, x]

    def with_copy():
        _run_experts_grouped_mm(*weights_with_replicas(home, fetched, shape["slots"]), x, counts).backward(grad)

    def without_copy():
        _run_experts_grouped_mm(*whole, x, counts).backward(grad)

    def copy_alone():
        with torch.no_grad():
            weights_with_replicas(home, fetched, shape["slots"])

    def median_ms(step) -> float:
        for _ in range(3):
            step()
        times = []
        for _ in range(iters):
            for leaf in leaves:  # as a training step's gradients start (set to None): no accumulation timed
                leaf.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return round(statistics.median(times), 3)

    # interleaved, so clocks and the allocator's state are shared between the arms
    timed = {name: [] for name in ("with_copy_ms", "without_copy_ms", "copy_alone_ms")}
    for _ in range(3):
        for name, step in zip(timed, (with_copy, without_copy, copy_alone)):
            timed[name].append(median_ms(step))
    result = {name: statistics.median(values) for name, values in timed.items()}
    result["rows"] = x.shape[0]
    result["copied_mb"] = round(sum(w.numel() for w in whole) * 2 / 1e6, 1)
    result["with_over_without"] = round(result["with_copy_ms"] / result["without_copy_ms"], 4)
    return result


def replica_split_kernel(iters: int = 20) -> dict:
    """Per shape of ``bench replica_split``: whether the split in one Triton kernel on CUDA equals the rounds'
    operators on the CPU (the stage fails where it does not), and the device milliseconds (median of ``iters`` after warm-up) of each path on CUDA."""
    import numpy as np
    import torch

    from torchtitan_ext.bench.replica_split import SHAPES
    from torchtitan_ext.ep.replication.choice import choose_replicas
    from torchtitan_ext.ep.replication.split import split_quotas, SplitTables

    torch.cuda.set_device(0)
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    result = {}
    for ep, experts, slots in SHAPES:
        popularity = 1 / np.arange(1, experts + 1) ** 0.8
        chosen_from, step = (torch.tensor(rng.multinomial(experts * 512, popularity / popularity.sum())) for _ in range(2))
        plan = choose_replicas(chosen_from.tolist(), ep, slots)
        on_host = split_quotas(step, SplitTables(plan, torch.device("cpu")))
        tables, counts = SplitTables(plan, device), step.to(device)

        def median_ms(in_one_kernel: bool) -> float:
            for _ in range(3):
                split_quotas(counts, tables, in_one_kernel=in_one_kernel)
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                split_quotas(counts, tables, in_one_kernel=in_one_kernel)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return round(statistics.median(times), 4)

        result[f"ep{ep}_experts{experts}_slots{slots}"] = {
            "equal": bool(torch.equal(split_quotas(counts, tables).cpu(), on_host)),
            "one_kernel_ms": median_ms(True), "operators_ms": median_ms(False)}
    if not all(shape["equal"] for shape in result.values()):
        raise AssertionError(f"the split in one kernel differs from the rounds' operators: {result}")
    return result


def stage_table(report: dict) -> str:
    """The stages as a markdown table: status, seconds, and the result or what failed."""
    return ("| stage | status | seconds | result or last line |\n|---|---|---|---|\n"
            + "".join(f"| {name} | {r['status']} | {r.get('seconds', '')} | {summary(r).replace('|', '/')} |\n"
                      for name, r in report.items()))


def campaign_rows(report: dict) -> list[dict]:
    return [{"stage": name, "status": r["status"], "seconds": r.get("seconds"), "summary": summary(r),
             "result": r.get("result")} for name, r in report.items()]


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder of gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="seconds for every stage together: each runs within what is left of them")
    parser.add_argument("--campaign", type=Path, help="also write the stages' results as a new campaign file "
                                                      "(benchmarks/THEME_HARDWARE_DATE.jsonl)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages' commands, run nothing")
    parser.add_argument("--stages", nargs="+", metavar="NAME",
                        help="run only these stages (names as --dry-run prints them; the environment always runs)")
    args = parser.parse_args(argv)
    if args.campaign is not None:
        check_new_campaign_path(args.campaign)
    args.out = args.out.resolve()  # the stages run in the repository's root
    names = [stage.name for stage in stages(args.out)]
    unknown = sorted(set(args.stages or ()) - set(names))
    if unknown:
        parser.error(f"--stages: no stage {', '.join(map(repr, unknown))}; the stages: {', '.join(map(repr, names))}")
    chosen = [stage for stage in stages(args.out)
              if not args.stages or stage.name in args.stages or stage.name == "environment"]
    if args.dry_run:
        for stage in chosen:
            print(f"{stage.name} (at most {stage.timeout_s:.0f} s): {shlex.join(stage.command)}")
        print(f"cuda graph capture covers: {', '.join(graph_capturable_variants()) or 'no backend'}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA device (--dry-run prints what it runs): on a CPU the suite covers what "
              "runs here", file=sys.stderr)
        return 2
    command = bench_command("gpu_check", argv)
    started = time.monotonic()
    report = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in chosen:
        elapsed = time.monotonic() - started
        left = args.budget_s - elapsed
        if left < 1:
            report[stage.name] = {"status": f"skipped: {elapsed:.0f} s spent of {args.budget_s:.0f}"}
        else:
            print(f"[gpu_check] {stage.name} ({elapsed:.0f} s)", flush=True)
            report[stage.name] = _run(replace(stage, timeout_s=min(stage.timeout_s, left)))
            if report[stage.name]["status"] == "timeout" and left < stage.timeout_s:
                report[stage.name]["status"] = f"stopped at the budget: {args.budget_s:.0f} s spent"
            print(json.dumps(report[stage.name])[:3000], flush=True)
        write_report(report, args.out / "gpu_check.json")
    print(stage_table(report))
    if args.campaign is not None:
        write_campaign(args.campaign, [command], campaign_rows(report))
    failed = [name for name, stage_report in report.items() if stage_failed(stage_report)]
    print(f"[gpu_check] done in {time.monotonic() - started:.0f} s; {args.out / 'gpu_check.json'}"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


def stage_failed(report: dict) -> bool:
    """Whether a stage that ran failed: a non-zero exit or its time limit (a skipped stage did not run)."""
    status = report["status"]
    return status == "timeout" or (isinstance(status, int) and status != 0)


def write_report(report: dict, path: Path) -> None:
    """``report`` as JSON at ``path``, replaced whole (a reader never sees half a file)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)


if __name__ == "__main__":
    run_and_exit(main)
