"""Reading the layout advice as a user does: a statement and its wrapped continuation lines; the advisor's measured
error the shipped advice decides with."""

from torchtitan_ext.planning.advisor_error import AS_SHIPPED, load_error, SHIPPED as SHIPPED_ERROR

ERROR = load_error(SHIPPED_ERROR, AS_SHIPPED)
"""The advisor's error as shipped (docs/advisor_error.toml): what ``plan --topology`` decides with."""


def paragraph(lines: list[str], prefix: str) -> str:
    """The line starting with ``prefix`` and the lines indented under it, joined by single spaces."""
    start = next(index for index, line in enumerate(lines) if line.startswith(prefix))
    indent = len(prefix) - len(prefix.lstrip())
    parts = [lines[start].strip()]
    for line in lines[start + 1:]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        parts.append(line.strip())
    return " " * indent + " ".join(parts)


def headline(lines: list[str]) -> str:
    """The advice's first layout and its reasons: "recommended: ..." on a pick, "first by the model: ..." else."""
    prefix = next(line.split(":")[0] + ":" for line in lines
                  if line.startswith(("  recommended:", "  first by the model:")))
    return paragraph(lines, prefix)
