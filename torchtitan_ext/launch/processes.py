"""Process lifetimes of a job: no process outlives the one that started it.

Standard library only: the supervisor and every rank import it before torch.
"""

import ctypes
import ctypes.util
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: signal.Signals, parent: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent exits (Linux; elsewhere nothing).

    ``parent``: the pid the parent is known by; if it has gone already (this process was re-parented
    before the request took effect), ``signum`` is sent now.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    if ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum)) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
