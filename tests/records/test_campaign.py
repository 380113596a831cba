"""A campaign file as the bench tools write it and the guides' test reads it: written once, refused when it is
misnamed, taken, or missing what a reader needs."""

import json

import pytest

from torchtitan_ext.config import ConfigError
from torchtitan_ext.records.campaign import check_new_campaign_path, read_campaign, write_campaign


def test_a_written_campaign_reads_back_once_its_finding_is_filled_in(tmp_path):
    path = tmp_path / "ep_test-cpu_2026-11-29.jsonl"
    write_campaign(path, ["python -m torchtitan_ext.bench ep"], [{"backend": "nccl", "median_ms": 1.5}])
    with pytest.raises(ConfigError, match=r"line 1: finding is empty"):
        read_campaign(path)
    header, row = path.read_text().splitlines()
    path.write_text(json.dumps({**json.loads(header), "finding": "nccl took 1.5 ms."}) + "\n" + row + "\n")
    campaign = read_campaign(path)
    assert campaign.header.date == "2026-11-29" and "torch" in campaign.header.versions
    assert campaign.rows == [{"backend": "nccl", "median_ms": 1.5}]
    with pytest.raises(ConfigError, match="the file exists and a campaign is never rewritten"):
        write_campaign(path, ["again"], [{}])


@pytest.mark.parametrize("name", ["ep_2026-11-29.jsonl", "EP_cpu_2026-11-29.jsonl", "ep_cpu_2026-11-29.json",
                                  "ep_cpu_2026-13-45.jsonl"])
def test_a_misnamed_campaign_is_refused_before_anything_is_written(tmp_path, name):
    with pytest.raises(ConfigError, match="name it THEME_HARDWARE_DATE.jsonl"):
        write_campaign(tmp_path / name, ["command"], [{}])
    assert not list(tmp_path.iterdir())


def test_a_campaign_in_a_missing_folder_is_refused_before_the_run(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder you can write: create it or give another"):
        check_new_campaign_path(tmp_path / "benchmark" / "ep_cpu_2026-11-29.jsonl")


@pytest.mark.parametrize(("change", "message"), [
    ({"campaign": "ep_cpu_2026-11-28"}, "line 1: campaign is 'ep_cpu_2026-11-28', the file is 'ep_cpu_2026-11-29'"),
    ({"date": "2026-11-28"}, "line 1: date must be the date in the file's name"),
    ({"commands": []}, "line 1: commands must list each command run"),
    ({"versions": {"python": "3.11"}}, "line 1: versions must map each package to its version, torch's at least"),
    ({"versions": "torch 2.13"}, "line 1: versions must map each package"),
    ({"commands": "python -m torchtitan_ext.bench ep"}, "line 1: commands must list each command run"),
    ({"finding": None}, "line 1: types finding must be text"),
    ({"date": "2026-13-45"}, "line 1: date must be the date in the file.s name, a real day"),
    ({"colour": "red"}, "line 1: .*colour"),
])
def test_a_header_missing_what_a_reader_needs_is_refused_naming_the_field(tmp_path, change, message):
    header = {"campaign": "ep_cpu_2026-11-29", "date": "2026-11-29", "commands": ["c"], "machine": "m",
              "versions": {"torch": "2.13.0"}, "finding": "f"}
    path = tmp_path / "ep_cpu_2026-11-29.jsonl"
    path.write_text(json.dumps({**header, **change}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(ConfigError, match=message):
        read_campaign(path)
    path.write_text(json.dumps(header) + "\n{not json\n")
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        read_campaign(path)
