"""How a command-line entry point that imports torch starts and ends.

Importing torch and torchtitan creates millions of objects, and the cyclic collector, triggered by
allocation counts, scans them again and again while they load; at exit the interpreter's teardown
collects them all once more. On a 2-core CPU these cost about 2 s and 2.5 s of every process that
imports the trainer (each rank, the launcher's pre-flight check, the dry run), and the pre-flight
check lies on the launch's critical path.

- :func:`imports_without_collection`: the collector off while the entry point's imports run, then
  every object the collector tracks in the process frozen (``gc.freeze``: moved, at no cost, to a
  generation no collection scans), the imports' unreachable cycles included, which are kept to the
  exit and never finalized. A full collection instead took 0.4 s of every such process on a 2-core
  CPU, to free about 10,000 objects of the 785,000 (the resident memory is the same, 526 MiB, either
  way), and every later full collection, in it or in a process forked from it (the test workers'
  fork server), scanned them all again. Then the collector is back to its former state. At exit
  (``atexit``) the frozen objects are unfrozen, so that a process that ends with Python's teardown
  (the fork server, a test run) frees them; else triton's bindings (nanobind) report the objects they
  still hold as leaked.
- :func:`run_and_exit`: runs ``main`` and ends the process as the interpreter would on its return or
  ``sys.exit`` (threads joined, ``atexit`` handlers run, output flushed, the same exit status, then
  the C library's ``exit``) but without Python's teardown of its modules, which releases nothing the
  operating system does not. An exception propagates and ends the process the usual way, traceback
  and all.

Imports only the standard library: the supervisor's modules must start without torch.
"""

import atexit
import ctypes
import gc
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn


@contextmanager
def imports_without_collection() -> Iterator[None]:
    """The cyclic collector off for the block (an entry point's imports), every tracked object frozen after, and
    the collector restored; nested in another such block, only the outermost freezes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            atexit.unregister(gc.unfreeze)  # registered once, however many blocks ran
            atexit.register(gc.unfreeze)
            gc.enable()


def exit_status(code: object) -> int:
    """The exit status the interpreter gives ``sys.exit(code)``: None is 0, an int its low 8 bits (255
    beyond a C long), anything else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(2**63) <= code < 2**63 else 0xFF
    print(code, file=sys.stderr if sys.stderr is not None else sys.__stderr__)
    return 1


def _flush_streams() -> bool:
    """Flush the standard streams, as the interpreter does at exit (skipping those gone or closed); False if one
    could not be flushed (a closed pipe)."""
    flushed = True
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is None or stream.closed:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            flushed = False
    return flushed


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """``sys.exit(main())``, minus the interpreter's teardown (see the module's docstring)."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    status = exit_status(code)
    # what Py_FinalizeEx does before the teardown, in its order: join non-daemon threads (and the
    # thread pools' own shutdown hooks), then the atexit handlers (logging's flush among them)
    try:
        threading._shutdown()
    except BaseException:  # as the interpreter does: reported, and the exit goes on
        traceback.print_exc()
    atexit._run_exitfuncs()
    if not _flush_streams():
        status = 120  # the interpreter's status when it cannot flush at exit
    # the C library's exit, not os._exit: C atexit handlers and static destructors (a profiler's, a
    # communication library's) still run and C stdio buffers are flushed; only Python's teardown is skipped.
    # PyDLL keeps the GIL held, as those handlers may touch Python objects.
    ctypes.PyDLL(None).exit(status)
