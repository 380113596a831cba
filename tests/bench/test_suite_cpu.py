"""bench suite_cpu: the suite one test at a time, each test's CPU time (its processes' included) summed per file."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchtitan_ext.bench import _cpu_per_test, suite_cpu
from torchtitan_ext.runtime import cpu_time

CHILD_CPU_S = 0.5
SLEEP_S = 0.5
TESTS = f'''
import subprocess
import sys
import time

import pytest


def test_burns_cpu_in_a_child_process():
    burn = "import time\\nend = time.process_time() + {CHILD_CPU_S}\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)


def test_sleeps():
    time.sleep({SLEEP_S})


def test_skips():
    pytest.skip("nothing to do")
'''


def test_rows_sum_per_file_the_costliest_first():
    def test(node, busy, idle=1.0, wall=2.0):
        return {"test": node, "busy_cpu_s": busy, "idle_cpu_s": idle, "wall_s": wall}

    rows = suite_cpu.per_file([test("a.py::x", 1.0), test("b.py::y", 2.5), test("a.py::z", 2.0), test("a.py::w", 2.0)])
    assert rows == [
        {"file": "a.py", "tests": 3, "busy_cpu_s": 5.0, "idle_cpu_s": 3.0, "wall_s": 6.0, "costliest_test": "z",
         "costliest_busy_cpu_s": 2.0},
        {"file": "b.py", "tests": 1, "busy_cpu_s": 2.5, "idle_cpu_s": 1.0, "wall_s": 2.0, "costliest_test": "y",
         "costliest_busy_cpu_s": 2.5},
    ]


def test_a_tests_row_holds_the_busy_and_idle_time_proc_stat_counted_over_it(tmp_path, monkeypatch):
    """The plugin's hook driven by hand around a /proc/stat stand-in that the "test" advances: busy counts user, nice,
    system, irq, softirq and steal; idle counts idle and iowait (the slow test below cannot tell them apart under the
    parallel suite's load)."""
    stat = tmp_path / "stat"
    monkeypatch.setattr(cpu_time, "PROC_STAT", stat)
    tick = os.sysconf("SC_CLK_TCK")

    def counters(user, nice, system, idle, iowait, irq, softirq, steal):
        stat.write_text(f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} 0 0\ncpu0 1 2 3 4\n")

    rows = tmp_path / "rows.jsonl"
    item = SimpleNamespace(nodeid="a.py::t", config=SimpleNamespace(getoption={"suite_cpu_rows": rows}.get))
    counters(100, 10, 50, 1000, 20, 5, 5, 0)
    hook = _cpu_per_test.pytest_runtest_protocol(item, None)
    next(hook)
    counters(100 + 3 * tick, 10 + tick, 50 + 2 * tick, 1000 + 5 * tick, 20 + tick, 5 + tick, 5 + tick, tick)
    with pytest.raises(StopIteration):
        hook.send(None)
    row = json.loads(rows.read_text())
    # busy 3 + 1 + 2 + 1 + 1 + 1 ticks' worth of seconds, idle 5 + 1
    assert row["test"] == "a.py::t" and (row["busy_cpu_s"], row["idle_cpu_s"]) == pytest.approx((9.0, 6.0))


@pytest.mark.slow
def test_a_files_row_counts_the_cpu_its_tests_processes_burned(tmp_path, capsys):
    """The tests lie outside the repository: the nested pytest runs without its pyproject settings and conftest."""
    tests = tmp_path / "test_burn.py"
    tests.write_text(TESTS)
    campaign = tmp_path / "suite-cpu_cpu_2026-12-01.jsonl"
    assert suite_cpu.main(["--campaign", str(campaign), str(tests)]) == 0
    header, *rows = [json.loads(line) for line in campaign.read_text().splitlines()]
    # the file as pytest names it from the root it finds (the machine's configuration files above tmp_path count)
    assert [(row["file"].rsplit("/", 1)[-1], row["tests"]) for row in rows] == [("test_burn.py", 3)]
    # the machine's busy CPU over the tests holds the child's, whatever else the machine ran meanwhile
    assert rows[0]["busy_cpu_s"] >= 0.9 * CHILD_CPU_S
    assert rows[0]["wall_s"] >= 0.9 * CHILD_CPU_S + SLEEP_S
    # busy and idle share every core's time: in seconds, they add up to the wall time on each of the machine's CPUs
    cpus = len(re.findall(r"^cpu\d+ ", Path("/proc/stat").read_text(), re.MULTILINE))
    assert rows[0]["busy_cpu_s"] + rows[0]["idle_cpu_s"] == pytest.approx(cpus * rows[0]["wall_s"], rel=0.1)
    assert header["notes"][0].startswith("all 3 tests (2 passed, 1 skipped in ")
    assert "test_burn.py (" in capsys.readouterr().out
