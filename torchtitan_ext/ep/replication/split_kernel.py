"""The per-step split on a GPU in one Triton kernel: the replicated experts water-filled one after another.

:func:`~torchtitan_ext.ep.replication.split.split_quotas` fills the replicated
experts in rounds of experts whose copies lie on disjoint ranks, a handful of
tensor operators per round: at EP=64 with 2 slots about 500 operators per
layer, each a kernel launch on a GPU. This kernel runs the same fills, in the
rounds' order, inside one program: each expert's water-fill ranks its copies
by a comparison matrix instead of a sort (a copy per rank at most), so the
split costs the same few launches at any EP degree. It equals the operators'
split exactly (a test holds it on the CPU, through Triton's interpreter, which
cannot show a GPU's ordering of memory between threads: hence the barrier).
"""

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["replicated", "width", "sink", "sweeps"])
def split_in_sequence(counts, quotas, loads, sequence, sequence_ranks, replicated, width, sink, sweeps,
                      unreachable, COPIES: tl.constexpr):
    """One program: ``sweeps`` passes over the ``replicated`` experts of ``sequence`` [R] (home slots), each
    re-splitting its ``counts`` pairs over its copies' ranks ``sequence_ranks`` [R, width] (padded with ``sink``) by
    water-filling against ``loads`` [sink + 1] (updated in place), and writing its row of ``quotas`` [E, width]."""
    copy = tl.arange(0, COPIES)
    in_row = copy < width
    for _ in range(sweeps):
        for i in range(replicated):
            home = tl.load(sequence + i)
            amount = tl.load(counts + home)
            at = tl.load(sequence_ranks + i * width + copy, mask=in_row, other=sink)
            real = in_row & (at != sink)
            own = tl.load(quotas + home * width + copy, mask=in_row, other=0)
            others = tl.where(real, tl.load(loads + at, mask=real, other=0) - own, unreachable)
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
            tl.store(loads + at, others + share, mask=real)  # a row's copies lie on distinct ranks
            tl.store(quotas + home * width + copy, share, mask=in_row)
            # Triton orders no global memory between a program's threads: the next expert reads these loads (and
            # the next sweep this row) from threads that did not write them
            tl.debug_barrier()


def launch(counts: torch.Tensor, quotas: torch.Tensor, loads: torch.Tensor, sequence: torch.Tensor,
           sequence_ranks: torch.Tensor, sweeps: int, unreachable: int) -> None:
    """Runs the kernel, one program, on ``quotas`` (the home column filled) and ``loads`` (the home loads, one more
    entry for the padded copies' rank) in place; under ``TRITON_INTERPRET=1`` on CPU tensors too. Blocks of at least
    16 copies: a compilation per power of two above that, at most a few per job (Triton caches them on disk)."""
    width = quotas.shape[1]
    copies = max(16, triton.next_power_of_2(width))
    with torch.cuda.device(counts.device) if counts.is_cuda else contextlib.nullcontext():  # Triton's device: the current
        split_in_sequence[(1,)](counts, quotas, loads, sequence, sequence_ranks, sequence.shape[0], width,
                                loads.shape[0] - 1, sweeps, unreachable, COPIES=copies, num_warps=4 if copies <= 64 else 8)
