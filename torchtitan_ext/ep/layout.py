"""Expert-major layouts with padded groups, shared by the backends.

Every backend hands the experts one tensor of rows grouped by local expert:
expert e owns rows ``offset_e .. offset_e + roundup(c_e, P) - 1``, where c_e
is its token count and P the pad multiple; the first c_e rows are tokens,
the rest are zero pad rows. An expert with no tokens owns no rows.
"""

import torch


def round_up(value, multiple: int):
    """Smallest multiple of ``multiple`` that is >= ``value`` (ints or tensors)."""
    return (value + multiple - 1) // multiple * multiple


def padded_offsets(counts: torch.Tensor, pad_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded counts, exclusive start offsets) of expert groups, on counts' device."""
    padded = round_up(counts, pad_multiple)
    return padded, torch.cumsum(padded, 0) - padded


def expert_major_rows(
    block_counts: torch.Tensor, pad_multiple: int, total_source: int, total_pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where source-ordered blocks of rows go in the padded expert-major layout, computed where the counts are.

    ``block_counts[b, e]`` rows for expert ``e`` arrive in block ``b``; the source is ordered block-major (block
    0's experts 0..L-1, then block 1's, ...), the destination expert-major with blocks in order inside each
    expert. ``total_source`` (the counts' sum) and ``total_pad`` (the pad rows' count) size the outputs: given by
    the caller, they cost no read of the counts, so device counts stay on the device.

    Returns (destination row of every source row [total_source], the pad rows [total_pad]).
    """
    per_expert = block_counts.sum(0)
    padded, expert_offsets = padded_offsets(per_expert, pad_multiple)
    # inside expert e, block b starts after the earlier blocks' rows for e
    within_expert = torch.cumsum(block_counts, 0) - block_counts
    flat_counts = block_counts.reshape(-1)
    shift = (expert_offsets.unsqueeze(0) + within_expert).reshape(-1) - (torch.cumsum(flat_counts, 0) - flat_counts)
    device = block_counts.device
    destinations = torch.arange(total_source, device=device) + torch.repeat_interleave(
        shift, flat_counts, output_size=total_source
    )
    pads = padded - per_expert
    pad_shift = expert_offsets + per_expert - (torch.cumsum(pads, 0) - pads)
    pad_rows = torch.arange(total_pad, device=device) + torch.repeat_interleave(pad_shift, pads, output_size=total_pad)
    return destinations, pad_rows


def block_destinations(
    block_counts: torch.Tensor, pad_multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`expert_major_rows` of counts on the host: (destination row of every source row, the pad rows, padded
    rows per expert, total rows)."""
    per_expert = block_counts.sum(0)
    padded = round_up(per_expert, pad_multiple)
    total_source = int(block_counts.sum())
    destinations, pad_rows = expert_major_rows(block_counts, pad_multiple, total_source,
                                               int((padded - per_expert).sum()))
    return destinations, pad_rows, padded, int(padded.sum())


def into_groups(rows: torch.Tensor, group_sources: torch.Tensor, pad_rows: torch.Tensor) -> torch.Tensor:
    """Rows gathered into padded expert-major groups (``group_sources``: the row of every group row, any row for a
    pad row), pad rows zero: each group row written once."""
    return rows.index_select(0, group_sources).index_fill_(0, pad_rows, 0)
