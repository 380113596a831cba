"""Reading the layout advice as a user does: a statement and its wrapped continuation lines."""


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
