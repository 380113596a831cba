"""The backend table (torchtitan_ext/ep/backends.py) is the one list of backends and variants: no other file of the
package, the tests or the launch scripts writes one out."""

import re

from tests.helpers import REPO_ROOT
from torchtitan_ext.ep.backends import BACKENDS, CPU_VARIANTS, MATRIX_VARIANTS, TABLE, VARIANTS

OWNERS = {"torchtitan_ext/ep/backends.py", *(f"torchtitan_ext/ep/{backend.name}.py" for backend in TABLE),
          "tests/ep/test_backend_table.py"}
"""The table, each backend's module (which names its own variants), and this file's examples."""


def _literal_lists(text: str, names: list[str]) -> list[str]:
    name = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    quoted = rf"""["'](?:{name})["']"""
    # three names or more in a row: a set meant as all backends or a named part of them (a pair chosen for one
    # comparison is the test's own choice)
    python = re.compile(rf"{quoted}\s*,\s*{quoted}\s*,\s*{quoted}")  # ("nccl", "deepep", "hybridep" ...
    shell = re.compile(rf"\(\s*(?:{name})\s+(?:{name})\s+(?:{name})\b")  # VARIANTS=(nccl deepep hybridep ...)
    return [match.group(0) for pattern in (python, shell) for match in pattern.finditer(text)]


def test_no_literal_list_of_backends_or_variants_outside_the_table():
    names = [*BACKENDS, *VARIANTS]
    found = {}
    for path in [*REPO_ROOT.glob("torchtitan_ext/**/*.py"), *REPO_ROOT.glob("tests/**/*.py"),
                 REPO_ROOT / "run_train.sh", REPO_ROOT / "multinode_trainer.slurm"]:
        relative = path.relative_to(REPO_ROOT).as_posix()
        if relative in OWNERS or not path.is_file():
            continue
        lists = _literal_lists(path.read_text(encoding="utf-8"), names)
        if lists:
            found[relative] = lists
    assert not found, f"lists of backend or variant names outside the backend table: {found}"


def test_the_check_finds_what_it_looks_for():
    """A guard of the check above: it would see the lists this suite once held."""
    names = [*BACKENDS, *VARIANTS]
    assert _literal_lists('BACKENDS = ("nccl", "deepep", "deepep_legacy")', names)
    assert _literal_lists("VARIANTS=(nccl deepep deepep_legacy hybridep)", names)
    assert not _literal_lists('TABLE = {"x": ("nccl", 64)}; PAIR = ("nccl", "hybridep")', names)


def test_the_named_sets_are_what_their_names_say():
    """The CPU runs every variant with reference kernels; the matrices one per kernel family (not the v1 API)."""
    assert set(CPU_VARIANTS) == {name for name, variant in VARIANTS.items() if variant.reference_kernels}
    assert set(MATRIX_VARIANTS) < set(CPU_VARIANTS) and set(BACKENDS) <= set(MATRIX_VARIANTS)
