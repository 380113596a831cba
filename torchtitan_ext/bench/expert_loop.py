"""The routed experts' per-expert loop, forward and backward: torchtitan's against each expert's weights unbound.

    python -m torchtitan_ext.bench expert_loop [--experts 4,6,8,16] [--rows 3072] [--dim 256] [--hidden 1024]
        [--rounds 8]

One thread, fp32, the rows spread evenly over the experts (the defaults: one rank's rows of one MoE layer of
``debugmodel_wide_experts`` at 1,024 tokens per rank and EP=2), the gradients of the weights and of the rows.
Each round runs both loops on the same weights and rows, in turn, the first of them alternating; the table
gives each loop's median over the rounds after the first two, and their ratio.
The loop is what a CPU, or a GPU below SM90, runs for the routed experts
(:mod:`torchtitan_ext.ep.experts`).
"""

import argparse
import statistics
import time

import torch
from torchtitan.models.moe.moe import _run_experts_for_loop
from tqdm import tqdm

from torchtitan_ext.ep.experts import run_experts_for_loop
from torchtitan_ext.runtime.command_line import CommandLineParser

WARMUP_ROUNDS = 2


def _seconds(loop, weights: list[torch.Tensor], rows: torch.Tensor, counts: torch.Tensor,
             gradient: torch.Tensor) -> float:
    for tensor in (*weights, rows):
        tensor.grad = None
    began = time.perf_counter()
    loop(*weights, rows, counts).backward(gradient)
    return time.perf_counter() - began


def _expert_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text}: use expert counts >= 1, comma separated")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--experts", type=_expert_counts, default=[4, 6, 8, 16],
                        help="local experts (comma separated, each >= 1)")
    parser.add_argument("--rows", type=int, default=3072, help="rows of all the experts together")
    parser.add_argument("--dim", type=int, default=256, help="the model's hidden size")
    parser.add_argument("--hidden", type=int, default=1024, help="each expert's hidden size")
    parser.add_argument("--rounds", type=int, default=8, help=f"rounds (the first {WARMUP_ROUNDS} are warm-up)")
    args = parser.parse_args(argv)
    if min(args.rows, args.dim, args.hidden) < 1 or args.rounds <= WARMUP_ROUNDS:
        parser.error(f"--rows, --dim, --hidden: use at least 1; --rounds: more than {WARMUP_ROUNDS}")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    loops = {"torchtitan's loop": _run_experts_for_loop, "unbound": run_experts_for_loop}
    table = []
    for experts in tqdm(args.experts, desc="expert counts"):
        weights = [torch.randn(experts, *shape, generator=generator, requires_grad=True)
                   for shape in ((args.hidden, args.dim), (args.dim, args.hidden), (args.hidden, args.dim))]
        rows = torch.randn(args.rows, args.dim, generator=generator, requires_grad=True)
        counts = torch.full((experts,), args.rows // experts)
        counts[: args.rows % experts] += 1
        gradient = torch.randn(args.rows, args.dim, generator=generator)
        times = {name: [] for name in loops}
        for round_index in range(args.rounds):
            # each loop first in every other round: neither always runs on what the other left in the caches
            for name in sorted(loops, reverse=bool(round_index % 2)):
                times[name].append(_seconds(loops[name], weights, rows, counts, gradient))
        medians = [statistics.median(seconds[WARMUP_ROUNDS:]) * 1e3 for seconds in times.values()]
        megabytes = sum(weight[0].numel() for weight in weights) * 4 / 1e6
        table.append(f"| {experts} | {megabytes:.1f} | {medians[0]:.1f} | {medians[1]:.1f} | "
                     f"{medians[1] / medians[0]:.3f} |")
    print(f"{args.rows:,} rows of {args.dim}, experts of hidden {args.hidden}, fp32, one thread, medians of "
          f"{args.rounds - WARMUP_ROUNDS} rounds")
    print("| local experts | MB per expert (3 projections) | torchtitan's loop, fwd + bwd (ms) | unbound (ms) | "
          "unbound / torchtitan's |")
    print("|---|---|---|---|---|")
    print("\n".join(table))
    return 0
