"""The one job launcher (torchtitan_ext.runtime.jobs): a job that ignores SIGTERM and forks leaves nothing behind."""

import sys
import time

import pytest

from torchtitan_ext.runtime.jobs import JobFailed, run_job, RunningJob

pytestmark = pytest.mark.slow

STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:
    os.setsid()  # a session of its own, as torchrun gives each rank
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
open(sys.argv[1], "w").write(str(child))
print("started", flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_job_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(JobFailed, match=r"ran past 2 s and was stopped with every process it started; its output "
                                        r"ends:\nstarted"):
        run_job([sys.executable, "-c", STUBBORN, str(pid_file)], timeout_s=2, grace_s=0.5)
    assert not _running(int(pid_file.read_text()))


def test_a_background_job_stopped_leaves_nothing(tmp_path):
    pid_file = tmp_path / "child.pid"
    job = RunningJob([sys.executable, "-c", STUBBORN, str(pid_file)])
    assert job.next_line(time.monotonic() + 60) == "started\n"
    job.stop(grace_s=0.5)
    assert not _running(job.process.pid) and not _running(int(pid_file.read_text()))


def test_a_failed_job_is_one_error_naming_the_command():
    with pytest.raises(JobFailed, match=r"exited with status 3; its output ends:\nno\n"):
        run_job([sys.executable, "-c", "print('no'); raise SystemExit(3)"], timeout_s=60)
    assert run_job([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=60, check=False).returncode == 3
