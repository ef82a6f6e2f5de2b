"""The audit's CSV files (the queue people fill in, the service's label export) read back exactly."""

from __future__ import annotations

from pathlib import Path

from pairclean.audit.run import QUEUE_COLUMNS, csv_bytes, read_labels

HOSTILE_KEYS = ["plain/000", "cr\rsplit", "nl\nsplit", '=HYPERLINK("http://evil","click")', "+1+1", "-2", "@SUM(1)", "'quoted", 'a,"b"']


def test_hostile_keys_survive_the_round_trip_and_never_start_a_formula(tmp_path: Path) -> None:
    rows = [{"key": k, "shard": "=cmd|' /C calc'!A0", "similarity": -0.25, "p_clean": 0.5, "stratum": 1,
             "inclusion_probability": 0.1, "label": "noisy"} for k in HOSTILE_KEYS]
    data = csv_bytes(rows, QUEUE_COLUMNS)
    for line in data.decode().split("\r\n")[1:]:
        assert not line.startswith(("=", "+", "-", "@"))  # a spreadsheet sees text, not a formula
    assert ",-0.25," in data.decode()  # numbers are written as they are
    path = tmp_path / "labels.csv"
    path.write_bytes(data)
    labels = read_labels(str(path))
    assert [lab.key for lab in labels] == [k.strip() for k in HOSTILE_KEYS]
    assert {lab.shard for lab in labels} == {"=cmd|' /C calc'!A0"} and {lab.label for lab in labels} == {"noisy"}
