"""Session fixtures, the suite's machine-independent settings, and its tiers.

A test that starts a process (a launcher, torchrun, workers of its own) or runs a training job is marked
``slow``; ``./test.sh --fast`` runs the others. The mark is held, not trusted: an unmarked test that starts a
process fails, naming the mark it needs.
"""

import logging
import multiprocessing.process
import os
import platform
import subprocess
from unittest.mock import patch

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.runtime.entry import imports_without_collection

# Every job in the suite behaves as on a CPU without bf16 matrix units (fp32 by
# default), so that no test's speed or numerics depend on the CPU's bf16 support.
os.environ.setdefault("TORCHTITAN_EXT_CPU_BF16", "emulated")


@pytest.fixture(scope="session")
def embedded_assets():
    """The embedded corpus and tokenizer, built once into the default directory."""
    from torchtitan_ext.data import DEFAULT_ASSETS_DIR, ensure_assets

    return ensure_assets(REPO_ROOT / DEFAULT_ASSETS_DIR)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (no process started)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.hookimpl(wrapper=True)
def pytest_collection():
    """The test files' imports (torch, torchtitan) without the cyclic collector, as the entry points'."""
    with imports_without_collection():
        return (yield)


def pytest_terminal_summary(terminalreporter):
    """Times a test measured and asserted a bound on (record_property("measured", ...)), one line each,
    so that a suite's log carries them (docs/reliability.md quotes them)."""
    lines = [
        f"{report.nodeid}: {value}"
        for report in terminalreporter.stats.get("passed", [])
        for name, value in report.user_properties
        if name == "measured"
    ]
    if lines:
        terminalreporter.section("measured times")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable CPU, and one more where the slow tier runs. Its tests wait (on the
    processes they start, on peers' collectives and deadlines, on torchtitan's 2 s at a job's end) and the extra
    worker computes meanwhile: on 2 cores the suite's idle CPU time fell from 45 to 10 s and its time to 0.92 of
    a worker per CPU's (benchmarks/suite-time-a-worker-more_epyc-avx512bf16_2026-11-30.jsonl). The fast tier
    waits on nothing: there a third worker only adds its own start."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # the count the caller set: pytest-xdist's own hook reads it
    cpus = len(os.sched_getaffinity(0))
    return cpus if "not slow" in (config.getoption("markexpr") or "") else cpus + 1


def pytest_configure(config):
    # matplotlib lists the machine's fonts with a process (fc-list) the first time it is imported where it has no
    # font cache yet: done here, before any test, so that an unmarked test that plots does not start it
    import matplotlib.font_manager  # noqa: F401

    # the same for platform.processor(), which runs `uname -p` once per process (the memory monitor's device name and
    # the benches' machine line read it): else the first unmarked test to call it in a worker fails, whichever it is
    platform.processor()

    # pytest-xdist runs one worker per usable CPU: torch's default of one intra-op thread per CPU in every worker
    # oversubscribes the machine, and the threads that wait spin on the cores the other workers need (on 2 cores
    # the fast tier's CPU time falls by 12 to 19% with one thread per worker). The processes a test starts set
    # their own (the launcher's OMP_NUM_THREADS, run_workers' one thread per rank).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def _refuse_process_start(*args, **kwargs):
    raise AssertionError("this test starts a process: mark it @pytest.mark.slow (./test.sh --fast runs only "
                         "tests that start none)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """An unmarked test, with the fixtures its setup instantiates, may start no process."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse_process_start)
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse_process_start)
        return (yield)


@pytest.fixture(autouse=True)
def _torchtitan_compile_left_undone():
    """torchtitan's ``apply_compile`` swaps its module-level grouped-experts function for a compiled one and sets
    dynamo's ``capture_scalar_outputs``, for the whole process: a test that parallelizes a job with compile enabled
    (a dry run of the 671B config) would hand both to every later test of its worker."""
    import torch._dynamo
    from torchtitan.models.moe import moe

    original = moe._run_experts_grouped_mm
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs):
        yield
    moe._run_experts_grouped_mm = original


@pytest.fixture(autouse=True)
def _root_logger_left_as_found():
    """A tool's ``main`` called in the test process (the launcher's pre-flight check, say) sets up the console's
    logging: the root logger's level, handlers and filters, and the handlers' own filters, for the whole process.
    Each test leaves them as it found them, so that what a later test of its worker logs does not depend on which
    tests ran before it."""
    root = logging.getLogger()
    handlers, level, filters = root.handlers[:], root.level, root.filters[:]
    handler_filters = [handler.filters[:] for handler in handlers]
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    root.filters[:] = filters
    for handler, kept in zip(handlers, handler_filters):
        handler.filters[:] = kept


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """A backend's buffer exports its library's environment for the whole process (HybridEP's NVLink domain), as a
    training rank's must: built in the test process, it would hand those variables to every later test of its worker
    and to the processes they start (a launcher test would see a job's variables it never set). Each test leaves the
    environment as it found it."""
    with patch.dict(os.environ):
        yield
