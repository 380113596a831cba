"""Training step time: torchtitan_ext's nccl backend against upstream torchtitan's ExpertParallel.

    python -m torchtitan_ext.bench step --rounds 3 --steps 8 --warmup 2 [--nproc 2] [--config FILE]
        [--json FILE] [--campaign FILE] [-- job overrides]

Trains the same job (default: the DeepSeek-V3 debug model, EP=2, same seed and data) on ``--nproc`` processes
(gloo on CPU, NCCL with one GPU each on CUDA) through upstream torchtitan 0.2.2's own train spec (its parallelize
plan and ExpertParallel) and through ours (``nccl`` backend), alternating runs: A B A B ... Each run trains
``--steps`` steps; the first ``--warmup`` of each are not timed. Reports the median step time (the slowest
rank's) of each and the ratio ours / upstream. Both get the same CPU runtime accommodations, so the ratio isolates
the EP path and everything our spec changes. Results go to ``--json``, and the step times
to a new campaign file with ``--campaign`` (:mod:`torchtitan_ext.records.campaign`).
"""

import gc
import json
import os
import statistics
import tempfile
import time

from torchtitan_ext.bench import ROOT
from torchtitan_ext.measuring.timing import (
    add_timed_run_arguments, DEADLINE_S, parse_timed_run_arguments, progress_bar, workers_device,
)
from torchtitan_ext.records.campaign import bench_command, write_campaign
from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.workers import run_workers

OURS = "ext_deepseek_v3"
"""Our DeepSeek-V3 spec, registered under another name so that "deepseek_v3" stays upstream's."""


def _worker(rank: int, world_size: int, args, dump_folder: str) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torchtitan.protocols.train_spec import register_train_spec

    from torchtitan_ext import runtime
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.data import prepare_embedded_assets, register_embedded_dataset
    from torchtitan_ext.training.specs import train_spec
    from torchtitan_ext.training.trainer import Trainer

    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: the trainer's device
    os.chdir(ROOT)  # the job config's relative paths (assets, dataset)
    # not training.prepare(): "deepseek_v3" must stay upstream torchtitan's spec, ours runs under OURS
    device_type = runtime.configure()
    register_embedded_dataset()
    if device_type == "cpu":
        runtime.keep_freed_memory_in_heap()  # both variants alike; see docs/benchmarks.md, "What they found"
    register_train_spec(OURS, train_spec("deepseek_v3"))
    _share_our_flavors()
    times = {"upstream": [], "ours": []}
    progress = progress_bar(rank, not args.no_progress, total=2 * args.rounds * args.steps, desc="bench step",
                            unit="step")
    for _ in range(args.rounds):
        for variant, model_name in (("upstream", "deepseek_v3"), ("ours", OURS)):
            job_config = load_job_config(
                ["--job.config_file", str(ROOT / args.config), "--model.name", model_name,
                 "--training.steps", str(args.steps), "--metrics.log_freq", str(10**6),
                 "--job.dump_folder", f"{dump_folder}/{variant}", *args.overrides],
                device_type, world_size,
            )
            prepare_embedded_assets(job_config)
            trainer = Trainer(job_config)
            data = trainer.batch_generator(trainer.dataloader)
            for step in range(1, args.steps + 1):
                trainer.step = step
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step(data)
                if device_type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device_type)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step > args.warmup:
                    times[variant].append(float(elapsed))
                if progress:
                    progress.update(1)
            trainer.close()
            # the next run's model is built only once this one's is freed: two 16B-shaped trainers overflow an H100
            del trainer, data
            gc.collect()
            if device_type == "cuda":
                torch.cuda.empty_cache()
    if progress:
        progress.close()
    return times


def _share_our_flavors() -> None:
    """Our DeepSeek-V3 flavours upstream lacks ("16B_4layers", "debugmodel_small", ...) added to upstream's, as its
    own model args, so that both variants train one model."""
    import dataclasses

    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs

    from torchtitan_ext.models.deepseek_v3 import flavors

    for name, args in flavors().items():
        if name not in deepseekv3_args:
            deepseekv3_args[name] = DeepSeekV3ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--nproc", type=int, default=2, help="processes (the debug job's EP degree is 2)")
    add_timed_run_arguments(parser, rounds=3, alternated="upstream/ours", overridden="both variants")
    args = parse_timed_run_arguments(parser, argv)
    command = bench_command("step", argv)
    with tempfile.TemporaryDirectory() as dump_folder:
        times = run_workers(args.nproc, _worker, args, dump_folder, device=workers_device(), deadline_s=DEADLINE_S,
                            preload=[__name__])[0]
    upstream, ours = statistics.median(times["upstream"]), statistics.median(times["ours"])
    ratio = ours / upstream
    print(f"step time median: upstream {upstream:.3f} s, ours {ours:.3f} s, ratio {ratio:.3f} "
          f"({len(times['ours'])} steps each)")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "times": times, "ratio": ratio}, indent=2))
    if args.campaign is not None:
        rows = [{"variant": variant, "step_s": t} for variant in ("upstream", "ours") for t in times[variant]]
        write_campaign(args.campaign, [command], [*rows, {"table": "summary", "ratio_ours_over_upstream_median": ratio}])
    return 0
