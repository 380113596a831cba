"""The argument parser of every command-line tool: its usage names the command as typed, and a bad argument is
one line.

argparse names the program after the script's file (``plan.py``, ``__main__.py``) and prints the whole usage before
an error: with twenty options, the line that matters comes last. Imports only the standard library: the
supervisor's modules must start without torch.
"""

import argparse
import sys


class CommandLineParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose program is the command as typed (:func:`command_as_typed`) and whose
    errors are one line on stderr with exit status 2: ``error: <argparse's message>; <command> --help lists the
    options``. The description and epilog are shown as written (the tools' docstrings are their help)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("prog", command_as_typed())
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message}; {self.prog} --help lists the options\n")


def command_as_typed() -> str:
    """``python -m <module>`` for the module this process runs as ``__main__``; ``sys.argv[0]`` itself where a
    dispatcher wrote the command there (``python -m torchtitan_ext.bench NAME``), or where no module was run."""
    if sys.argv and sys.argv[0].startswith("python -m "):
        return sys.argv[0]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return sys.argv[0] if sys.argv and sys.argv[0] else "python"
