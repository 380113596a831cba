"""Run a job's torchrun, relay its output, and end a failed job with one line that explains it.

``run_train.sh`` (and the SLURM script, one per node) starts torchrun through
``python -m torchtitan_ext.supervise``, whose :class:`Supervisor`

- relays torchrun's output as it comes;
- forwards preemption signals (SIGTERM, SIGUSR1, as SLURM sends them) to the
  training processes themselves, which save a checkpoint at the next step
  boundary and exit cleanly (torchrun, given SIGTERM, would kill them after
  30 s, and SIGUSR1 would kill torchrun); other signals (Ctrl-C) go to torchrun;
- exits with torchrun's status; when that is not 0, the last line names the
  rank that most likely caused the failure, how (its signal or exit status),
  the last step the job logged (its ``metrics.jsonl``, not an earlier run's), and the last complete
  checkpoint the same command resumes from; a rank killed by SIGKILL while the kernel's out-of-memory
  killer ended processes of the job's control group (or, without one, of the machine) is said to have most
  likely run out of memory.

torchrun orders failures by when it observed them, and a rank killed by a
signal leaves no error file, so its observed time is torchrun's next poll: a
peer that exited with status 1 because its collective lost that rank is often
"observed" first. A rank killed by a signal that torchrun did not send (its
stop is SIGTERM, then SIGKILL after 30 s, each announced in its log) is
therefore named before ranks that exited with a status.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torchtitan_ext.launch.processes import die_with_parent
from torchtitan_ext.records.checkpoint_folder import checkpoint_steps
from torchtitan_ext.records.metrics import METRICS_FILE, read_metrics
from torchtitan_ext.runtime.cgroups import oom_kills
from torchtitan_ext.runtime.preemption import PREEMPTION_SIGNALS

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
FAILURE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
FAILURE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
ROOT_CAUSE_HEADING = "Root Cause (first observed failure):"
STOPPED_BY_TORCHRUN = re.compile(r"Sending process (\d+) closing signal")
TORCHRUN_TRACEBACK = "Traceback (most recent call last):"
"""How torchrun's own traceback starts (a rank's lines start with its "[rankN]:" prefix)."""
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
USAGE_ERROR = re.compile(r"^(?:torchrun|run\.py): error: (.+)$")
"""torchrun's own usage error (argparse's last line, exit 2): it started no rank."""
PEER_TIMEOUT = "a peer did not answer in time"
"""What a rank's one-line error says when a collective timed out (torchtitan_ext.runtime.collectives)."""
STALLED_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a debugger", "D": "in uninterruptible sleep (I/O or a driver)"}
SHUTDOWN_GRACE_S = 30
"""How long processes left in the job's group after torchrun ends (or after this supervisor is told to
stop) get between SIGTERM and SIGKILL."""


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def stalled_ranks(torchrun_pid: int) -> list[tuple[int, int, str]]:
    """(rank, pid, state) of torchrun's training processes that are stopped or in uninterruptible sleep."""
    found = []
    for pid in children(torchrun_pid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [int(entry[5:]) for entry in environ if entry.startswith(b"RANK=")]
        if state in STALLED_STATES and ranks:
            found.append((ranks[0], pid, state))
    return sorted(found)


@dataclass
class Failure:
    """One entry of torchrun's failure report."""

    rank: int
    root_cause: bool
    exit_code: int | None = None
    pid: int | None = None


class Supervisor:
    def __init__(self, command: list[str], checkpoint_folder: Path | None, dump_folder: Path | None = None):
        self.command = command
        self.checkpoint_folder = checkpoint_folder
        self.dump_folder = dump_folder
        """Where the job writes its ``metrics.jsonl`` (None: unknown, the failure line names no step)."""
        self.metrics_before = self._metrics_file_state()
        """That file's modification time and size before the job starts: until the job logs a step, its lines
        are an earlier run's (the job's first write drops those of its own steps onwards)."""
        self.oom_kills_before = oom_kills()
        """The out-of-memory killer's count before the job starts (where it counts, how many): a rank killed by SIGKILL
        while it grows most likely ran out of memory (the killer's signal; where only the machine's count is
        kept, another job on the machine may be the one it ended)."""
        self.failures: list[Failure] = []
        self.in_root_cause = False
        self.stopped_by_torchrun: set[int] = set()
        self.process: subprocess.Popen | None = None
        self.closed_streams: set[int] = set()
        self.usage_error: str | None = None
        """What torchrun said of its command line when it refused it."""
        self.stalled: list[tuple[int, int, str]] = []
        """(rank, pid, process state) of the local ranks that had stopped making progress when a peer's
        collective timed out."""

    def _metrics_file_state(self) -> tuple[int, int] | None:
        if self.dump_folder is None:
            return None
        try:
            stat = (Path(self.dump_folder) / METRICS_FILE).stat()
        except OSError:  # not there yet, or no folder: no step of this job's is in it
            return None
        return stat.st_mtime_ns, stat.st_size

    def forward(self, signum, frame) -> None:
        if self.process is None:
            return
        if signum in PREEMPTION_SIGNALS:
            workers = children(self.process.pid)
            for pid in workers or [self.process.pid]:
                try:
                    os.kill(pid, signum if workers else signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return
        self.process.send_signal(signum)

    def run(self) -> int:
        """Run the command to its end; its exit status (128 + N for a command killed by signal N, as a shell
        reports it). The command runs in its own process group, ended with this process whatever ends it."""
        for signum in (*PREEMPTION_SIGNALS, signal.SIGINT):
            signal.signal(signum, self.forward)
        # a closed terminal: the job saves and stops as on preemption, instead of running on unseen
        signal.signal(signal.SIGHUP, lambda signum, frame: self.forward(signal.SIGTERM, frame))
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            process_group=0, preexec_fn=partial(die_with_parent, signal.SIGTERM, os.getpid()),
        )
        held: list[str] = []
        try:
            for line in self.process.stdout:
                plain = ANSI_ESCAPE.sub("", line)
                self._read(plain)
                # torchrun's own traceback of a failed rank says nothing its failure report does not: it is
                # held back, and dropped once it turns out to be that (any other traceback is shown whole)
                if plain.startswith(TORCHRUN_TRACEBACK) or held:
                    held.append(line)
                    if CHILD_FAILED in plain:
                        held = []
                    continue
                self._relay(line)
            returncode = self.process.wait()
        finally:
            for line in held:
                self._relay(line)
            self._end_process_group()
        status = 128 - returncode if returncode < 0 else returncode
        if status != 0:
            self._relay(self.explain(status) + "\n", sys.stderr)
        return status

    def _relay(self, text: str, stream=None) -> None:
        """Write to stdout (or ``stream``); once the reader has gone (``| head``), keep reading the job's output
        without writing it, so that the job is neither blocked nor killed by a full pipe."""
        stream = stream or sys.stdout
        if stream.fileno() in self.closed_streams:
            return
        try:
            stream.write(text)
            stream.flush()
        except (BrokenPipeError, ValueError):
            self.closed_streams.add(stream.fileno())
            # Python's own flush at exit would report the closed pipe again
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())

    def _end_process_group(self) -> None:
        """SIGTERM, then SIGKILL after SHUTDOWN_GRACE_S, to whatever of the command's process group is left."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                return
            while time.monotonic() < deadline:
                self.process.poll()  # reaps the command itself once it exits
                try:
                    os.killpg(self.process.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)

    def _read(self, line: str) -> None:
        usage_error = USAGE_ERROR.match(line)
        if usage_error:
            self.usage_error = usage_error.group(1)
        if PEER_TIMEOUT in line and not self.stalled and self.process is not None:
            self.stalled = stalled_ranks(self.process.pid)
        stopped = STOPPED_BY_TORCHRUN.search(line)
        if stopped:
            self.stopped_by_torchrun.add(int(stopped.group(1)))
        if ROOT_CAUSE_HEADING in line:
            self.in_root_cause = True
        rank = FAILURE_RANK.match(line)
        if rank:
            self.failures.append(Failure(rank=int(rank.group(1)), root_cause=self.in_root_cause))
        exit_code = FAILURE_EXIT.match(line)
        if exit_code and self.failures:
            self.failures[-1].exit_code, self.failures[-1].pid = int(exit_code.group(1)), int(exit_code.group(2))

    def culprit(self) -> "Failure | None":
        """The failure to name: a rank killed by a signal torchrun did not send, else torchrun's root cause."""
        killed = [
            f for f in self.failures
            if f.exit_code is not None and f.exit_code < 0 and f.pid not in self.stopped_by_torchrun
        ]
        ordered = sorted(killed, key=lambda f: not f.root_cause) or [f for f in self.failures if f.root_cause]
        return (ordered or self.failures or [None])[0]

    def _out_of_memory(self) -> str:
        """What the out-of-memory killer did while the job ran, where it ended processes of the job's control group
        (or the machine); "" where it ended none, or the kernel does not count."""
        now = oom_kills()
        if now is None or self.oom_kills_before is None or now[0] != self.oom_kills_before[0]:
            return ""
        (where, count), before = now, self.oom_kills_before[1]
        if count <= before:
            return ""
        ended = count - before
        return (f", most likely out of memory: the kernel's out-of-memory killer ended {ended} "
                f"process{'es' if ended > 1 else ''} {where} while the job ran; give the job more memory or make it "
                "smaller (training.local_batch_size, training.seq_len, model.flavor)")

    def explain(self, returncode: int) -> str:
        """The one line that ends a failed job."""
        who = "a training process"
        failure = self.culprit()
        if self.usage_error is not None:
            # no rank started: the dump folder's steps and checkpoints are an earlier run's
            return f"error: torchrun refused its command line: {self.usage_error} (exit {returncode}); no rank started"
        if self.stalled:
            rank, pid, state = self.stalled[0]
            who = f"rank {rank} (pid {pid}) stopped making progress: it was {STALLED_STATES[state]} when its peers' collective timed out"
        elif failure is not None and failure.exit_code is not None:
            code = failure.exit_code
            how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
            who = f"rank {failure.rank} (pid {failure.pid}) {how}"
            if code == -signal.SIGKILL:
                who += self._out_of_memory()
        elif failure is not None:
            who = f"rank {failure.rank} failed"
        written = self.dump_folder is not None and self._metrics_file_state() != self.metrics_before
        logged = read_metrics(self.dump_folder) if written else []
        after = f"after step {logged[-1]['step']}" if logged else "before logging a step"
        steps = checkpoint_steps(self.checkpoint_folder)[0] if self.checkpoint_folder is not None else []
        # a job that stopped before its first step failed in its start, which a rerun repeats until the cause is gone
        rerun = "rerun the same command" if logged else "fix the cause above and rerun the same command"
        if steps:
            resume = f"{rerun} to resume from the last complete checkpoint, step {steps[-1]} ({self.checkpoint_folder / f'step-{steps[-1]}'})"
        elif self.checkpoint_folder is not None:
            resume = f"no complete checkpoint in {self.checkpoint_folder} yet: a rerun starts over"
        else:
            resume = "checkpointing is off (checkpoint.enable): a rerun starts over"
        return f"error: {who}; the job stopped {after} (exit {returncode}); {resume}"
