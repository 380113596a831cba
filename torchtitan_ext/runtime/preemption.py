"""The signals that preempt a job (SIGTERM, and SIGUSR1: SLURM's warning before it) and a rank's flag for them.

Standard library only, so that the supervisor (:mod:`torchtitan_ext.launch.supervisor`), which forwards these
signals to the ranks, starts fast; the ranks' trainer stops at the next step boundary once the flag is set
(:mod:`torchtitan_ext.training.faults`).
"""

import signal

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionRequest:
    """SIGTERM / SIGUSR1 set a flag; nothing else happens in the signal handler."""

    def __init__(self):
        self.signal_name: str | None = None

    def install(self) -> None:
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
