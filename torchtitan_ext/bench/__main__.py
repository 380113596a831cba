"""``python -m torchtitan_ext.bench NAME [args]``: runs the benchmark or check NAME (a module of this package)."""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

from torchtitan_ext.config import ConfigError
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

PACKAGE = Path(__file__).parent


def names() -> list[str]:
    """The benchmarks and checks: this package's modules."""
    return sorted(module.name for module in pkgutil.iter_modules([str(PACKAGE)]) if not module.name.startswith("_"))


def summary(name: str) -> str:
    """The first line of module ``name``'s docstring, read without importing it (most import torch)."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / f"{name}.py").read_text(encoding="utf-8"))) or ""
    return docstring.split("\n", 1)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    valid = names()
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m torchtitan_ext.bench NAME [args]  (NAME --help: its arguments)\n")
        width = max(map(len, valid))
        print("\n".join(f"  {name:<{width}}  {summary(name)}" for name in valid))
        return 0
    if not argv or argv[0] not in valid:
        given = f"unknown name '{argv[0]}'" if argv else "no name given"
        print(f"error: {given}: python -m torchtitan_ext.bench NAME, NAME one of {', '.join(valid)}", file=sys.stderr)
        return 2
    name, *args = argv
    # NAME's parser names the command by sys.argv[0] (runtime.command_line): the command as typed, for its usage and
    # errors; put back after, for a caller in the same process
    program, sys.argv[0] = sys.argv[0], f"python -m torchtitan_ext.bench {name}"
    try:
        with imports_without_collection():
            module = importlib.import_module(f"{__package__}.{name}")
        return module.main(args)
    except ConfigError as e:  # a bad option or input file: one line, before anything is measured
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv[0] = program


if __name__ == "__main__":
    run_and_exit(main)
