"""Every measured figure the README and the guides quote is a link to its campaign under ``benchmarks/`` that names
the field it is read from (``[0.945](../benchmarks/FILE.jsonl#vs_no_replicas_median)``; several fields comma
separated), and the figure is that field's value in some row at the quoted precision. Every campaign file is whole
(header and rows), and the guides quote the latest campaign of each theme and hardware. The campaigns are the
oracle: nothing here reads an expected value out of prose."""

import re
from decimal import Decimal
from pathlib import Path

import pytest

from torchtitan_ext.records.campaign import NAME, read_campaign

REPO_ROOT = Path(__file__).resolve().parents[1]
CAMPAIGNS = sorted((REPO_ROOT / "benchmarks").glob("*.jsonl"))
GUIDES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
QUOTE = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>[^)\s#]*benchmarks/[^)\s#]+\.jsonl)(?:#(?P<fields>[^)\s]*))?\)")
FIELDS = re.compile(r"\w+(?:,\w+)*")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def quotes() -> list[tuple[str, str | None, Path, list[str]]]:
    """(the guide and line, a figure the link's text quotes or None, the campaign file, the fields it names) for
    every number in the text of a link from a guide to a campaign. A link whose text holds no number names the
    campaign without quoting from it."""
    found = []
    for guide in GUIDES:
        for number, line in enumerate(guide.read_text(encoding="utf-8").splitlines(), start=1):
            for quote in QUOTE.finditer(line):
                where = f"{guide.relative_to(REPO_ROOT)}:{number}"
                campaign = (guide.parent / quote["target"]).resolve()
                fields = quote["fields"].split(",") if quote["fields"] else []
                figures = NUMBER.findall(quote["text"])
                found += [(where, figure, campaign, fields) for figure in figures] or [(where, None, campaign, fields)]
    return found


def values(row, fields: list[str], key: str | None = None) -> list[float]:
    """The numbers of ``row`` under any of ``fields``, nested lists and objects included."""
    if isinstance(row, dict):
        return [number for name, value in row.items() for number in values(value, fields, name)]
    if isinstance(row, list):
        return [number for item in row for number in values(item, fields, key)]
    if isinstance(row, (int, float)) and not isinstance(row, bool) and key in fields:
        return [row]
    return []


def quoted_in(figure: str, fields: list[str], rows: list[dict]) -> bool:
    """Whether a value of ``fields`` in ``rows``, rounded to the figure's decimals, is the figure."""
    quoted = Decimal(figure.replace(",", ""))
    places = Decimal(1).scaleb(quoted.as_tuple().exponent)
    return any(Decimal(repr(value)).quantize(places) == quoted for row in rows for value in values(row, fields))


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda path: path.name)
def test_every_campaign_has_its_header_and_rows(path):
    read_campaign(path)


def test_every_figure_a_guide_quotes_is_in_its_campaigns_rows():
    all_quotes = quotes()
    assert all_quotes, "no guide links a campaign"
    wrong = []
    for where, figure, campaign, fields in all_quotes:
        if not campaign.exists():
            wrong.append(f"{where}: {campaign.name} does not exist")
        elif fields and not FIELDS.fullmatch(",".join(fields)):
            wrong.append(f"{where}: #{','.join(fields)}: name fields as #field or #field,field")
        elif figure is None:
            continue
        elif not fields:
            wrong.append(f"{where}: {figure} from {campaign.name}: name its field (#field after the file)")
        elif not quoted_in(figure, fields, read_campaign(campaign).rows):
            wrong.append(f"{where}: {figure} is in no row of {campaign.name} under {', '.join(fields)}")
    assert not wrong, "\n".join(wrong)


def test_the_guides_quote_the_latest_campaign_of_each_theme_and_hardware():
    latest = {}
    for path in CAMPAIGNS:
        match = NAME.fullmatch(path.stem)
        key = (match["theme"], match["hardware"])
        latest[key] = max(latest.get(key, ""), match["date"])
    stale = [f"{where}: {campaign.name} (latest: {latest[key]})" for where, _, campaign, _ in quotes()
             if (match := NAME.fullmatch(campaign.stem)) and latest.get(key := (match["theme"], match["hardware"]),
                                                                         match["date"]) > match["date"]]
    assert not stale, "\n".join(stale)
