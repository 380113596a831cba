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


def describe_machine() -> str:
    """The machine the caller runs on, as a campaign records it."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, nccl"
    # the vector unit (AVX2, AVX512, ...) bounds the CPU's GEMM speed, which the times depend on
    return (f"{platform.processor() or platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), "
            f"{os.cpu_count()} cores, gloo")


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
    if path.suffix != ".jsonl" or not NAME.fullmatch(path.stem):
        raise ConfigError(f"--campaign {path}: name it THEME_HARDWARE_DATE.jsonl (e.g. "
                          f"ep_epyc-avx2_{date.today().isoformat()}.jsonl): lower case, words joined by '-'")


def write_campaign(path: Path, commands: list[str], rows: list[dict]) -> None:
    """Write the campaign file (header with an empty finding, then ``rows``), all at once: a new file only."""
    check_new_campaign_path(path)
    match = NAME.fullmatch(path.stem)
    header = CampaignHeader(campaign=path.stem, date=match["date"], commands=commands, machine=describe_machine(),
                            versions=installed_versions(), finding="")
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
    problems = {
        "campaign": None if header.campaign == path.stem else f"is {header.campaign!r}, the file is {path.stem!r}",
        "date": None if match and header.date == match["date"] else "must be the date in the file's name",
        "commands": None if header.commands and all(isinstance(c, str) and c for c in header.commands)
        else "must list each command run",
        "machine": None if header.machine else "is empty: say what ran it",
        "versions": None if "torch" in header.versions else "must give torch's version at least",
        "finding": None if header.finding.strip() else "is empty: write what the rows show",
    }
    for name, problem in problems.items():
        if problem:
            raise ConfigError(f"{path}: line 1: {name} {problem}")
    return Campaign(header, records[1:])
