"""Reference kernels: the DeepEP and HybridEP calls in plain torch.distributed.

``ReferenceBuffer`` reproduces DeepEP v1 normal mode (``deep_ep.Buffer``) and
``ReferenceHybridEPBuffer`` HybridEP (``deep_ep.HybridEPBuffer``), call for
call, with the results that ``shared/design/ep-kernel-contract.md`` states:
receive order, local expert ids, the padded expert-major layout with zeroed
pad rows, the tail drop rule and overflow flag, unweighted combines
accumulated in fp32 and rounded once, and cached dispatch. They run on any
device and process group (gloo on CPU, NCCL on GPU), which makes everything
above the kernels testable without the library, and is a documented choice
for debugging (``implementation = "reference"``).

Like the library, these methods do no autograd; the backends' custom ops do.
They are written for clarity, not speed: collectives go through
``torch.distributed`` and the permutations are gathers.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_ext.ep.layout import padded_offsets, round_up
from torchtitan_ext.runtime.collectives import all_gather_single


def _exchange(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """all-to-all of variable row counts (splits on the host), optionally into ``out``'s first rows."""
    total = sum(recv_splits)
    out = rows.new_empty((total, *rows.shape[1:])) if out is None else out[:total]
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def _exchange_counts(counts: list[int], group, device) -> list[int]:
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, pinned where a device computed it (a CPU run's tensor is host memory already)."""
    if tensor.device.type == "cpu":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


@dataclass(frozen=True)
class ReferenceDispatchHandle:
    """What a DeepEP dispatch remembers for combine and cached dispatch."""

    send_token_index: torch.Tensor
    """Source token of every sent row, in send order (destination rank, token)."""
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    """Received (token, local expert) picks per local expert, aligned (ElasticBuffer's handle field)."""
    num_sms: int = 0
    """ElasticBuffer's handle field; the reference uses no SMs."""


class _ReferenceDeepEP:
    """What DeepEP's v1 ``Buffer`` and V2 ``ElasticBuffer`` share: deduplicated per-rank dispatch
    and an unweighted combine, in plain torch.distributed."""

    def __init__(self, group):
        self.group = group
        self.group_size = group.size()
        self.rank = group.rank()

    def _layout(self, topk_idx: torch.Tensor, num_experts: int):
        local_experts = num_experts // self.group_size
        valid = topk_idx >= 0
        dest_rank = torch.where(valid, topk_idx // local_experts, -1)
        ranks = torch.arange(self.group_size, device=topk_idx.device)
        is_token_in_rank = (dest_rank.unsqueeze(-1) == ranks).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank

    def _dispatch(self, x, is_token_in_rank, num_tokens_per_rank, num_experts, topk_idx, topk_weights, alignment):
        """Rank d receives, from each source rank s in order, the tokens of s (ascending) that
        route to one of its experts, once; picks not local to d become -1 with weight 0."""
        local_experts = num_experts // self.group_size
        send_rank, send_token = is_token_in_rank.t().nonzero(as_tuple=True)
        picks = topk_idx[send_token]
        is_local = (picks >= 0) & (picks // local_experts == send_rank.unsqueeze(1))
        send_idx = torch.where(is_local, picks - send_rank.unsqueeze(1) * local_experts, -1)
        send_weights = torch.where(is_local, topk_weights[send_token], 0.0)
        send_splits = num_tokens_per_rank.tolist()
        recv_splits = _exchange_counts(send_splits, self.group, x.device)

        recv_x = _exchange(x[send_token], send_splits, recv_splits, self.group)
        # ids and weights travel together; float64 holds both exactly
        meta = _exchange(
            torch.cat([send_idx.double(), send_weights.double()], dim=1), send_splits, recv_splits, self.group,
        )
        top_k = topk_idx.shape[1]
        recv_topk_idx = meta[:, :top_k].long()
        recv_topk_weights = meta[:, top_k:].float()
        counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=local_experts)
        handle = ReferenceDispatchHandle(
            send_token, send_splits, recv_splits, x.shape[0], [round_up(c, alignment) for c in counts.tolist()]
        )
        return recv_x, recv_topk_idx, recv_topk_weights, handle, counts

    def _cached_dispatch(self, x, handle: ReferenceDispatchHandle) -> torch.Tensor:
        return _exchange(x[handle.send_token_index], handle.send_splits, handle.recv_splits, self.group)

    def _combine(self, x, handle: ReferenceDispatchHandle, topk_weights, asynchronous: bool):
        """(combined_x, combined top-k weights or None, land or None).

        The unweighted sum of every rank's rows for a token, accumulated in fp32
        and rounded once; a token sent nowhere comes back as zeros. Asynchronous:
        the rows are still travelling when this returns and ``land()`` writes them
        into ``combined_x``.
        """
        back = x.new_empty((sum(handle.send_splits), x.shape[1]))
        work = dist.all_to_all_single(
            back, x.contiguous(), handle.send_splits, handle.recv_splits, group=self.group, async_op=True
        )
        combined = x.new_empty((handle.num_tokens, x.shape[1]))

        def land():
            work.wait()
            summed = back.new_zeros(combined.shape, dtype=torch.float32)
            combined.copy_(summed.index_add_(0, handle.send_token_index, back.float()))

        combined_weights = None
        if topk_weights is not None:
            back_weights = _exchange(topk_weights.float(), handle.recv_splits, handle.send_splits, self.group)
            combined_weights = topk_weights.new_zeros(
                (handle.num_tokens, topk_weights.shape[1]), dtype=torch.float32
            ).index_add_(0, handle.send_token_index, back_weights)
        if asynchronous:
            return combined, combined_weights, land
        land()
        return combined, combined_weights, None


class ReferenceBuffer(_ReferenceDeepEP):
    """DeepEP v1 normal mode (``deep_ep.Buffer``): ``get_dispatch_layout``, ``dispatch``, ``combine``."""

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0):
        super().__init__(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """(tokens per rank, None, tokens per expert, is_token_in_rank [N, R], event)."""
        per_rank, per_expert, in_rank = self._layout(topk_idx, num_experts)
        return per_rank, None, per_expert, in_rank, ReferenceEvent(None)

    def dispatch(
        self,
        x: torch.Tensor,
        handle: ReferenceDispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
    ):
        """(recv_x, recv_topk_idx, recv_topk_weights, per-expert counts list, handle, event).

        With ``handle`` (cached mode) only recv_x is returned, the rest None.
        """
        if handle is not None:
            return self._cached_dispatch(x, handle), None, None, None, None, ReferenceEvent(None)
        recv_x, recv_idx, recv_weights, handle, _ = self._dispatch(
            x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert.numel(),
            topk_idx, topk_weights, expert_alignment,
        )
        return recv_x, recv_idx, recv_weights, handle.num_recv_tokens_per_expert_list, handle, ReferenceEvent(None)

    def combine(
        self,
        x: torch.Tensor,
        handle: ReferenceDispatchHandle,
        topk_weights: torch.Tensor | None = None,
        async_finish: bool = False,
    ):
        """(combined_x [N, H], combined top-k weights (summed over ranks) or None, event).

        With ``async_finish`` the output is valid after ``event.current_stream_wait()``.
        """
        combined, weights, land = self._combine(x, handle, topk_weights, async_finish)
        return combined, weights, ReferenceEvent(land)


class ReferenceElasticBuffer(_ReferenceDeepEP):
    """DeepEP V2 (``deep_ep.ElasticBuffer``): ``dispatch`` and ``combine``, compact layout.

    Compact mode (``do_expand=False``) with the CPU sync, as a training step
    uses it: the received tokens, their local expert ids (-1 elsewhere) and
    weights; per-expert counts in the handle, added to
    ``cumulative_local_expert_recv_stats`` on the device. The receive order is
    (source rank, token) ascending, which the library guarantees with
    ``deterministic=True``. The expanded layout and the sync-free worst-case
    sizing are the library's and are refused here.
    """

    def __init__(self, group, num_bytes: int | None = None, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, deterministic: bool = False):
        super().__init__(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """The reference runs on no SMs: 0 (the library's count of the same name is an instance method too)."""
        return 0

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        handle: ReferenceDispatchHandle | None = None,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        async_with_compute_stream: bool = False,
    ):
        """(recv_x, recv_topk_idx, recv_topk_weights, handle, event); cached (``handle``):
        recv_x and the same handle."""
        if handle is not None:
            if do_cpu_sync:
                raise AssertionError("Cannot do CPU sync with cached handle")
            return self._cached_dispatch(x, handle), None, None, handle, ReferenceEvent(None)
        if do_expand or do_cpu_sync is False:
            raise NotImplementedError("the reference ElasticBuffer implements compact dispatch with the CPU sync")
        max_tokens = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        if x.shape[0] > max_tokens:
            raise RuntimeError(f"{x.shape[0]} tokens > num_max_tokens_per_rank = {max_tokens}")
        per_rank, _, in_rank = self._layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, handle, counts = self._dispatch(
            x, in_rank, per_rank, num_experts, topk_idx, topk_weights, expert_alignment or 1,
        )
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts.to(cumulative_local_expert_recv_stats.dtype)
        return recv_x, recv_idx, recv_weights, handle, ReferenceEvent(None)

    def combine(
        self,
        x: torch.Tensor,
        handle: ReferenceDispatchHandle,
        topk_weights: torch.Tensor | None = None,
        num_sms: int = 0,
        async_with_compute_stream: bool = False,
    ):
        """(combined_x [N, H], each pick's weight sent back by its expert's rank or None, event).

        With ``async_with_compute_stream`` the output is valid after ``event.current_stream_wait()``.
        """
        combined, weights, land = self._combine(x, handle, topk_weights, async_with_compute_stream)
        return combined, weights, ReferenceEvent(land)


class ReferenceEvent:
    """DeepEP's ``EventOverlap`` for the reference: waiting lands an asynchronous combine.

    Like the library's, waiting on an event that records nothing is an error.
    """

    def __init__(self, land):
        self._land = land

    def current_stream_wait(self) -> None:
        if self._land is None:
            raise AssertionError("the event is None: the call was not asynchronous")
        self._land()


@dataclass(frozen=True)
class ReferenceHybridEPHandle:
    """What a HybridEP dispatch remembers for combine and cached dispatch.

    ``G = R * N`` global tokens ``g = s * N + t`` (source rank s, token t);
    ``L`` local experts; ``M`` output rows.
    """

    row_pairs: torch.Tensor
    """[M] pair id g * L + e of each output row; G*L for pad rows, G*L + 1 past the end."""
    token_position: torch.Tensor
    """[G] row of token g in the received tokens (an all-zero row when not received)."""
    num_tokens: int
    num_permuted_tokens: int
    tokens_per_expert: torch.Tensor
    """[L] padded rows per local expert, truncated at M (int64)."""
    gathers_all_tokens: bool
    """Non-blocking mode moves every token to every rank (static shapes, no host sync)."""
    send_token_index: torch.Tensor | None
    send_splits: list[int] | None
    recv_splits: list[int] | None
    recv_token_index: torch.Tensor | None
    """[T] global token id of every received row (blocking mode)."""
    overflow_flag: torch.Tensor
    """int32 device scalar: 1 when pairs were dropped."""
    num_dropped: torch.Tensor
    """int64 device scalar: dropped (token, expert) pairs on this rank."""
    kept_per_expert: torch.Tensor
    """[L] (token, local expert) pairs kept, padding excluded (int64): the library's raw tokens_per_expert."""
    kept_per_token: torch.Tensor
    """[G] (token, local expert) pairs kept of each global token (int64): its rows' segment in combine."""


class ReferenceHybridEPBuffer:
    """HybridEP: ``dispatch_with_permute`` and ``combine_with_unpermute``.

    Like the library's buffer it is allocated once, sized by
    ``max_num_of_tokens_per_rank``, and shared by every MoE layer; a call with
    more tokens regrows it (slow, and counted in ``regrowths``). ``dtype`` is
    the activation dtype the token area holds (the library's is bf16 or fp8).
    """

    def __init__(
        self,
        group,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        self.group = group
        self.group_size = group.size()
        self.rank = group.rank()
        self.hidden_dim = hidden_dim
        self.num_local_experts = num_local_experts
        self.dtype = dtype
        self.device = torch.device(device)
        self.regrowths = 0
        self._allocate(max_num_of_tokens_per_rank)

    @staticmethod
    def areas(
        group_size: int, hidden_dim: int, max_num_of_tokens_per_rank: int,
        num_local_experts: int, dtype: torch.dtype,
    ) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
        """Shape and dtype of each area the buffer allocates: the tokens of every
        rank, and the all-gathered routing map and probs."""
        rows = group_size * max_num_of_tokens_per_rank
        num_experts = group_size * num_local_experts
        return {
            "tokens": ((rows, hidden_dim), dtype),
            "routing_map": ((rows, num_experts), torch.bool),
            "probs": ((rows, num_experts), torch.float32),
        }

    @classmethod
    def buffer_bytes(cls, *args) -> int:
        """Bytes a buffer with these arguments (as for :meth:`areas`) allocates."""
        return sum(
            rows * columns * torch.empty((), dtype=dtype).element_size()
            for (rows, columns), dtype in cls.areas(*args).values()
        )

    @property
    def nbytes(self) -> int:
        """Bytes this buffer holds now."""
        return sum(t.numel() * t.element_size() for t in (self._tokens, self._routing_map, self._probs))

    def _allocate(self, max_tokens: int) -> None:
        self.max_num_of_tokens_per_rank = max_tokens
        areas = self.areas(self.group_size, self.hidden_dim, max_tokens, self.num_local_experts, self.dtype)
        self._tokens, self._routing_map, self._probs = (
            torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in areas.values()
        )

    def _ensure_capacity(self, num_tokens: int) -> None:
        if num_tokens > self.max_num_of_tokens_per_rank:
            self.regrowths += 1
            self._allocate(num_tokens)

    def _all_gather(self, area: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        out = area[: self.group_size * local.shape[0]]
        all_gather_single(out, local.contiguous(), group=self.group)
        return out

    def destroy(self) -> None:
        """Nothing to release: the reference's buffer is plain tensors (the library's is freed on deletion)."""

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        num_permuted_tokens: int | None = None,
        pad_multiple: int | None = None,
        non_blocking: bool = False,
        handle: ReferenceHybridEPHandle | None = None,
    ):
        """(tokens [M, H], probs [M] fp32 or None, scaling factors (None), tokens per expert [L]
        (None on the cached path), handle).

        Layout: the i-th global token (ascending g = s * N + t) routed to local
        expert e lands in row offset_e + i, offset_e = sum_{j<e} roundup(c_j, P);
        pad rows are zero; rows past the padded total are undefined (NaN here).
        Blocking mode sizes M exactly (a host sync); non-blocking mode takes M
        and drops the pairs whose row would be >= M.
        """
        cached = handle is not None
        if cached:
            pair_probs = None
        else:
            handle, pair_probs = self._plan(
                hidden, routing_map, probs, num_of_experts_per_rank,
                num_permuted_tokens, pad_multiple or 1, non_blocking,
            )
        received = self._move_tokens(hidden, handle)
        # one zero row (pad) and one NaN row (past the end) after the received tokens
        filler = received.new_zeros((2, received.shape[1]))
        if received.is_floating_point():
            filler[1] = float("nan")
        received = torch.cat([received, filler])
        # each row's pair g * L + e, or G * L (pad) or G * L + 1 (past the end): its global token g, then the pad
        # and past-the-end entries after the G tokens'
        num_pairs = handle.token_position.shape[0] * self.num_local_experts
        row_pairs = handle.row_pairs
        is_pair = row_pairs < num_pairs
        row_token = torch.where(is_pair, row_pairs // self.num_local_experts,
                                row_pairs - num_pairs + handle.token_position.shape[0])
        token_at = torch.cat([
            handle.token_position, torch.arange(received.shape[0] - 2, received.shape[0], device=hidden.device),
        ])
        tokens = received[token_at[row_token]]
        out_probs = None
        if pair_probs is not None:
            # a row's pair is a kept one: its prob as routed; pad rows 0, rows past the end NaN (no tokens: every
            # row is one of those)
            if num_pairs:
                pair = row_pairs.clamp(max=num_pairs - 1)
                routed = pair_probs[pair // self.num_local_experts, pair % self.num_local_experts]
            else:
                routed = pair_probs.new_zeros(row_pairs.shape)
            filler_probs = routed.new_zeros(2)
            filler_probs[1:].fill_(float("nan"))  # a slice filled: setting one element copies a host scalar
            out_probs = torch.where(is_pair, routed, filler_probs[(row_pairs - num_pairs).clamp(0, 1)])
        # like the library: the cached path computes no tokens per expert; blocking mode returns them in pinned
        # host memory (read after its sync), non-blocking mode on the device
        tokens_per_expert = None
        if not cached:
            tokens_per_expert = handle.tokens_per_expert if non_blocking else _pinned_host(handle.tokens_per_expert)
        return tokens, out_probs, None, tokens_per_expert, handle

    def kept_pairs_per_expert(self, handle: ReferenceHybridEPHandle) -> torch.Tensor:
        """[L] (token, local expert) pairs the dispatch kept on this rank (int64, on the device)."""
        return handle.kept_per_expert

    def _plan(self, hidden, routing_map, probs, local_experts, num_permuted_tokens, pad, non_blocking):
        num_tokens = hidden.shape[0]
        self._ensure_capacity(num_tokens)
        device = hidden.device
        rank, group_size = self.rank, self.group_size
        global_map = self._all_gather(self._routing_map, routing_map)
        local_map = global_map[:, rank * local_experts : (rank + 1) * local_experts]
        num_global = local_map.shape[0]
        num_pairs = num_global * local_experts
        # rows and pair ids in int32 where they fit: exact, and a CPU sums a bool map into int32 several times faster
        # than into int64 (half the memory to fill); what the handle returns per expert and per token is int64
        index_dtype = (torch.int32 if max(num_pairs + local_experts * pad, num_permuted_tokens or 0) < 2**31 - 1
                       else torch.int64)
        counts = local_map.sum(0, dtype=index_dtype).long()
        padded, offsets = padded_offsets(counts, pad)
        # a pair's row: its expert's offset plus its rank among the expert's pairs (a running count, less one)
        rows = torch.cumsum(local_map, 0, dtype=index_dtype).add_((offsets - 1).to(index_dtype))
        if non_blocking:
            num_rows = num_permuted_tokens
        else:
            num_rows = int(padded.sum())  # blocking: the library syncs to size its output
        kept = (rows < num_rows).logical_and_(local_map)
        kept_per_expert = kept.sum(0, dtype=index_dtype).long()
        num_dropped = counts.sum() - kept_per_expert.sum()
        pair_rows = rows.masked_fill_(~kept, num_rows)

        # row -> (token, expert) pair table: pad rows point at the zero pair,
        # rows past the padded total at the NaN pair; kept pairs overwrite theirs
        filled = padded.sum().clamp(max=num_rows)
        row_index = torch.arange(num_rows + 1, device=device)
        row_pairs = torch.where(row_index < filled, num_pairs, num_pairs + 1).to(index_dtype)
        pair_ids = torch.arange(num_pairs, device=device, dtype=index_dtype)
        row_pairs = row_pairs.scatter_reduce(0, pair_rows.reshape(-1).long(), pair_ids, reduce="amin")[:num_rows].long()

        kept_per_token = kept.sum(1, dtype=index_dtype).long()
        needed = kept_per_token > 0
        if non_blocking:
            token_position = torch.arange(num_global, device=device)
            exchange = dict(gathers_all_tokens=True, send_token_index=None, send_splits=None,
                            recv_splits=None, recv_token_index=None)
        else:
            my_tokens = routing_map.view(num_tokens, group_size, local_experts).any(dim=2)
            send_rank, send_token = my_tokens.t().nonzero(as_tuple=True)
            send_splits = my_tokens.sum(0).tolist()
            recv_splits = needed.view(group_size, num_tokens).sum(1).tolist()
            recv_token_index = needed.nonzero().squeeze(1)
            # tokens not received point past the received rows, at the zero filler row
            token_position = torch.full((num_global,), recv_token_index.numel(), device=device)
            token_position[recv_token_index] = torch.arange(recv_token_index.numel(), device=device)
            exchange = dict(gathers_all_tokens=False, send_token_index=send_token,
                            send_splits=send_splits, recv_splits=recv_splits,
                            recv_token_index=recv_token_index)

        pair_probs = None
        if probs is not None:
            global_probs = self._all_gather(self._probs, probs.float())
            # [G, L]: read only at kept pairs (the rows' pairs)
            pair_probs = global_probs[:, rank * local_experts : (rank + 1) * local_experts]
        handle = ReferenceHybridEPHandle(
            row_pairs=row_pairs,
            token_position=token_position,
            num_tokens=num_tokens,
            num_permuted_tokens=num_rows,
            tokens_per_expert=torch.minimum(padded, (num_rows - offsets).clamp(min=0)),
            overflow_flag=(num_dropped > 0).to(torch.int32),
            num_dropped=num_dropped,
            kept_per_expert=kept_per_expert,
            kept_per_token=kept_per_token,
            **exchange,
        )
        return handle, pair_probs

    def _move_tokens(self, hidden: torch.Tensor, handle: ReferenceHybridEPHandle) -> torch.Tensor:
        """Rows this rank's experts need, received into the token area.

        Non-blocking mode gathers every token (static shapes); blocking mode
        receives exactly the tokens routed here.
        """
        if hidden.dtype != self.dtype:
            raise TypeError(
                f"HybridEP buffer holds {self.dtype} tokens but dispatch got {hidden.dtype}: "
                "create the buffer with the activation dtype"
            )
        if handle.gathers_all_tokens:
            return self._all_gather(self._tokens, hidden)
        return _exchange(
            hidden[handle.send_token_index], handle.send_splits, handle.recv_splits,
            self.group, out=self._tokens,
        )

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: torch.Tensor | None = None,
        handle: ReferenceHybridEPHandle,
        pad_multiple: int | None = None,
    ):
        """(combined [N, H], combined probs [N, E] fp32 or None).

        Unweighted: each rank sums its local experts' rows of a token in fp32
        and rounds; the source sums the ranks' partial rows in fp32 and rounds
        once. Pad, past-the-end and dropped rows contribute nothing.
        """
        num_rows = handle.num_permuted_tokens
        if hidden.shape[0] != num_rows:
            raise ValueError(f"combine got {hidden.shape[0]} rows where its dispatch produced {num_rows}")
        # rows in pair order (g * L + e: token-major, each token's rows by ascending expert), pad and past-the-end
        # rows last, unread; each token's rows summed in that fixed order (a sequential segment sum on every
        # device, where an index_add would add in atomics' order on a GPU)
        kept_per_token = handle.kept_per_token
        offsets = torch.cat([kept_per_token.new_zeros(1), kept_per_token.cumsum(0)])
        in_pair_order = hidden[torch.argsort(handle.row_pairs)].float()
        # unsafe: the offsets stay within the rows by construction, and checking it would make the host wait
        partial = torch.segment_reduce(in_pair_order, "sum", offsets=offsets, unsafe=True).to(hidden.dtype)
        combined = self._return_rows(partial, handle).to(hidden.dtype)

        combined_probs = None
        if probs is not None:
            # each kept pair's prob from its row, 0 where a pair was not kept: pad and past-the-end rows write to the
            # two slots after the pairs', dropped (an index_put without accumulation is deterministic on every device)
            num_pairs = handle.token_position.shape[0] * self.num_local_experts
            pair_probs = probs.new_zeros(num_pairs + 2, dtype=torch.float32)
            pair_probs.index_put_((handle.row_pairs,), probs.float())
            per_rank = pair_probs[:num_pairs].view(self.group_size, handle.num_tokens, self.num_local_experts)
            received = torch.empty_like(per_rank)
            dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)
            # received[d, t, e] = probs of my token t at rank d's local expert e
            combined_probs = received.permute(1, 0, 2).reshape(handle.num_tokens, -1)
        return combined, combined_probs

    def _return_rows(self, partial: torch.Tensor, handle: ReferenceHybridEPHandle) -> torch.Tensor:
        """Send each token's partial rows back to its source; fp32 sum there."""
        num_tokens = handle.num_tokens
        if handle.gathers_all_tokens:
            per_rank = partial.view(self.group_size, num_tokens, -1)
            received = torch.empty_like(per_rank)
            dist.all_to_all_single(received, per_rank, group=self.group)
            return received.float().sum(0)
        back = _exchange(
            partial[handle.recv_token_index], handle.recv_splits, handle.send_splits, self.group
        )
        combined = partial.new_zeros((num_tokens, partial.shape[1]), dtype=torch.float32)
        return combined.index_add_(0, handle.send_token_index, back.float())
