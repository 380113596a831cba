"""Training step time: torchtitan_ext's nccl backend against upstream torchtitan's ExpertParallel.

    python scripts/bench_step.py --rounds 3 --steps 8 --warmup 2

Runs the same DeepSeek-V3 debug job (train_configs/debug_model.toml: EP=2,
same seed and data) in 2 CPU processes through upstream torchtitan 0.2.2's
own train spec (its parallelize plan and ExpertParallel) and through ours
(``nccl`` backend), alternating runs: A B A B ... Each run trains ``--steps``
steps; the first ``--warmup`` of each run are dropped. Reports the median step
time of each and the ratio ours / upstream. Both runs get the same CPU
runtime accommodations (torchtitan_ext.runtime), so the ratio isolates the EP
path and everything our spec changes.

Results go to ``--json`` and are appended to ``--markdown`` (where one is
given) with the command line and the machine.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OURS = "ext_deepseek_v3"
"""Our DeepSeek-V3 spec, registered under another name so that "deepseek_v3" stays upstream's."""


def _worker(rank, world_size, rendezvous, args, result_file):
    import torch
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(ROOT)
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for each rank
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    from torchtitan.protocols.train_spec import register_train_spec

    from torchtitan_ext import runtime
    from torchtitan_ext.config import load_job_config
    from torchtitan_ext.data import prepare_embedded_assets, register_embedded_dataset
    from torchtitan_ext.training.specs import train_spec
    from torchtitan_ext.training.trainer import Trainer

    # not training.prepare(): "deepseek_v3" must stay upstream torchtitan's spec, ours runs under OURS
    runtime.configure()
    register_embedded_dataset()
    runtime.keep_freed_memory_in_heap()  # both variants alike; see docs/benchmarks.md
    register_train_spec(OURS, train_spec("deepseek_v3"))
    times = {"upstream": [], "ours": []}
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=2 * args.rounds * args.steps, desc="bench_step", unit="step")
    for _ in range(args.rounds):
        for variant, model_name in (("upstream", "deepseek_v3"), ("ours", OURS)):
            job_config = load_job_config(
                ["--job.config_file", str(ROOT / args.config), "--model.name", model_name,
                 "--training.steps", str(args.steps), "--metrics.log_freq", str(10**6),
                 "--job.dump_folder", str(Path(result_file).parent / variant), *args.overrides],
                "cpu", world_size,
            )
            prepare_embedded_assets(job_config)
            trainer = Trainer(job_config)
            data = trainer.batch_generator(trainer.dataloader)
            for step in range(1, args.steps + 1):
                trainer.step = step
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step(data)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step > args.warmup:
                    times[variant].append(float(elapsed))
                if progress:
                    progress.update(1)
            trainer.close()
    if progress:
        progress.close()
    if rank == 0:
        Path(result_file).write_text(json.dumps(times))
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--rounds", type=int, default=3, help="alternations upstream/ours")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="append the results, with the command and the machine, to this markdown file (e.g. docs/benchmarks.md)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("overrides", nargs="*", help="config overrides for both variants (after --)")
    args = parser.parse_args(argv)
    command = "python scripts/bench_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "times.json"
        mp.spawn(_worker, args=(2, f"{tmp}/rendezvous", args, str(result_file)), nprocs=2)
        times = json.loads(result_file.read_text())
    upstream, ours = statistics.median(times["upstream"]), statistics.median(times["ours"])
    ratio = ours / upstream
    print(f"step time median: upstream {upstream:.3f} s, ours {ours:.3f} s, ratio {ratio:.3f} "
          f"({len(times['ours'])} steps each)")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "times": times, "ratio": ratio}, indent=2))
    if args.markdown is not None:
        from bench_ep import machine

        with open(args.markdown, "a") as f:
            f.write(
                f"\n### bench_step ({time.strftime('%Y-%m-%d')})\n\n`{command}`\n\n"
                f"Machine: {machine()}. DeepSeek-V3 debug model, EP=2, 2 processes, same seed and data; "
                f"runs alternate upstream / ours; medians over {len(times['ours'])} timed steps each.\n\n"
                "| variant | min s | median s | max s |\n|---|---|---|---|\n"
                + "".join(
                    f"| {name} | {min(values):.3f} | {statistics.median(values):.3f} | {max(values):.3f} |\n"
                    for name, values in (("upstream torchtitan ExpertParallel", times["upstream"]),
                                         ("torchtitan_ext nccl", times["ours"]))
                )
                + f"\nRatio ours / upstream (medians): **{ratio:.3f}**\n"
            )
        print(f"results appended to {args.markdown}")
    return ratio


if __name__ == "__main__":
    main()
