"""Expert replication: replica slots on every EP rank that hold copies of hot experts.

- :mod:`.plan`: the ``[expert_replication]`` section and :class:`~.plan.ReplicaPlan`, which home expert each
  replica slot copies;
- :mod:`.choice`: which experts get replicas, re-chosen between steps from the routed counts;
- :mod:`.split`: every step, which copy of a replicated expert each (token, expert) pair goes to;
- :mod:`.experts`: the experts module that computes with its replicas' weights fetched from home;
- :mod:`.transport`: the custom ops that fetch replica weights, return their gradients and exchange counts.
"""

import importlib

import torch


def transport_ops():
    """``torch.ops.torchtitan_ext`` with the transport ops registered: on first use, when a layer with replicas
    runs, so that reading a config registers no op."""
    importlib.import_module("torchtitan_ext.ep.replication.transport")
    return torch.ops.torchtitan_ext


def saved_transport_ops() -> set:
    """The transport ops whose outputs selective activation checkpointing saves (neither collective repeats)."""
    ops = transport_ops()
    return {ops.replica_weights.default, ops.replica_counts.default}
