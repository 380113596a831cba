"""Whether activation checkpointing is recomputing a forward: what the forward-time counters skip."""

import torch


def recomputing() -> bool:
    """True while activation checkpointing recomputes a forward inside backward.

    Counters updated in forward skip recomputation, so that checkpointed layers
    count each dispatch once (and selective checkpointing, which replays the
    forward's ops, sees no extra op).
    """
    return torch._C._current_graph_task_id() != -1
