"""bench suite_cpu: the suite one test at a time, each test's CPU time (its processes' included) summed per file."""

import json

import pytest

from torchtitan_ext.bench import suite_cpu

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


@pytest.mark.slow
def test_a_files_row_counts_the_cpu_its_tests_processes_burned(tmp_path, capsys):
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
    assert header["notes"][0].startswith("all 3 tests (2 passed, 1 skipped in ")
    assert "test_burn.py (" in capsys.readouterr().out
