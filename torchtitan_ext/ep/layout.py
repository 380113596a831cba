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


def block_destinations(
    block_counts: torch.Tensor, pad_multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Destination rows that turn source-ordered blocks into the padded expert-major layout.

    ``block_counts[b, e]`` rows for expert ``e`` arrive in block ``b``; the
    source is ordered block-major (block 0's experts 0..L-1, then block 1's, ...),
    the destination expert-major with blocks in order inside each expert. The
    counts must be on the host: output sizes depend on them.

    Returns (destination row of every source row, padded rows per expert, total rows).
    """
    num_blocks, num_experts = block_counts.shape
    per_expert = block_counts.sum(0)
    padded, expert_offsets = padded_offsets(per_expert, pad_multiple)
    # inside expert e, block b starts after the earlier blocks' rows for e
    within_expert = torch.cumsum(block_counts, 0) - block_counts
    destination_starts = (expert_offsets.unsqueeze(0) + within_expert).reshape(-1)
    flat_counts = block_counts.reshape(-1)
    source_starts = torch.cumsum(flat_counts, 0) - flat_counts
    total_source = int(flat_counts.sum())
    shift = torch.repeat_interleave(
        destination_starts - source_starts, flat_counts, output_size=total_source
    )
    destinations = torch.arange(total_source) + shift
    return destinations, padded, int(padded.sum())
