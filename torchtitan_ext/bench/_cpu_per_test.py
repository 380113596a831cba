"""The pytest plugin of ``python -m torchtitan_ext.bench suite_cpu``: with ``--suite-cpu-rows FILE``, one JSON line
per test appended to FILE as the test ends: its node id, and the machine's busy and idle CPU-s (every core, the
processes the test started included, from /proc/stat) and wall seconds over its setup, call and teardown. Only a
run of one test at a time (``-n 0``) gives each test its own CPU time."""

import json
import time

import pytest

from torchtitan_ext.runtime.cpu_time import cpu_seconds


def pytest_addoption(parser):
    parser.addoption("--suite-cpu-rows", metavar="FILE",
                     help="bench suite_cpu: append each test's busy and idle CPU-s and wall seconds to FILE")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    rows = item.config.getoption("suite_cpu_rows")
    if rows is None:
        return (yield)
    busy, idle = cpu_seconds()
    start = time.monotonic()
    try:
        return (yield)
    finally:
        wall_s = time.monotonic() - start
        busy_after, idle_after = cpu_seconds()
        with open(rows, "a", encoding="utf-8") as output:
            output.write(json.dumps({"test": item.nodeid, "busy_cpu_s": busy_after - busy,
                                     "idle_cpu_s": idle_after - idle, "wall_s": wall_s}) + "\n")
