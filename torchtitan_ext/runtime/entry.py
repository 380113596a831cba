"""How a command-line entry point that imports torch starts and ends.

Importing torch and torchtitan creates millions of objects, and the cyclic collector, triggered by
allocation counts, scans them again and again while they load; at exit the interpreter's teardown
collects them all once more. On a 2-core CPU these cost about 2 s and 2.5 s of every process that
imports the trainer (each rank, the launcher's pre-flight check, the dry run), and the pre-flight
check lies on the launch's critical path.

- :func:`imports_without_collection`: the collector off while the entry point's imports run (nothing
  they create is garbage), then one full collection (under 1 s), which moves what they created to the
  oldest generation, as the collector would have: left young, every process forked from this one
  (the test workers' fork server) would scan it all again at its first collection. Then the collector
  is back to its former state.
- :func:`run_and_exit`: runs ``main`` and ends the process as the interpreter would on its return or
  ``sys.exit`` (threads joined, ``atexit`` handlers run, output flushed, the same exit status) but
  without the teardown, which releases nothing the operating system does not. An exception
  propagates and ends the process the usual way, traceback and all.

Imports only the standard library: the supervisor's modules must start without torch.
"""

import atexit
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn


@contextmanager
def imports_without_collection() -> Iterator[None]:
    """The cyclic collector off for the block (an entry point's imports), one full collection after, and the
    collector restored; nested in another such block, only the outermost collects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.collect()
            gc.enable()


def exit_status(code: object) -> int:
    """The exit status the interpreter gives ``sys.exit(code)``: None is 0, an int itself, anything
    else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """``sys.exit(main())``, minus the interpreter's teardown (see the module's docstring)."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    status = exit_status(code)
    # what Py_FinalizeEx does before the teardown, in its order: join non-daemon threads (and the
    # thread pools' own shutdown hooks), then the atexit handlers (logging's flush among them)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
