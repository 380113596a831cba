"""A measurement campaign: one immutable JSON-lines file under ``benchmarks/``, named ``THEME_HARDWARE_DATE.jsonl``.

Line 1 is the header (:class:`CampaignHeader`: the exact commands, the machine, the versions, the finding); every
line after it is one raw row as the benchmark measured it. A bench tool writes the file with ``--campaign FILE``
(:func:`write_campaign`, which refuses to overwrite one); whoever ran it writes the finding into the header before
committing it. The guides quote figures from these rows, and ``tests/test_campaign_figures.py`` checks each quoted
figure against them.
"""

import json
import os
import platform
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from datetime import date
from importlib import metadata
from pathlib import Path

from torchtitan_ext.config import ConfigError

NAME = re.compile(r"(?P<theme>[a-z0-9-]+)_(?P<hardware>[a-z0-9-]+)_(?P<date>\d{4}-\d{2}-\d{2})")
"""A campaign's file stem: what was measured, on which hardware, on which day (lower case, words joined by "-")."""

VERSIONED = ("torch", "torchtitan", "torchao")
"""The packages whose versions a campaign records, besides Python's."""


@dataclass(frozen=True)
class CampaignHeader:
    """Line 1 of a campaign file."""

    campaign: str
    """The file's stem, ``THEME_HARDWARE_DATE``."""
    date: str
    """The day the rows were measured, ISO 8601; the same as the stem's."""
    commands: list[str]
    """Each command exactly as run, in the order run; rows say which with ``"command"`` (its index) when there are
    several."""
    machine: str
    """What ran it: the CPU or GPU model, its cores or memory, the collective backend."""
    versions: dict[str, str]
    """Package name -> version; ``torch`` at least."""
    finding: str
    """What the rows show, in a few sentences: the result, against which goal, and what limits it."""
    code: str = ""
    """The commit of this repository measured, where known."""
    notes: list[str] = field(default_factory=list)
    """What a reader of the rows needs besides the finding: units, what a column means, what was done by hand."""


@dataclass(frozen=True)
class Campaign:
    header: CampaignHeader
    rows: list[dict]


def _is_date(text: str) -> bool:
    try:
        date.fromisoformat(text)
    except ValueError:
        return False
    return True


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """The machine the caller runs on, as a campaign records it."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, nccl; host CPU {cpu_model()}"
    # the vector unit (AVX2, AVX512, ...) bounds the CPU's GEMM speed, which the times depend on
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, gloo"


def installed_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def check_new_campaign_path(path: Path) -> None:
    """Refuse, before anything is measured, a ``--campaign`` path that is taken or misnamed."""
    if path.exists():
        raise ConfigError(f"--campaign {path}: the file exists and a campaign is never rewritten: name a new one")
    match = NAME.fullmatch(path.stem)
    if path.suffix != ".jsonl" or not match or not _is_date(match["date"]):
        raise ConfigError(f"--campaign {path}: name it THEME_HARDWARE_DATE.jsonl (e.g. "
                          f"ep_epyc-avx2_{date.today().isoformat()}.jsonl): lower case, words joined by '-'")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ConfigError(f"--campaign {path}: {path.parent} is not a folder you can write: create it or give another")


def bench_command(name: str, argv: list[str] | None) -> str:
    """The command that ran benchmark ``name`` with ``argv`` (None: this process's arguments), as a shell takes it."""
    return shlex.join(["python", "-m", "torchtitan_ext.bench", name, *(sys.argv[1:] if argv is None else argv)])


def write_campaign(path: Path, commands: list[str], rows: list[dict], *, code: str = "",
                   versions: dict[str, str] | None = None, notes: list[str] | None = None) -> None:
    """Write the campaign file (header with an empty finding, then ``rows``), all at once: a new file only.
    ``versions``: those the commands ran on, where not this process's (:func:`installed_versions`)."""
    check_new_campaign_path(path)
    match = NAME.fullmatch(path.stem)
    header = CampaignHeader(campaign=path.stem, date=match["date"], commands=commands, machine=describe_machine(),
                            versions=versions or installed_versions(), finding="", code=code, notes=notes or [])
    text = "".join(json.dumps(line) + "\n" for line in [asdict(header), *rows])
    temporary = path.with_suffix(".partial")
    temporary.write_text(text, encoding="utf-8")
    temporary.rename(path)
    print(f"campaign written to {path} ({len(rows)} rows): write its finding into line 1 before committing it")


def read_campaign(path: Path) -> Campaign:
    """The campaign at ``path``, checked: a header naming the file, every field filled in, and at least one row."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: line {number}: not JSON ({error.msg}): one JSON object per line") from None
    if len(records) < 2 or not all(isinstance(record, dict) for record in records):
        raise ConfigError(f"{path}: a header line and at least one row, each a JSON object, are required")
    try:
        header = CampaignHeader(**records[0])
    except TypeError as error:
        raise ConfigError(f"{path}: line 1: {error}: the fields are those of CampaignHeader") from None
    match = NAME.fullmatch(path.stem)
    text = {name: isinstance(getattr(header, name), str) for name in ("campaign", "date", "machine", "finding", "code")}
    problems = {
        "types": None if all(text.values()) else f"{', '.join(n for n, ok in text.items() if not ok)} must be text",
        "campaign": None if header.campaign == path.stem else f"is {header.campaign!r}, the file is {path.stem!r}",
        "date": None if match and header.date == match["date"] and _is_date(header.date)
        else "must be the date in the file's name, a real day",
        "commands": None if isinstance(header.commands, list) and header.commands
        and all(isinstance(c, str) and c for c in header.commands) else "must list each command run",
        "machine": None if not text["machine"] or header.machine.strip() else "is empty: say what ran it",
        "versions": None if isinstance(header.versions, dict) and "torch" in header.versions
        and all(isinstance(v, str) for v in header.versions.values()) else "must map each package to its version, "
        "torch's at least",
        "notes": None if isinstance(header.notes, list) and all(isinstance(n, str) for n in header.notes)
        else "must be a list of text",
        "finding": None if not text["finding"] or header.finding.strip() else "is empty: write what the rows show",
    }
    for name, problem in problems.items():
        if problem:
            raise ConfigError(f"{path}: line 1: {name} {problem}")
    return Campaign(header, records[1:])
