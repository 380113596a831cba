"""The supervisor (python -m torchtitan_ext.supervise) never dies before its job, never leaves one behind.

The supervised command is a stand-in for torchrun: it starts one child (a
stand-in rank) and reports to files what each receives, so every check reads
processes and files, not timings.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import descendants, REPO_ROOT, run_job

FAKE_TORCHRUN = """\
import os, signal, subprocess, sys, time
folder = sys.argv[1]
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], folder])
def stop(signum, frame):  # as torchrun does: the signal goes on to the rank, whose end ends this
    open(os.path.join(folder, "torchrun_" + signal.Signals(signum).name), "w").close()
    rank.send_signal(signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
for line in range(int(os.environ.get("LINES_OUT", "0"))):
    print(f"line {line}: " + "x" * 200, flush=True)
print("torchrun ready", flush=True)
if os.environ.get("KILL_SELF"):
    while not os.path.exists(os.path.join(folder, "rank_ready")):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
status = rank.wait()
open(os.path.join(folder, "torchrun_finished"), "w").close()
sys.exit(status)
"""
FAKE_RANK = """\
import os, signal, sys, time
from torchtitan_ext.launch.processes import die_with_parent
die_with_parent(signal.SIGTERM, os.getppid())  # as a training process does
folder = sys.argv[1]
def stop(signum, frame):
    open(os.path.join(folder, "rank_" + signal.Signals(signum).name), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(folder, "rank_ready"), "w").close()
deadline = time.monotonic() + float(os.environ.get("RANK_SECONDS", "120"))
while time.monotonic() < deadline:
    time.sleep(0.05)
open(os.path.join(folder, "rank_finished"), "w").close()
"""


def _supervise(folder: Path, stdout=subprocess.PIPE, **env: str) -> subprocess.Popen:
    torchrun = folder / "torchrun.py"
    torchrun.write_text(FAKE_TORCHRUN)
    return subprocess.Popen(
        [sys.executable, "-m", "torchtitan_ext.supervise", "--", sys.executable, str(torchrun), str(folder), FAKE_RANK],
        cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
        start_new_session=True,
    )


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.05)


def _all_gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _job_pids(supervisor: subprocess.Popen, folder: Path) -> list[int]:
    """torchrun's and its rank's pids, once the rank handles SIGTERM."""
    _wait_for(folder / "rank_ready")
    pids = descendants(supervisor.pid)
    assert len(pids) == 2, pids
    return pids


@pytest.mark.slow
def test_a_closed_stdout_leaves_the_job_running_to_its_end(tmp_path):
    """./run_train.sh | head -n 3: the supervisor used to die of BrokenPipeError and leave torchrun and the
    ranks running under init. It keeps reading (and dropping) the output; the job ends on its own."""
    read_end, write_end = os.pipe()
    supervisor = _supervise(tmp_path, stdout=write_end, LINES_OUT="2000", RANK_SECONDS="3")
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        assert reader.readline().startswith("line 0:")
    # the reader is gone: the next writes hit a closed pipe
    assert supervisor.wait(timeout=120) == 0
    assert "Traceback" not in supervisor.stderr.read()
    assert (tmp_path / "rank_finished").exists() and (tmp_path / "torchrun_finished").exists()


@pytest.mark.slow
def test_a_killed_supervisor_takes_its_job_with_it(tmp_path):
    """SIGKILL of the supervisor (nothing it can catch): torchrun gets SIGTERM from the kernel (parent-death
    signal) and stops its rank; nothing is left."""
    supervisor = _supervise(tmp_path)
    pids = _job_pids(supervisor, tmp_path)
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait(timeout=30)
    _wait_for(tmp_path / "torchrun_SIGTERM")
    _wait_for(tmp_path / "rank_SIGTERM")
    assert _all_gone(pids)


@pytest.mark.slow
def test_a_hangup_stops_the_job_as_a_preemption(tmp_path):
    """A closed terminal (SIGHUP): the ranks get SIGTERM, the preemption signal, and the job ends."""
    supervisor = _supervise(tmp_path)
    pids = _job_pids(supervisor, tmp_path)
    os.kill(supervisor.pid, signal.SIGHUP)
    assert supervisor.wait(timeout=60) == 0
    assert (tmp_path / "rank_SIGTERM").exists()
    assert _all_gone(pids)


@pytest.mark.slow
def test_a_command_killed_by_a_signal_exits_128_plus_it(tmp_path):
    """A SIGKILLed torchrun gave exit 247 (Python's -9 as a byte); shells say 137."""
    supervisor = _supervise(tmp_path, KILL_SELF="1")
    assert supervisor.wait(timeout=60) == 137
    assert supervisor.stderr.read().strip().splitlines()[-1].startswith("error: ")


@pytest.mark.slow
def test_no_command_is_one_line():
    result = run_job([sys.executable, "-m", "torchtitan_ext.supervise"], cwd=REPO_ROOT, timeout_s=60, check=False)
    assert result.returncode == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].endswith("error: no command to supervise: python -m "
                                                          "torchtitan_ext.supervise [--checkpoint-folder DIR] [--dump-folder DIR] -- "
                                                          "torchrun ...")


@pytest.mark.slow
def test_the_supervisor_and_a_ranks_preemption_flag_import_no_torch():
    """The supervisor must start at once and outlive whatever the job does; what it shares with the ranks (the
    preemption signals) therefore needs nothing beyond the standard library."""
    probe = ("import sys, torchtitan_ext.supervise, torchtitan_ext.runtime.preemption; "
             "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'torchtitan', 'numpy'}))")
    result = run_job([sys.executable, "-c", probe], cwd=REPO_ROOT, timeout_s=60)
    assert result.output.strip() == "[]", result.output


@pytest.mark.parametrize("port", ["99999", "abc", "0"])
def test_a_port_that_is_not_one_is_one_line(capsys, port):
    from torchtitan_ext.config import ConfigError
    from torchtitan_ext.launch.preflight import check_port_free

    with pytest.raises(ConfigError, match=rf"^MASTER_PORT='{port}' is not a port number: set it to an integer from 1 "):
        check_port_free(port)


def test_a_torchrun_without_the_launchers_options_stops_the_preflight_in_one_line(monkeypatch, capsys):
    """torch 2.11.0's torch/distributed/run.py has no --shutdown-timeout (2.12.0's has, read from their wheels); its
    torchrun stopped a GPU machine's launch at its own usage line. The preflight refuses it first, and accepts this
    torch's torchrun."""
    import argparse

    from torchtitan_ext.launch import preflight

    preflight.check_torchrun()
    without_the_option = argparse.ArgumentParser(prog="torchrun")
    without_the_option.add_argument("training_script")
    monkeypatch.setattr(preflight, "torchrun_parser", lambda: without_the_option)
    monkeypatch.setattr(preflight, "init_logger", lambda *args: None)  # its handler would keep capsys's stream
    with pytest.raises(SystemExit) as stopped:
        preflight.main(["--ngpu", "1", "--", "--job.config_file", "train_configs/debug_model.toml"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"error: torch {torch.__version__} is installed, and its torchrun has no --shutdown-timeout, which this "
        "launcher passes (torch 2.12 and later have it): pip install torch==2.13.0 (the build for this machine)\n")


def test_a_port_left_in_time_wait_is_free():
    """The last run's connections in TIME_WAIT do not keep torchrun from binding (SO_REUSEADDR): the check
    used to refuse such a port."""
    from torchtitan_ext.launch.preflight import check_port_free

    port = _port_in_time_wait()
    assert check_port_free(str(port)) == port


def _port_in_time_wait() -> int:
    """A port whose accepted connection the server closed first: that side stays in TIME_WAIT, nothing listens.
    The listener sets SO_REUSEADDR, as torch's TCPStore (the rendezvous) does."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("localhost", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("localhost", port))
    served, _ = listener.accept()
    served.close()
    time.sleep(0.1)
    client.close()
    listener.close()
    states = [line.split()[3] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if line.split()[1].endswith(f":{port:04X}")]
    assert "06" in states, f"no TIME_WAIT connection on port {port}: {states}"
    return port
