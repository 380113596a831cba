"""Expert replication: replica slots on every EP rank that hold copies of hot experts.

- :mod:`.plan`: the ``[expert_replication]`` section and :class:`~.plan.ReplicaPlan`, which home expert each
  replica slot copies;
- :mod:`.choice`: which experts get replicas, re-chosen between steps from the routed counts;
- :mod:`.split`: every step, which copy of a replicated expert each (token, expert) pair goes to;
- :mod:`.experts`: the experts module that computes with its replicas' weights fetched from home;
- :mod:`.transport`: the custom ops that fetch replica weights, return their gradients and exchange counts;
  a kernel library that moves replicas itself registers its :class:`ReplicaTransport` here.
"""

import importlib
from collections.abc import Callable
from typing import Protocol

import torch


def transport_ops():
    """``torch.ops.torchtitan_ext`` with the transport ops registered: on first use, when a layer with replicas
    runs, so that reading a config registers no op (a kernel library registers its transport below without
    them)."""
    importlib.import_module("torchtitan_ext.ep.replication.transport")
    return torch.ops.torchtitan_ext


def saved_transport_ops() -> set:
    """The transport ops whose outputs selective activation checkpointing saves (neither collective repeats)."""
    ops = transport_ops()
    return {ops.replica_weights.default, ops.replica_counts.default}


class ReplicaTransport(Protocol):
    """Moves one MoE layer's replica weights from home, and their gradients back, for one EP group."""

    def fetch(self, home: list[torch.Tensor],
              redundancy_mapping: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """(fetched, land): [slots, F] this rank's replica weights (0 in unused slots) from every rank's ``home``
        weights, each [L, ...], a slot's row its expert's weights flattened, one after the other (F elements in
        all), once ``land()`` has waited for the library and written them; the fetch's caller goes on (to the
        dispatch) before it lands, and lands it before the transport's next fetch. ``redundancy_mapping``: [EP, slots] int32 on the weights' device, every rank's
        replica slots' home slots (-1: unused), built once per plan."""

    def return_gradients(self, grad: torch.Tensor, redundancy_mapping: torch.Tensor, home_rows: int) -> torch.Tensor:
        """[home_rows, F] fp32 (the library's kernels sum in fp32): the sum, per home expert of this rank, of its
        replicas' gradients ``grad`` [slots, F] (0 for an expert without copies)."""


transports: dict[str, ReplicaTransport] = {}
"""Group name -> the transport its backend registered (absent: all-to-all)."""


def register_transport(group_name: str, transport: ReplicaTransport | None) -> None:
    """Replica weights of ``group_name`` move through ``transport`` from now on (None: by all-to-all again)."""
    if transport is None:
        transports.pop(group_name, None)
    else:
        transports[group_name] = transport
