"""The per-step split on a GPU in one Triton kernel: the replicated experts water-filled one after another.

:func:`~torchtitan_ext.ep.replication.split.split_quotas` fills the replicated
experts in rounds of experts whose copies lie on disjoint ranks, a handful of
tensor operators per round: at EP=64 with 2 slots about 500 operators per
layer, each a kernel launch on a GPU. This kernel runs the same fills, in the
rounds' order, inside one program: the ranks' loads stay in registers, and
each expert's water-fill ranks its copies by a comparison matrix instead of a
sort (at most a few hundred copies), so the split costs the same few launches
at any EP degree. It equals the operators' split exactly (a test holds it on
the CPU, through Triton's interpreter).
"""

import torch
import triton
import triton.language as tl


# one compilation per EP degree: the plan's sizes are plain arguments, and the blocks are sized by EP (a copy per rank
# at most), so a new plan between steps compiles nothing
@triton.jit(do_not_specialize=["replicated", "width", "sink", "sweeps"])
def split_in_sequence(counts, quotas, loads, sequence, sequence_ranks, replicated, width, sink, sweeps,
                      unreachable, COPIES: tl.constexpr, RANKS: tl.constexpr):
    """One program: ``sweeps`` passes over the ``replicated`` experts of ``sequence`` [R] (home slots), each
    re-splitting its ``counts`` pairs over its copies' ranks ``sequence_ranks`` [R, width] (padded with ``sink``) by
    water-filling against ``loads`` [sink + 1], and writing its row of ``quotas`` [E, width]."""
    copy = tl.arange(0, COPIES)
    rank = tl.arange(0, RANKS)
    in_row = copy < width
    load = tl.load(loads + rank, mask=rank <= sink, other=0)
    for _ in range(sweeps):
        for i in range(replicated):
            home = tl.load(sequence + i)
            amount = tl.load(counts + home)
            at = tl.load(sequence_ranks + i * width + copy, mask=in_row, other=sink)
            real = in_row & (at != sink)
            own = tl.load(quotas + home * width + copy, mask=in_row, other=0)
            hit = at[:, None] == rank[None, :]
            others = tl.where(real, tl.sum(tl.where(hit, load[None, :], 0), axis=1) - own, unreachable)
            # water-fill: each copy's place in the stable order of others (ties: the earlier copy)
            before = (others[None, :] < others[:, None]) | ((others[None, :] == others[:, None])
                                                           & (copy[None, :] < copy[:, None]))
            place = tl.sum(before.to(tl.int64), axis=1)
            prefix = tl.sum(tl.where(place[None, :] <= place[:, None], others[None, :], 0), axis=1)
            levels = (amount + prefix) // (place + 1)
            filled = tl.maximum(tl.sum((levels >= others).to(tl.int64), axis=0), 1)
            last = place == filled - 1
            level = tl.sum(tl.where(last, levels, 0), axis=0)
            remainder = amount + tl.sum(tl.where(last, prefix, 0), axis=0) - level * filled
            share = tl.maximum(level - others, 0) + (place < remainder).to(tl.int64)
            load += tl.sum(tl.where(hit, tl.where(real, share - own, 0)[:, None], 0), axis=0)
            tl.store(quotas + home * width + copy, share, mask=in_row)


def launch(counts: torch.Tensor, quotas: torch.Tensor, loads: torch.Tensor, sequence: torch.Tensor,
           sequence_ranks: torch.Tensor, sweeps: int, unreachable: int) -> None:
    """Runs the kernel, one program, on ``quotas`` (the home column filled) in place, from ``loads`` (the home
    loads, one more entry for the padded copies' rank); under ``TRITON_INTERPRET=1`` on CPU tensors too."""
    sink = loads.shape[0] - 1  # the EP degree
    split_in_sequence[(1,)](counts, quotas, loads, sequence, sequence_ranks, sequence.shape[0], quotas.shape[1], sink,
                            sweeps, unreachable, COPIES=triton.next_power_of_2(sink), RANKS=triton.next_power_of_2(sink + 1))
