"""An entry point's end without the interpreter's teardown (torchtitan_ext.runtime.entry) behaves as
``sys.exit(main())``: the same output, in the same order, and the same exit status."""

import os
import sys

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.runtime.jobs import run_job

pytestmark = pytest.mark.slow

PROGRAM = """
import atexit, gc, sys, threading, time
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit
with imports_without_collection():
    import json
print("collector on after the imports:", gc.isenabled())
atexit.register(lambda: print("atexit handler ran"))

def late_thread():
    time.sleep(0.3)
    print("non-daemon thread finished")

def main():
    threading.Thread(target=late_thread).start()
    sys.stdout.write("buffered output, no newline")
    print("on stderr", file=sys.stderr)
    {end}

if sys.argv[1] == "entry":
    run_and_exit(main)
sys.exit(main())
"""


@pytest.mark.parametrize("end", ["return None", "return 3", "sys.exit(True)", "sys.exit(-1)", "sys.exit('a message')", "raise ValueError('x')"])
def test_run_and_exit_ends_as_sys_exit_does(end):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # stdout block-buffered
    program = PROGRAM.format(end=end)
    ended = {how: run_job([sys.executable, "-c", program, how], timeout_s=60, check=False, env=env, cwd=REPO_ROOT)
             for how in ("entry", "sys.exit")}
    assert ended["entry"].returncode == ended["sys.exit"].returncode
    # a traceback's frames differ (run_and_exit is one of them); its exception line does not
    frames = {how: [line for line in job.output.splitlines() if not line.startswith("  ")] for how, job in ended.items()}
    assert frames["entry"] == frames["sys.exit"]
    assert "non-daemon thread finished" in ended["entry"].output and "atexit handler ran" in ended["entry"].output
    assert "collector on after the imports: True" in ended["entry"].output
