"""The package's imports flow one way, in the tiers its docstring states (torchtitan_ext/__init__.py).

Every import counts, lazy ones inside functions included: a module may import
from its own part (subpackage or entry-point module) and from parts of lower
tiers, never from a higher tier or from another part of its own tier.
"""

import ast
import re
from pathlib import Path

import torchtitan_ext

PACKAGE = Path(torchtitan_ext.__file__).parent
NAME = PACKAGE.name
TIER_LINE = re.compile(r"^\s+(\d+)\.\s+([a-z_]+(?:, [a-z_]+)*)\s{2,}")


def stated_tiers() -> dict[str, int]:
    """Part -> tier number, from the package docstring's numbered list."""
    tiers = {}
    for line in torchtitan_ext.__doc__.splitlines():
        match = TIER_LINE.match(line)
        if match:
            for part in match.group(2).split(", "):
                tiers[part] = int(match.group(1))
    return tiers


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(module of this package that ``source`` imports, line) for every import in it."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (stem, node.module or "") if p)
            # "from torchtitan_ext import runtime", "from . import faults": the names are modules
            names_modules = not node.module or target == NAME
            found += [(f"{target}.{alias.name}" if names_modules else target, node.lineno) for alias in node.names]
    return [(target, line) for target, line in found if target == NAME or target.startswith(f"{NAME}.")]


def part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def violations(module: str, source: str, is_package: bool, tiers: dict[str, int]) -> list[str]:
    """Each import of ``module`` that goes up the tiers or sideways to another part of its tier."""
    own = part(module)
    found = []
    for target, line in imported_modules(source, module, is_package):
        other = part(target)
        if not own or other in ("", own):
            continue
        if tiers[other] >= tiers[own]:
            found.append(f"{module}:{line} imports {target} (tier {tiers[other]} {other}, from tier {tiers[own]} {own})")
    return found


def test_every_part_has_a_tier():
    parts = {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    parts |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert parts == set(stated_tiers())


def test_no_module_imports_from_a_higher_tier_or_a_sibling_part():
    tiers = stated_tiers()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations(module_name(path), path.read_text(), path.name == "__init__.py", tiers)
    assert not found, "\n".join(found)


def test_the_check_sees_an_upward_and_a_sideways_import():
    tiers = stated_tiers()
    upward = "def f():\n    from torchtitan_ext.training import prepare\n"
    assert violations(f"{NAME}.config.loading", upward, False, tiers) == [
        f"{NAME}.config.loading:2 imports {NAME}.training (tier 6 training, from tier 1 config)"
    ]
    sideways = "from ..data import DATASET_NAME\n"
    assert violations(f"{NAME}.ep.base", sideways, False, tiers) == [
        f"{NAME}.ep.base:1 imports {NAME}.data (tier 3 data, from tier 3 ep)"
    ]
    upward_by_name = "from torchtitan_ext import training\n"
    assert len(violations(f"{NAME}.models.moe", upward_by_name, False, tiers)) == 1
    downward = "from torchtitan_ext.config import ConfigError\nfrom torchtitan_ext import runtime\nfrom . import faults\n"
    assert violations(f"{NAME}.training.trainer", downward, False, tiers) == []
