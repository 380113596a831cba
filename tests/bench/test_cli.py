"""``python -m torchtitan_ext.bench NAME``: the one name of every benchmark and check."""

import pytest

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
