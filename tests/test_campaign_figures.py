"""Every measured figure the README and the guides quote is a link to its campaign under ``benchmarks/``, and the
figure is in that campaign's rows at the quoted precision; every campaign file is whole (header and rows) and the
guides quote the latest campaign of each theme and hardware. The campaigns are the oracle: nothing here reads an
expected value out of prose."""

import re
from decimal import Decimal
from pathlib import Path

import pytest

from torchtitan_ext.records.campaign import NAME, read_campaign

REPO_ROOT = Path(__file__).resolve().parents[1]
CAMPAIGNS = sorted((REPO_ROOT / "benchmarks").glob("*.jsonl"))
GUIDES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
QUOTE = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]*benchmarks/[^)\s]+\.jsonl)\)")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def quotes() -> list[tuple[str, str, Path]]:
    """(the guide and line, a figure its text quotes or None, the campaign file) for every number in the text of a
    link from a guide to a campaign. A link whose text holds no number names the campaign without quoting from it."""
    found = []
    for guide in GUIDES:
        for number, line in enumerate(guide.read_text(encoding="utf-8").splitlines(), start=1):
            for quote in QUOTE.finditer(line):
                where = f"{guide.relative_to(REPO_ROOT)}:{number}"
                campaign = (guide.parent / quote["target"]).resolve()
                figures = NUMBER.findall(quote["text"])
                found += [(where, figure, campaign) for figure in figures] or [(where, None, campaign)]
    return found


def numbers(value) -> list[float]:
    """Every number in a row, nested lists and objects included."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [number for item in items for number in numbers(item)]


def quoted_in(figure: str, rows: list[dict]) -> bool:
    """Whether some number of ``rows``, rounded to the figure's decimals, is the figure."""
    quoted = Decimal(figure.replace(",", ""))
    places = Decimal(1).scaleb(quoted.as_tuple().exponent)
    return any(Decimal(repr(value)).quantize(places) == quoted for row in rows for value in numbers(row))


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda path: path.name)
def test_every_campaign_has_its_header_and_rows(path):
    read_campaign(path)


def test_every_figure_a_guide_quotes_is_in_its_campaigns_rows():
    all_quotes = quotes()
    assert all_quotes, "no guide links a campaign"
    wrong = []
    for where, figure, campaign in all_quotes:
        if not campaign.exists():
            wrong.append(f"{where}: {campaign.name} does not exist")
        elif figure is not None and not quoted_in(figure, read_campaign(campaign).rows):
            wrong.append(f"{where}: {figure} is in no row of {campaign.name}")
    assert not wrong, "\n".join(wrong)


def test_the_guides_quote_the_latest_campaign_of_each_theme_and_hardware():
    latest = {}
    for path in CAMPAIGNS:
        match = NAME.fullmatch(path.stem)
        key = (match["theme"], match["hardware"])
        latest[key] = max(latest.get(key, ""), match["date"])
    stale = [f"{where}: {campaign.name} (latest: {latest[key]})" for where, _, campaign in quotes()
             if (match := NAME.fullmatch(campaign.stem)) and latest.get(key := (match["theme"], match["hardware"]),
                                                                         match["date"]) > match["date"]]
    assert not stale, "\n".join(stale)
