"""DeepEP's three APIs behind the three calls the ``deepep`` backend makes (dispatch, combine, cached dispatch).

- :class:`LegacyAPI`: DeepEP v1 normal mode, ``deep_ep.Buffer``;
- :class:`ElasticAPI`: DeepEP V2, ``deep_ep.ElasticBuffer``;
- :class:`EPBufferAPI`: DeepEP V2.5, ``deep_ep.EPBuffer``, which can also carry expert replicas.

Each wraps a real buffer or the reference's (same signatures). Where torch's deterministic algorithms and
``fill_uninitialized_memory`` are both on (torchtitan's ``debug.deterministic``), which DeepEP refuses,
the calls run with the latter off. See docs/backends.md, "`[deepep]`".
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.distributed.distributed_c10d import _get_process_group_name
from torchtitan.tools.logging import logger

from torchtitan_ext.ep.kernels import calls
from torchtitan_ext.ep.kernels.calls import kernel_call
from torchtitan_ext.ep.replication import register_transport, ReplicaTransport

FALLBACK_SMS = 20
"""SMs for V2's dispatch and combine when the library cannot estimate them (torchtitan's choice)."""


@contextmanager
def _deterministic_mode_accepted() -> Iterator[None]:
    fill = torch.utils.deterministic.fill_uninitialized_memory
    if not (fill and torch.are_deterministic_algorithms_enabled()):
        yield
        return
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


class LegacyAPI:
    """DeepEP v1 ``Buffer`` (or :class:`~torchtitan_ext.ep.kernels.reference.ReferenceBuffer`)."""

    name = "legacy"

    def __init__(self, buffer, num_sms: int | None = None):
        self.buffer = buffer
        self.group = buffer.group

    def destroy(self) -> None:
        _destroy(self.buffer)

    def dispatch(self, x, topk_idx, topk_weights, num_experts):
        """(recv_x, recv local expert ids (-1: not here), recv weights, per-expert counts (a host list), handle)."""
        with _deterministic_mode_accepted():
            with kernel_call("deepep.get_dispatch_layout"):
                per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, num_experts)
            # the exact receive count reaches the host as a list: the library waits for it
            with kernel_call("deepep.dispatch", host_syncs=1):
                recv_x, recv_idx, recv_weights, counts, handle, _ = self.buffer.dispatch(
                x,
                    num_tokens_per_rank=per_rank,
                    num_tokens_per_rdma_rank=per_rdma_rank,
                    is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert,
                    topk_idx=topk_idx,
                    topk_weights=topk_weights,
                )
        return recv_x, recv_idx, recv_weights, counts, handle

    def combine(self, x, handle, topk_weights=None, asynchronous: bool = False):
        """(combined, combined weights or None, wait: lands an asynchronous combine, or None)."""
        with _deterministic_mode_accepted(), kernel_call("deepep.combine"):
            combined, weights, event = self.buffer.combine(x, handle, topk_weights=topk_weights, async_finish=asynchronous)
        return combined, weights, _landing(event) if asynchronous else None

    def cached_dispatch(self, x, handle):
        with _deterministic_mode_accepted(), kernel_call("deepep.cached_dispatch"):
            return self.buffer.dispatch(x, handle=handle)[0]


class ElasticAPI:
    """DeepEP V2 ``ElasticBuffer`` (or :class:`~torchtitan_ext.ep.kernels.reference.ReferenceElasticBuffer`)."""

    name = "elastic"

    def __init__(self, buffer, num_sms: int | None = None):
        self.buffer = buffer
        self.group = buffer.group
        self.num_sms = num_sms or None
        """SMs of dispatch and combine; unset: the library's theoretical count, taken at the first dispatch
        (:meth:`_sms_for`)."""

    def destroy(self) -> None:
        _destroy(self.buffer)

    def _sms_for(self, num_experts: int, num_topk: int) -> int:
        """The library's theoretical SM count, once. It divides by the RDMA and NVLink bandwidths it reads
        from ibstat and nvidia-smi, which report 0 where they cannot tell (elastic.py:809: a
        ZeroDivisionError at the first multi-node dispatch): then 20 SMs, said once, as torchtitan does."""
        try:
            return self.buffer.get_theoretical_num_sms(num_experts, num_topk)
        except ZeroDivisionError:
            logger.warning(
                f"DeepEP could not estimate its SM count ({FALLBACK_SMS} used): it read 0 GB/s for RDMA or "
                "NVLink from ibstat / nvidia-smi; set deepep.num_sms to choose"
            )
            return FALLBACK_SMS

    def dispatch(self, x, topk_idx, topk_weights, num_experts):
        """As :meth:`LegacyAPI.dispatch`; the counts come from the handle."""
        if self.num_sms is None:
            self.num_sms = self._sms_for(num_experts, topk_idx.shape[1])
        # do_cpu_sync: the exact receive count reaches the host, the library waits for it
        with _deterministic_mode_accepted(), kernel_call("deepep.dispatch", host_syncs=1):
            recv_x, recv_idx, recv_weights, handle, _ = self.buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                num_sms=self.num_sms, do_cpu_sync=True,
            )
        return recv_x, recv_idx, recv_weights, handle.num_recv_tokens_per_expert_list, handle

    def combine(self, x, handle, topk_weights=None, asynchronous: bool = False):
        with _deterministic_mode_accepted(), kernel_call("deepep.combine"):
            combined, weights, event = self.buffer.combine(
                x, handle, topk_weights=topk_weights, num_sms=self.num_sms, async_with_compute_stream=asynchronous
            )
        return combined, weights, _landing(event) if asynchronous else None

    def cached_dispatch(self, x, handle):
        with _deterministic_mode_accepted(), kernel_call("deepep.cached_dispatch"):
            return self.buffer.dispatch(x, handle=handle, num_sms=handle.num_sms, do_cpu_sync=False)[0]


class EPBufferAPI(ElasticAPI):
    """DeepEP V2.5 ``EPBuffer`` (or the reference's V2 buffer, which takes the same calls).

    ``replica_transport``: the buffer's load-balancing kernels, which carry the
    EP group's replica weights until :meth:`destroy`; None: replicas move by all-to-all.
    """

    name = "ep"

    def __init__(self, buffer, num_sms: int | None = None, replica_transport: ReplicaTransport | None = None):
        super().__init__(buffer, num_sms)
        self.replica_group = None
        if replica_transport is not None:
            self.replica_group = _get_process_group_name(self.group)
            register_transport(self.replica_group, replica_transport)

    def destroy(self) -> None:
        if self.replica_group is not None:
            register_transport(self.replica_group, None)
        super().destroy()


def _landing(event) -> Callable[[], None]:
    """What lands an asynchronous combine: the current stream waits for the library's event (the reference's
    event sums its rows), the library's work."""

    def land() -> None:
        with calls.library_work():  # through the module: the ledger's CUDA sync check replaces it
            event.current_stream_wait()

    return land


def _destroy(buffer) -> None:
    """The library's buffers (built with explicitly_destroy) are destroyed; the reference's have nothing to free."""
    if getattr(buffer, "explicitly_destroy", False):
        buffer.destroy()


APIS: dict[str, Callable] = {"legacy": LegacyAPI, "elastic": ElasticAPI, "ep": EPBufferAPI}
"""``[deepep] api`` -> its adapter."""
