"""The runtime module: device choice and the CPU accommodations for torchtitan."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torchtitan.components.metrics as tt_metrics
import torchtitan.distributed.utils as tt_dist_utils
import torchtitan.tools.utils as tt_utils
from torch.distributed.fsdp import fully_shard

from torchtitan_ext import runtime
from torchtitan_ext.runtime.jobs import run_job

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU accommodations apply only without CUDA")


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime():
    assert runtime.configure() == "cpu"


def test_torchtitan_sees_cpu_device():
    assert tt_utils.device_type == "cpu"
    assert tt_dist_utils.device_type == "cpu"
    assert tt_metrics.device_type == "cpu"
    assert tt_utils.device_module is torch.cpu


def test_configure_is_idempotent():
    histc = torch.histc
    assert runtime.configure() == "cpu"
    assert torch.histc is histc


def test_histc_counts_integer_ids_like_cuda():
    ids = torch.tensor([[0, 3], [3, 7], [5, 3]], dtype=torch.int64)
    counts = torch.histc(ids.view(-1), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(ids.view(-1), minlength=8).tolist()


def test_histc_floats_unchanged():
    values = torch.tensor([0.1, 0.2, 0.9, 1.5])
    assert torch.histc(values, bins=2, min=0, max=1).tolist() == [2.0, 1.0]


def test_permute_indices_run_on_host():
    import torchtitan.models.moe.utils as moe_utils

    # two ranks x two local experts; expert 0 gets 2+1 tokens, expert 1 gets 0+3
    counts = torch.tensor([2, 0, 1, 3], dtype=torch.int64)
    indices, sizes, _ = moe_utils.generate_permute_indices(counts, 2, 2, 32, 8)
    assert sizes.tolist() == [8, 8]
    assert indices[:3].tolist() == [0, 1, 2]
    assert indices[8:11].tolist() == [3, 4, 5]


def test_memory_monitor_reports_process_memory():
    monitor = tt_metrics.build_device_memory_monitor()
    stats = monitor.get_peak_stats()
    assert 0 < stats.max_active_gib <= stats.max_reserved_gib + 1e-6
    assert 0 < stats.max_reserved_pct < 100
    monitor.reset_peak_stats()


def test_mfu_is_undefined_on_cpu():
    assert math.isnan(tt_utils.get_peak_flops("cpu"))


def test_fsdp_reductions_forced_to_sum(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        runtime.adapt_model_parts([model])
        groups = [m._get_fsdp_state()._fsdp_param_group for m in [*model, model]]
        assert all(g.force_sum_reduction_for_comms for g in groups if g is not None)
        model(torch.randn(2, 4)).sum().backward()
        # set_pg_timeouts: gloo's barrier without device ids
        from torchtitan.distributed import ParallelDims

        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        dims.build_mesh()
        from datetime import timedelta

        tt_dist_utils.set_pg_timeouts(timedelta(seconds=30), dims)
    finally:
        dist.destroy_process_group()


def test_process_limit_on_cpu():
    import os

    assert runtime.max_local_world_size() == 4 * os.cpu_count()


_HEAP_PROBE = """
import os
import torch
from torchtitan_ext import runtime
from torchtitan_ext.runtime.jobs import run_job

torch.set_num_threads(1)
runtime.configure()
BLOCK = 64 * 2**20

def anonymous_bytes():
    # the process's anonymous memory (heap and mmaps): library code paged in is file-backed, not counted
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0]) * 1024

def kept_after_freeing_a_block():
    before = anonymous_bytes()
    block = torch.ones(BLOCK // 4)  # touched, so resident
    del block
    return anonymous_bytes() - before

kept_after_freeing_a_block()  # warm-up: first-use allocations of torch and the allocator, not measured
print(kept_after_freeing_a_block())
runtime.keep_freed_memory_in_heap()
print(kept_after_freeing_a_block())
before = anonymous_bytes()
runtime.release_freed_memory()
print(before - anonymous_bytes())
"""


@pytest.mark.slow
def test_freed_memory_goes_back_unless_kept_and_release_returns_it():
    """Training returns freed blocks to the kernel; the benchmarks' setting keeps them until released.

    In a fresh interpreter, since the glibc setting is process-wide; anonymous memory only, after a
    warm-up, one thread (total resident memory also counted ~7 MiB of library code and an OpenMP
    thread paged in by the first block, and once crossed an 8 MiB bound). Bounds are shares of the block.
    """
    block = 64 * 2**20
    result = run_job([sys.executable, "-c", _HEAP_PROBE], timeout_s=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    returned, kept, released = (int(line) for line in result.output.split()[-3:])
    assert returned < block // 8, result.output
    assert kept > block // 2, result.output
    assert released > block // 2, result.output
