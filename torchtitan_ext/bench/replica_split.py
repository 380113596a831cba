"""Expert replication's host work at scale: the per-step split's operators and time per MoE layer, and the choice
of every layer's replicas.

    python -m torchtitan_ext.bench replica_split [--calls 20]

For EP degrees up to DeepSeek-V3's 256 experts at EP=64, 1 and 2 slots per
rank, counts drawn from a Zipf 0.8 popularity (512 pairs per expert on
average), replicas chosen from them: counts the tensor operators one
``split_quotas`` call dispatches on the host's path (on a GPU each would be
at least one kernel launch, so their number bounds the split's time from
below at a few microseconds each) and times the call on this CPU, one
thread; and the launches of a GPU's path, which runs the split in one
Triton kernel (its operators and the kernel, counted without running it). Then times,
at DeepSeek-V3 671B's 58 MoE layers, what the trainer does between steps
when it re-chooses every layer's replicas (``adapt_every = 1``): the choice
(:func:`~torchtitan_ext.ep.replication.choice.choose_layers`) and one fill
pricing the chosen plans (:func:`~torchtitan_ext.ep.replication.choice.filled_loads`;
the trainer runs one, and a second for the plans in place where a layer's plan
would change), each layer's counts drawn from its own Dirichlet(0.5) popularity;
the compiled loops are loaded (or compiled) before the first timed call.
"""

import statistics
import time
from unittest import mock

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_ext.ep.replication import choice_loops, split_kernel
from torchtitan_ext.ep.replication.choice import choose_layers, choose_replicas, filled_loads
from torchtitan_ext.ep.replication.split import split_quotas, SplitTables
from torchtitan_ext.runtime.command_line import CommandLineParser

SHAPES = [(2, 8, 2), (8, 64, 2), (64, 256, 1), (64, 256, 2)]
"""(EP degree, experts, slots per rank)."""


class OperatorCount(TorchDispatchMode):
    """Counts the tensor operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per shape (median reported)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls: use at least 1")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print("| EP | experts | slots per rank | replicated experts | operators per call | host ms per call (median) | "
          "GPU path: operators and launch |")
    print("|---|---|---|---|---|---|---|")
    for ep, experts, slots in SHAPES:
        popularity = 1 / np.arange(1, experts + 1) ** 0.8
        counts = torch.tensor(rng.multinomial(experts * 512, popularity / popularity.sum()))
        tables = SplitTables(choose_replicas(counts.tolist(), ep, slots), torch.device("cpu"))
        with OperatorCount() as operators:
            split_quotas(counts, tables)
        times = []
        for _ in range(args.calls):
            began = time.perf_counter()
            split_quotas(counts, tables)
            times.append(time.perf_counter() - began)
        print(f"| {ep} | {experts} | {slots} | {len(tables.replicated)} | {operators.count:,} | "
              f"{statistics.median(times) * 1e3:.2f} | {_launches_in_one_kernel(counts, tables)} |")
    choice_loops.warm()
    print(f"\nEvery layer's choice at once, {CHOICE_LAYERS} MoE layers (median and range of {args.calls} calls):\n")
    print("| EP | experts | slots per rank | choice ms | one fill ms |")
    print("|---|---|---|---|---|")
    for ep, experts, slots in SHAPES:
        counts = (rng.dirichlet(np.full(experts, 0.5), size=CHOICE_LAYERS) * experts * 512).astype(np.int64)
        choice, fill = [], []
        for _ in range(args.calls):
            began = time.perf_counter()
            plans = choose_layers(counts, ep, slots)
            chosen = time.perf_counter()
            filled_loads(counts, plans)
            choice.append(chosen - began)
            fill.append(time.perf_counter() - chosen)
        print(f"| {ep} | {experts} | {slots} | {_spread(choice)} | {_spread(fill)} |")
    return 0


def _launches_in_one_kernel(counts: torch.Tensor, tables: SplitTables) -> int:
    """The tensor operators a GPU's split dispatches around its kernel, and the kernel's launch: counted here with
    the launch recorded, not run (it runs on a CUDA device, or under Triton's interpreter)."""
    launched = []
    with mock.patch.object(split_kernel, "launch", lambda *arguments: launched.append(arguments)), \
            OperatorCount() as operators:
        split_quotas(counts, tables, in_one_kernel=True)
    return operators.count + len(launched)


CHOICE_LAYERS = 58
"""DeepSeek-V3 671B's MoE layers."""


def _spread(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.1f} ({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f})"
