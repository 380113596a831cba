"""``python -m torchtitan_ext.bench NAME``: one entry for every benchmark and check; scripts/ only wraps it."""

import ast

import pytest

from tests.helpers import REPO_ROOT
from torchtitan_ext.bench.__main__ import main, names, summary


@pytest.mark.parametrize("argv, given", [([], "no name given"), (["bench_ep"], "unknown name 'bench_ep'")])
def test_a_missing_or_unknown_name_is_refused_in_one_line_naming_the_valid_ones(capsys, argv, given):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: {given}: python -m torchtitan_ext.bench NAME, NAME one of "
                            f"{', '.join(names())}\n")


def test_help_lists_every_module_with_the_first_line_of_its_docstring(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out.splitlines()[2:]
    assert [line.split()[0] for line in listed] == names()
    assert {"ep", "step", "overlap", "cluster_check", "integration_matrix"} <= set(names())
    for line, name in zip(listed, names()):
        assert summary(name) and line.split(maxsplit=1)[1] == summary(name)


def test_every_python_script_is_a_wrapper_of_a_bench_module():
    """What stays in scripts/: shell checks, and Python files that only run a bench module's main."""
    for script in sorted((REPO_ROOT / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert len(tree.body) == 3 and len(imports) == 1, f"{script.name}: more than a wrapper"
        module = imports[0].module
        assert module.startswith("torchtitan_ext.bench.") and module.removeprefix("torchtitan_ext.bench.") in names()
        assert "main" in [alias.name for alias in imports[0].names], script.name
