"""Only collective failures are renamed after the collective; every other error keeps its type and traceback."""

import pytest
import torch
import torch.distributed as dist

from torchtitan_ext.runtime.collectives import CollectiveFailed, naming_collective


def _raise_inside(error: BaseException):
    with naming_collective("MoE layer 3 dispatch (NcclExpertParallel)"):
        raise error


@pytest.mark.parametrize("error", [
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"),
    RuntimeError("Application timeout caused pair closure"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error [127.0.0.1]:4242: Broken pipe"),
], ids=["nccl_error", "gloo_timeout", "peer_gone", "gloo_timeout_of_another_operation", "peer_gone_while_sending"])
def test_a_failed_collective_is_named(error):
    with pytest.raises(CollectiveFailed, match=r"^MoE layer 3 dispatch \(NcclExpertParallel\) failed: ") as raised:
        _raise_inside(error)
    assert raised.value.__cause__ is error


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv",
    "Application timeout caused pair closure",
])
def test_a_timeout_reads_as_a_peer_that_did_not_answer(message):
    """gloo tells the operation that timed out "Timed out waiting", and every other operation then in flight on
    the group (an asynchronous combine, seen in a stuck-rank test) "Application timeout caused pair closure":
    both are the stuck peer that the launcher names (launch.supervisor.PEER_TIMEOUT)."""
    with pytest.raises(CollectiveFailed) as raised:
        _raise_inside(RuntimeError(message))
    assert str(raised.value) == ("MoE layer 3 dispatch (NcclExpertParallel) failed: a peer did not answer in time, "
                                 f"likely a stuck or dead rank ({message})")


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x256 and 128x256)"),
], ids=["out_of_memory", "shape_mismatch"])
def test_any_other_error_passes_unchanged_with_its_traceback(error):
    """Before, an out-of-memory error read "MoE layer 3 dispatch ... failed: CUDA out of memory", no traceback."""
    with pytest.raises(type(error)) as raised:
        _raise_inside(error)
    assert raised.value is error and not isinstance(raised.value, CollectiveFailed)
    assert raised.traceback[-1].name == "_raise_inside"
