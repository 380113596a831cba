"""Every tool's parser: a bad argument is one line that names the command as the user typed it."""

import importlib.util
import sys
import types

import pytest

from torchtitan_ext.runtime.command_line import CommandLineParser


@pytest.mark.parametrize("argv0, main_module, command", [
    ("/checkout/torchtitan_ext/plan.py", "torchtitan_ext.plan", "python -m torchtitan_ext.plan"),
    ("/checkout/torchtitan_ext/data/__main__.py", "torchtitan_ext.data.__main__", "python -m torchtitan_ext.data"),
    # the bench dispatcher writes its command into argv[0] before the benchmark builds its parser
    ("python -m torchtitan_ext.bench ep", "torchtitan_ext.bench.__main__", "python -m torchtitan_ext.bench ep"),
])
def test_a_bad_argument_is_one_line_naming_the_command(capsys, monkeypatch, argv0, main_module, command):
    run_as_main = types.ModuleType("__main__")
    run_as_main.__spec__ = importlib.util.find_spec(main_module)
    monkeypatch.setitem(sys.modules, "__main__", run_as_main)
    monkeypatch.setattr(sys, "argv", [argv0])
    parser = CommandLineParser(description="a tool")
    parser.add_argument("--world-size", type=int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--world-size", "x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: argument --world-size: invalid int value: 'x'; {command} --help lists the options\n")
    assert parser.format_usage().startswith(f"usage: {command} [-h]")
