"""The double's own arithmetic: what DeepEP's and HybridEP's kernels compute, from their semantics.

Written from the pinned sources and tests (DeepEP main dd758caf: tests/elastic/test_ep.py,
tests/legacy/test_intranode.py; hybrid-ep 94a9f8f6: tests/test_hybrid_ep.py) and
shared/design/ep-kernel-contract.md. It shares no code with torchtitan_ext (whose reference kernels the
adapters' tests compare against it): every exchange here is a list all-to-all of per-peer tensors.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


def exchange(per_peer: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``per_peer[d]`` to rank d; what each rank sent here, by source rank. gloo's list all-to-all takes
    equal shapes only: every piece travels padded to the largest, and is cut back to its row count."""
    sizes = [torch.tensor([t.shape[0]], dtype=torch.int64) for t in per_peer]
    received_sizes = [torch.empty(1, dtype=torch.int64) for _ in per_peer]
    dist.all_to_all(received_sizes, sizes, group=group)
    longest = torch.tensor([max(t.shape[0] for t in per_peer)], dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    shape = (int(longest), *per_peer[0].shape[1:])
    padded = [torch.cat([t, t.new_zeros((shape[0] - t.shape[0], *shape[1:]))]) for t in per_peer]
    received = [per_peer[0].new_empty(shape) for _ in per_peer]
    dist.all_to_all(received, padded, group=group)
    return [piece[: int(n)] for piece, n in zip(received, received_sizes)]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- DeepEP (v1 Buffer and V2 ElasticBuffer): deduplicated per-rank dispatch ----------------------


@dataclass
class DeepEPLayout:
    """What a dispatch remembers: the tokens sent to each rank, the rows received from each."""

    sent: list[torch.Tensor]
    """Per destination rank: this rank's token ids sent there, ascending."""
    received: list[int]
    """Per source rank: rows received, in source-rank order."""
    num_tokens: int
    owner: torch.Tensor
    """[N, K] the rank owning each pick's expert, -1 for no expert."""
    slot_row: list[torch.Tensor]
    """Per destination: [N] the row of each of this rank's tokens among those sent there (-1: not sent)."""


def deepep_dispatch(x, topk_idx, topk_weights, num_experts: int, group):
    """(recv_x, recv local expert ids (-1: another rank's expert), recv weights (0 there), per-local-expert
    counts, layout). Rank d receives, from each source rank in order, that rank's tokens routed to one of
    d's experts, ascending, each once."""
    ranks, local = group.size(), num_experts // group.size()
    owner = torch.where(topk_idx >= 0, topk_idx // local, -1)
    sent, rows, ids, weights, slot_row = [], [], [], [], []
    for rank in range(ranks):
        here = owner == rank
        tokens = here.any(dim=1).nonzero().flatten()
        sent.append(tokens)
        rows.append(x[tokens])
        ids.append(torch.where(here[tokens], topk_idx[tokens] - rank * local, -1))
        weights.append(torch.where(here[tokens], topk_weights[tokens], 0.0))
        position = torch.full((x.shape[0],), -1, dtype=torch.int64)
        position[tokens] = torch.arange(len(tokens))
        slot_row.append(position)
    recv_x = exchange(rows, group)
    recv_ids = torch.cat(exchange(ids, group))
    recv_weights = torch.cat(exchange(weights, group))
    counts = [int((recv_ids == expert).sum()) for expert in range(local)]
    layout = DeepEPLayout(sent, [part.shape[0] for part in recv_x], x.shape[0], owner, slot_row)
    return torch.cat(recv_x), recv_ids, recv_weights, counts, layout


def deepep_cached_dispatch(x, layout: DeepEPLayout, group) -> torch.Tensor:
    return torch.cat(exchange([x[tokens] for tokens in layout.sent], group))


def deepep_combine(x, layout: DeepEPLayout, group) -> torch.Tensor:
    """Each token's rows from every rank it went to, summed in fp32 (ranks in order), rounded once."""
    back = exchange(list(x.split(layout.received)), group)
    total = torch.zeros((layout.num_tokens, x.shape[1]), dtype=torch.float32)
    for tokens, rows in zip(layout.sent, back):
        total[tokens] += rows.float()
    return total.to(x.dtype)


def deepep_combine_weights_summed(weights, layout: DeepEPLayout, group) -> torch.Tensor:
    """v1 (legacy buffer): the top-k weights summed over the ranks a token went to (dispatch zeroed the
    weights of other ranks' experts, so the sum is each slot's own)."""
    back = exchange(list(weights.float().split(layout.received)), group)
    total = torch.zeros((layout.num_tokens, weights.shape[1]), dtype=torch.float32)
    for tokens, rows in zip(layout.sent, back):
        total[tokens] += rows
    return total


def deepep_combine_weights_from_owner(weights, layout: DeepEPLayout, group) -> torch.Tensor:
    """V2: each slot's weight as the rank owning that slot's expert holds it (0 for a slot without an
    expert), whatever the other ranks hold (elastic combine epilogue)."""
    back = exchange(list(weights.float().split(layout.received)), group)
    out = torch.zeros(layout.owner.shape, dtype=torch.float32)
    for rank, rows in enumerate(back):
        tokens, slots = (layout.owner == rank).nonzero(as_tuple=True)
        out[tokens, slots] = rows[layout.slot_row[rank][tokens], slots]
    return out


# ---- HybridEP: dense routing, permute fused into dispatch ------------------------------------------


@dataclass
class HybridLayout:
    """One rank's padded expert-major layout over the global tokens (g = source rank x N + token)."""

    row_of: torch.Tensor
    """[R * N, L] the row of each kept (global token, local expert) pair, -1 where none or dropped."""
    num_tokens: int
    num_rows: int
    tokens_per_expert: torch.Tensor
    """[L] padded rows per expert, truncated at ``num_rows`` when pairs were dropped."""
    kept: torch.Tensor
    """[L] (token, expert) pairs kept, padding excluded."""
    dropped: bool
    pad_rows: list[tuple[int, int]]
    """(first row, count) of each expert's pad rows inside ``num_rows``."""


def hybrid_layout(routing_map, local: int, num_rows: int | None, pad_multiple: int | None, group) -> HybridLayout:
    """The layout of this rank's experts; ``num_rows`` None: blocking (exactly the padded total)."""
    ranks, rank, num_tokens = group.size(), group.rank(), routing_map.shape[0]
    maps = [torch.empty_like(routing_map) for _ in range(ranks)]
    dist.all_gather(maps, routing_map.contiguous(), group=group)
    mine = torch.cat(maps)[:, rank * local:(rank + 1) * local]
    pad = pad_multiple or 1
    counts = mine.sum(dim=0).tolist()
    padded = [round_up(count, pad) for count in counts]
    total = sum(padded)
    num_rows = total if num_rows is None else num_rows
    row_of = torch.full(mine.shape, -1, dtype=torch.int64)
    tokens_per_expert, kept, pad_rows, offset = [], [], [], 0
    for expert, (count, size) in enumerate(zip(counts, padded)):
        rows = offset + torch.arange(count)
        pairs = mine[:, expert].nonzero().flatten()
        fits = rows < num_rows
        row_of[pairs[fits], expert] = rows[fits]
        kept.append(int(fits.sum()))
        tokens_per_expert.append(max(0, min(size, num_rows - offset)))
        if pad_multiple and size > count and offset + count < num_rows:
            pad_rows.append((offset + count, min(size - count, num_rows - offset - count)))
        offset += size
    return HybridLayout(
        row_of, num_tokens, num_rows, torch.tensor(tokens_per_expert, dtype=torch.int64),
        torch.tensor(kept, dtype=torch.int32), total > num_rows, pad_rows,
    )


def hybrid_permute(hidden, layout: HybridLayout, group, probs=None, local: int = 0):
    """(rows [M, H], their probs [M] or None): kept pairs in their rows, pad rows zero (with prob 0),
    rows past the padded total left as the memory was (uninitialised, as the library leaves them)."""
    ranks, rank = group.size(), group.rank()
    tokens = [torch.empty_like(hidden) for _ in range(ranks)]
    dist.all_gather(tokens, hidden.contiguous(), group=group)
    tokens = torch.cat(tokens)
    out = torch.empty((layout.num_rows, hidden.shape[1]), dtype=hidden.dtype)
    pair_tokens, pair_experts = (layout.row_of >= 0).nonzero(as_tuple=True)
    rows = layout.row_of[pair_tokens, pair_experts]
    out[rows] = tokens[pair_tokens]
    for first, count in layout.pad_rows:
        out[first:first + count] = 0
    out_probs = None
    if probs is not None:
        gathered = [torch.empty_like(probs) for _ in range(ranks)]
        dist.all_gather(gathered, probs.contiguous(), group=group)
        local_probs = torch.cat(gathered)[:, rank * local:(rank + 1) * local]
        out_probs = torch.empty(layout.num_rows, dtype=torch.float32)
        out_probs[rows] = local_probs[pair_tokens, pair_experts]
        for first, count in layout.pad_rows:
            out_probs[first:first + count] = 0
    return out, out_probs


def hybrid_unpermute(hidden, layout: HybridLayout, group, probs=None):
    """(combined [N, H], combined probs [N, E] or None): per rank, a token's local rows summed in fp32 and
    rounded; at the source, the ranks' partial rows summed in fp32 and rounded once. Pad, dropped and
    past-the-end rows add nothing."""
    num_tokens, local = layout.num_tokens, layout.row_of.shape[1]
    partial = torch.zeros((layout.row_of.shape[0], hidden.shape[1]), dtype=torch.float32)
    for expert in range(local):
        has = layout.row_of[:, expert] >= 0
        partial[has] += hidden[layout.row_of[has, expert]].float()
    partial = partial.to(hidden.dtype)
    back = exchange(list(partial.split(num_tokens)), group)
    combined = torch.zeros((num_tokens, hidden.shape[1]), dtype=torch.float32)
    for rows in back:
        combined += rows.float()
    combined_probs = None
    if probs is not None:
        dense = torch.zeros(layout.row_of.shape, dtype=torch.float32)
        has = layout.row_of >= 0
        dense[has] = probs.float()[layout.row_of[has]]
        back = exchange(list(dense.split(num_tokens)), group)
        combined_probs = torch.cat(back, dim=1)  # [N, R * L]: rank d's local experts at columns d * L ...
    return combined.to(hidden.dtype), combined_probs
