"""Collective failures named by where they happened: an MoE layer's dispatch or combine, FSDP's
all-gather or reduce-scatter, or the training code's function that issued it.

A collective that fails (a gloo timeout after ``comm.train_timeout_seconds``,
a closed connection) is re-raised as :class:`CollectiveFailed`, so that a stuck
or dead peer reads as one line saying which collective lost it.
"""

import traceback
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist


class CollectiveFailed(RuntimeError):
    """A collective failed (timed out, lost its peer); the message names which one."""


TIMEOUT_TEXTS = ("Timed out", "timed out", "Application timeout caused pair closure")
"""What a collective that waited past its timeout says: gloo closes every pair of the group when one operation
times out, so the operation that reports it may be another one in flight (an asynchronous combine)."""

FAILURE_TEXTS = (*TIMEOUT_TEXTS, "Connection closed by peer", "Connection reset", "Broken pipe")
"""What gloo's and NCCL's errors of a lost or stuck peer say, where they raise a plain RuntimeError."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed (torch.distributed's error, or a timeout or lost peer),
    not an error of the computation around it (out of memory, a shape mismatch), which keeps its traceback."""
    return isinstance(error, dist.DistError) or any(text in str(error) for text in FAILURE_TEXTS)


@contextmanager
def naming_collective(what: str):
    """Re-raise a collective failure inside ``what`` (e.g. "MoE layer 3 dispatch (nccl)") as CollectiveFailed
    naming it; any other error passes unchanged."""
    try:
        yield
    except CollectiveFailed:
        raise
    except RuntimeError as e:
        if not is_collective_failure(e):
            raise
        raise CollectiveFailed(f"{what} failed: {_reason(e)}") from e


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    if any(timeout in text for timeout in TIMEOUT_TEXTS):
        return f"a peer did not answer in time, likely a stuck or dead rank ({text})"
    return text


def name_other_collective(error: RuntimeError) -> CollectiveFailed | None:
    """A collective failure outside the MoE layers, named by where it happened; None if not one."""
    if not is_collective_failure(error):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if any("fsdp" in frame.filename.lower() for frame in frames):
        where = "FSDP's all-gather or reduce-scatter"
    else:
        where = "a collective" + _caller(frames)
    return CollectiveFailed(f"{where} failed: {_reason(error)}")


def _caller(frames: traceback.StackSummary) -> str:
    """' called from fn (package/file.py:line)': the innermost training-code frame, where the collective was issued."""
    for frame in reversed(frames):
        parts = Path(frame.filename).parts
        for package in ("torchtitan_ext", "torchtitan"):
            if package in parts:
                inside = "/".join(parts[parts.index(package):])
                return f" called from {frame.name} ({inside}:{frame.lineno})"
    return ""


ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
"""torch 2.13's name of the one-tensor all-gather; torch 2.11 and 2.12 have it as ``all_gather_into_tensor`` (which
2.13 deprecates)."""

REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
"""Likewise for the one-tensor reduce-scatter."""


def all_gather_single(output, tensor, group=None):
    """``dist.all_gather_single`` under this torch's name for it, looked up at each call (so that a wrapper of
    ``dist``'s function, such as the planner's collective recorder, sees the call)."""
    return getattr(dist, ALL_GATHER_SINGLE)(output, tensor, group=group)


def reduce_scatter_single(output, tensor, group=None):
    """``dist.reduce_scatter_single`` under this torch's name for it, looked up at each call."""
    return getattr(dist, REDUCE_SCATTER_SINGLE)(output, tensor, group=group)
