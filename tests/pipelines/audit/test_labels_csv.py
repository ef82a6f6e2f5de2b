"""The audit's CSV files (the queue people fill in, the service's label export) read back exactly."""

from __future__ import annotations

from pathlib import Path

from pairclean.audit.run import QUEUE_COLUMNS, csv_bytes, read_labels

HOSTILE_KEYS = ["plain/000", " spaced\t", "\u00a0nbsp", "cr\rsplit", "nl\nsplit", '=HYPERLINK("http://evil","click")', "+1+1", "-2", "@SUM(1)", "'quoted", 'a,"b"', " =1+1", "x;=1+1;"]


def test_hostile_keys_survive_the_round_trip_and_never_start_a_formula(tmp_path: Path) -> None:
    rows = [{"key": k, "shard": "=cmd|' /C calc'!A0", "similarity": -0.25, "p_clean": 0.5, "stratum": 1,
             "inclusion_probability": 0.1, "label": "noisy"} for k in HOSTILE_KEYS]
    data = csv_bytes(rows, QUEUE_COLUMNS)
    import csv
    import io

    for line in data.decode().split("\r\n")[1:]:
        assert not line.startswith(("=", "+", "-", "@"))  # a spreadsheet sees text, not a formula
    for cells in list(csv.reader(io.StringIO(data.decode())))[1:]:
        assert not any(c.lstrip().startswith(("=", "+", "-", "@")) for c in cells if not c[:1].isdigit() and c != "-0.25")
    # split on ";" as Excel does in many locales: each text cell is quoted, so no piece starts a formula
    assert '"x;=1+1;"' in data.decode() and "\"' =1+1\"" in data.decode()
    assert ",-0.25," in data.decode()  # numbers are written as they are
    path = tmp_path / "labels.csv"
    path.write_bytes(data)
    labels = read_labels(str(path))
    assert [lab.key for lab in labels] == HOSTILE_KEYS  # exactly: spaces kept, the escape taken off
    assert {lab.shard for lab in labels} == {"=cmd|' /C calc'!A0"} and {lab.label for lab in labels} == {"noisy"}


def test_labels_match_their_keys_exactly_first_and_parquet_keys_are_taken_as_they_are(tmp_path: Path) -> None:
    """Round 6: keys were stripped (a queue pairclean wrote lost the labels of keys with
    spaces), and one leading ``'`` was taken off Parquet keys too, which the service exports
    unescaped (every label of keys like ``'s0-photo`` fell outside the sample)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairclean.audit.run import Label, _match

    queue = [{"key": k, "shard": "s.tar", "stem": "s"} for k in (" a", "a", "'b", "c")]
    path = tmp_path / "labels.parquet"
    pq.write_table(pa.table({"key": [" a", "'b", "c "], "label": ["noisy", "clean", "clean"]}), path)
    labels = read_labels(str(path))
    assert [lab.key for lab in labels] == [" a", "'b", "c "]
    units = _match(queue, labels + [Label("a", "clean")])
    assert units.outside == 0 and sorted(units.positions.tolist()) == [0, 1, 2, 3]
    # a Parquet file made from the queue CSV (pandas) keeps its formula escape: matched too
    escaped = [{"key": "-k", "shard": "s.tar", "stem": "s"}]
    assert _match(escaped, [Label("'-k", "noisy")]).outside == 0


def test_a_parquet_labels_file_that_decodes_to_gigabytes_is_refused(tmp_path: Path) -> None:
    """783 bytes of Parquet (one 1,500-character key, dictionary-encoded, a million times)
    took 1.6 GB decoded whole; it is decoded batch by batch and refused past 64 MiB of text."""
    import resource

    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest
    from pairclean.errors import InputError

    rows = 1_000_000
    key = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["k" * 1500]))
    label = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(["clean"]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"key": key, "label": label}), path, compression="zstd")
    assert path.stat().st_size < 1_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InputError, match="over 64 MiB of text once decoded"):
        read_labels(str(path))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 600_000  # KiB: well under the 1.6 GB
