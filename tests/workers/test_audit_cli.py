"""``pairclean audit`` end to end on the demo job: queue, labels, report, recalibrated tables."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pairclean import schema
from pairclean_workers.cli import _demo_truth, main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit") / "demo"
    assert main(["demo", "--out", str(out), "--no-progress", "--executor", "local"]) == 0
    return out


@pytest.fixture
def job(demo_job: Path, tmp_path: Path) -> Path:
    """A fresh copy of the scored demo job for each test (OUT and its OUT.pairclean beside it)."""
    shutil.copytree(f"{demo_job}{schema.SIDE_SUFFIX}", tmp_path / f"job{schema.SIDE_SUFFIX}")
    return Path(shutil.copytree(demo_job, tmp_path / "job"))


def _label(queue: Path, dest: Path, swapped: set[str], take: int | None = None, tweak: dict[str, str] | None = None,
           extra: list[dict[str, str]] | None = None) -> Path:
    rows = list(csv.DictReader(queue.open()))
    for i, row in enumerate(rows):
        if take is None or i < take:
            row["label"] = (tweak or {}).get(row["key"], "noisy" if row["key"] in swapped else "clean")
    rows += extra or []
    with dest.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return dest


def test_sample_label_estimate_and_recalibrate(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    swapped, flagged_before = _demo_truth(str(job))
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--seed", "3", "--out", str(queue)]) == 0
    rows = list(csv.DictReader(queue.open()))
    assert list(rows[0]) == ["key", "shard", "similarity", "p_clean", "stratum", "inclusion_probability", "label"]
    assert len({r["key"] for r in rows}) == 10 == len(rows)  # every ok pair once: a census
    assert all(float(r["inclusion_probability"]) == 1.0 for r in rows)
    first = queue.read_bytes()
    assert main(["audit", str(job), "--sample", "10", "--seed", "3", "--out", str(queue)]) == 0
    assert queue.read_bytes() == first  # reproducible from the seed
    assert schema.local_side_path(job, "_pairclean/audit/design.json").is_file()
    capsys.readouterr()

    labels = _label(queue, tmp_path / "labels.csv", swapped)
    assert main(["audit", str(job), "--labels", str(labels), "--threshold", "0.5", "--target", "precision=0.9"]) == 0
    printed = capsys.readouterr().out
    assert "noise rate: 40.0% [40.0, 40.0]" in printed  # 4 of 10 swapped, every pair labelled
    report = json.loads(schema.local_side_path(job, "_pairclean/audit.json").read_text())
    assert report["status"] == "ok" and report["noise_rate"]["estimate"] == pytest.approx(0.4)
    assert report["noisy_flag"]["precision"]["estimate"] == 1.0 and report["noisy_flag"]["recall"]["estimate"] == 1.0
    assert report["target"]["reached"] and report["threshold"]["threshold"] == 0.5
    assert report["recalibration"]["labels"] == 10 and report["recalibration"]["applied"]["rewritten"] == 1

    table = pq.read_table(job / "demo-000000.parquet")
    names = table.column_names
    assert names.index("p_clean_model") == names.index("p_clean") + 1
    meta = json.loads(table.schema.metadata[b"pairclean"])
    assert meta["audit"]["labels"] == 10 and meta["audit"]["map_sha256"] == report["recalibration"]["sha256"]
    by_key = {r["key"]: r for r in table.to_pylist()}
    for key, row in by_key.items():  # the map is fitted on these very labels: noisy -> about 0, clean -> about 1
        assert row["p_clean"] == pytest.approx(0.0 if key in swapped else 1.0, abs=0.01)
        # what trainers read follows (weighting p-clean): weight is p_clean, noisy says p_clean <= 0.5
        assert row["weight"] == row["p_clean"] and row["noisy"] == (key in swapped)
    assert names.index("noisy_model") == names.index("noisy") + 1
    model_flags = pq.read_table(job / "demo-000000.parquet", columns=["key", "noisy_model"]).to_pylist()
    assert {r["key"] for r in model_flags if r["noisy_model"]} == flagged_before  # the model's flag, kept
    # the job's completion records follow the rewritten table: inspect and the pages read it
    digest = hashlib.sha256((job / "demo-000000.parquet").read_bytes()).hexdigest()
    assert main(["inspect", str(job), "--json"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(job)]) == 0  # says the tables were audited, and the flag rule they follow now
    printed = capsys.readouterr().out
    assert "audited: p_clean recalibrated on 10 human labels" in printed
    assert "flagged noisy (p_clean <= 0.5, p_clean recalibrated by an audit on 10 human labels" in printed
    assert "noise-rate estimate (1 - mean p_clean over ok pairs: the wrong captions p_clean expects): 40.0%" in printed

    # a rerun with the same labels rewrites nothing and leaves the table byte-identical
    assert main(["audit", str(job), "--labels", str(labels)]) == 0
    assert "0 rewritten, 1 already done" in capsys.readouterr().out
    assert hashlib.sha256((job / "demo-000000.parquet").read_bytes()).hexdigest() == digest

    # a rescore replaces the recalibrated p_clean, as a fresh score would: said, not silent (round 7)
    import logging

    with caplog.at_level(logging.WARNING):
        assert main(["rescore", str(job), "--beta-recipe", "gmm", "--weighting", "p-clean"]) == 0
    assert "1 of 1 tables hold p_clean recalibrated by an audit" in caplog.text
    assert "p_clean_model" not in pq.read_table(job / "demo-000000.parquet").column_names


def test_too_few_labels_say_how_many_more(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swapped, _ = _demo_truth(str(job))
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--out", str(queue)]) == 0
    labels = _label(queue, tmp_path / "few.csv", swapped, take=6)
    before = (job / "demo-000000.parquet").read_bytes()
    assert main(["audit", str(job), "--labels", str(labels)]) == 1
    printed = capsys.readouterr().out
    assert "label 4 more pairs" in printed
    assert (job / "demo-000000.parquet").read_bytes() == before  # nothing applied
    assert json.loads(schema.local_side_path(job, "_pairclean/audit.json").read_text())["labels_needed"] == 4
    # every key changed on the way (a spreadsheet reading keys as numbers drops their leading
    # zeros): the report says the keys missed, not only that more labels are needed
    mangled = tmp_path / "mangled.csv"
    mangled.write_text(labels.read_text().replace("skimage/", ""))
    assert main(["audit", str(job), "--labels", str(mangled)]) == 1
    printed = capsys.readouterr().out
    assert "no label's key is in the audit sample: check the key column" in printed and "label 10 more pairs" in printed


def test_unsure_and_conflicting_labels_are_reported(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swapped, _ = _demo_truth(str(job))
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--out", str(queue)]) == 0
    rows = list(csv.DictReader(queue.open()))
    clean_key = next(r["key"] for r in rows if r["key"] not in swapped)
    unsure_key = next(r["key"] for r in rows if r["key"] not in swapped and r["key"] != clean_key)
    repeat = {"key": clean_key, "shard": rows[0]["shard"], "label": "noisy"}  # a blind repeat that disagrees
    labels = _label(queue, tmp_path / "labels.csv", swapped, tweak={unsure_key: "unsure"}, extra=[repeat])
    code = main(["audit", str(job), "--labels", str(labels), "--no-apply"])
    printed = capsys.readouterr().out
    report = json.loads(schema.local_side_path(job, "_pairclean/audit.json").read_text())
    assert report["labels"]["unsure_pairs"] == 1 and report["labels"]["conflicting_pairs"] == 1
    assert "1 only unsure (reported, not counted)" in printed
    assert report["self_agreement"]["repeats"] == 1 and report["self_agreement"]["agreement"] == 0.0
    # 9 decisive pairs out of a 10-pair queue, one of them conflicting (it does not count):
    # below the minimum (all of a job this small)
    assert code == 1 and report["labels_needed"] == 2 and report["labels"]["agreed_pairs"] == 8
    assert report["queue_left"] == 0 and "draw a larger sample" in printed
    assert "p_clean_model" not in pq.read_table(job / "demo-000000.parquet").column_names


def test_a_small_queue_or_labels_that_say_nothing_apply_nothing(job: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Round 3 of the audit attack: the minimum was the queue's size, so ``--sample 3`` and
    three labels rewrote every weight of the job; a file of every pair labelled both ways
    (no information) fitted a map of 0.5 for every pair; a file pasted twice counted its
    copies as blind repeats that agreed with themselves; a shard column of file names
    matched nothing."""
    swapped, _ = _demo_truth(str(job))
    before = (job / "demo-000000.parquet").read_bytes()
    small = tmp_path / "small.csv"
    assert main(["audit", str(job), "--sample", "3", "--out", str(small)]) == 0
    assert main(["audit", str(job), "--labels", str(_label(small, tmp_path / "three.csv", swapped))]) == 1
    printed = capsys.readouterr().out
    report = json.loads(schema.local_side_path(job, "_pairclean/audit.json").read_text())
    assert report["labels"]["decisive_pairs"] >= 2 and report["labels_needed"] == 10 - report["labels"]["decisive_pairs"]
    assert f"label {report['labels_needed']} more pairs" in printed and "draw a larger sample" in printed  # all 10 of this job
    assert (job / "demo-000000.parquet").read_bytes() == before
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--out", str(queue), "--resample"]) == 0
    rows = list(csv.DictReader(queue.open()))
    both = [{"key": r["key"], "shard": r["shard"], "label": label} for r in rows for label in ("clean", "noisy")]
    assert main(["audit", str(job), "--labels", str(_label(queue, tmp_path / "both.csv", swapped, take=0, extra=both))]) == 1
    printed = capsys.readouterr().out
    assert "10 pairs with conflicting labels" in printed and "label 10 more pairs" in printed
    assert (job / "demo-000000.parquet").read_bytes() == before
    twice = _label(queue, tmp_path / "twice.csv", swapped)
    twice.write_text(twice.read_text() + "".join(twice.read_text().splitlines(keepends=True)[1:]))
    names = [{"key": r["key"], "shard": r["shard"].rsplit("/", 1)[-1], "label": "noisy" if r["key"] in swapped else "clean"}
             for r in rows]  # a shard column of file names (one shard of that name in the job)
    by_name = _label(queue, tmp_path / "names.csv", swapped, take=0, extra=names)
    for labels in (twice, by_name):
        assert main(["audit", str(job), "--labels", str(labels), "--no-apply"]) == 0
        report = json.loads(schema.local_side_path(job, "_pairclean/audit.json").read_text())
        assert report["labels"]["decisive_pairs"] == 10 and report["self_agreement"]["repeats"] == 0
    assert report["labels"]["outside_sample"] == 0
    assert "10 repeated rows counted once" in capsys.readouterr().out


def test_bad_input_is_one_line_and_touches_nothing(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--labels", str(queue)]) == 1  # no sample drawn yet
    assert "no audit sample yet" in capsys.readouterr().err
    assert main(["audit", str(job), "--sample", "5", "--out", str(queue)]) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("key,label\nskimage/coffee,maybe\n")
    assert main(["audit", str(job), "--labels", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: label must be one of clean, noisy, unsure" in err and "maybe" not in err
    mine = tmp_path / "mine.csv"
    mine.write_text("my own notes\n")
    assert main(["audit", str(job), "--sample", "5", "--out", str(mine)]) == 1
    assert mine.read_text() == "my own notes\n"
    assert main(["audit", str(job), "--labels", str(queue), "--target", "accuracy=2"]) == 1
    assert "--target expects" in capsys.readouterr().err
    # Another sample over the one being labelled would make its labels stop counting, silently.
    design = schema.local_side_path(job, "_pairclean/audit/design.json")
    before = design.read_bytes()
    assert main(["audit", str(job), "--sample", "8", "--seed", "5", "--out", str(tmp_path / "q2.csv")]) == 1
    assert "already has an audit sample of 5 pairs" in capsys.readouterr().err and design.read_bytes() == before
    assert main(["audit", str(job), "--sample", "8", "--seed", "5", "--out", str(tmp_path / "q2.csv"), "--resample"]) == 0
    assert len(json.loads(design.read_text())["queue"]) == 8


def test_a_refused_queue_file_leaves_the_sample_as_it_was(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Round 6: ``--resample`` replaced the job's sample before ``--out`` was refused (a queue
    already holding labels), so the new queue was written nowhere and the labels stopped
    counting; a queue written into the score folder broke reading it as one dataset; a
    non-CSV ``--out`` ended in a csv traceback."""
    import pyarrow.dataset as ds

    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "5", "--out", str(queue)]) == 0
    labelled = _label(queue, queue, set())
    design = schema.local_side_path(job, "_pairclean/audit/design.json")
    before = design.read_bytes()
    assert main(["audit", str(job), "--sample", "8", "--seed", "1", "--resample", "--out", str(labelled)]) == 1
    assert "already holds labels" in capsys.readouterr().err and design.read_bytes() == before
    inside = job / "q.csv"
    assert main(["audit", str(job), "--sample", "5", "--out", str(inside)]) == 1
    assert "inside the score folder" in capsys.readouterr().err and not inside.exists() and design.read_bytes() == before
    assert main(["audit", str(job), "--sample", "5", "--out", f"file://{inside}"]) == 1  # a plain path and file:// alike
    assert "inside the score folder" in capsys.readouterr().err and not inside.exists()
    assert ds.dataset(str(job)).count_rows() > 0
    shard = next(job.glob("*.parquet"))
    copy = tmp_path / "not-a-queue.csv"
    copy.write_bytes(b"key,shard,similarity,p_clean,stratum\n\"" + b"\0" * 10 + shard.read_bytes())
    assert main(["audit", str(job), "--sample", "5", "--out", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an audit queue" in err


def test_overwrite_drops_the_audit_sample_of_the_tables_it_deletes(job: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Round 7: ``score --overwrite`` kept the old job's audit sample, so labels made for
    tables it deleted (pairs the new job does not even hold) recalibrated the new ones."""
    from pairclean_workers.cli import sample_shard

    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--out", str(queue)]) == 0
    labels = _label(queue, tmp_path / "labels.csv", _demo_truth(str(job))[0])
    assert main(["audit", str(job), "--labels", str(labels)]) == 0  # applied: its records a folder deeper
    assert main(["score", sample_shard(), "--out", str(job), "--no-progress", "--executor", "local", "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["audit", str(job), "--labels", str(labels)]) == 1
    assert "no audit sample yet" in capsys.readouterr().err


def test_a_sample_drawn_before_a_refine_is_refused_and_a_damaged_one_is_one_line(job: Path, tmp_path: Path,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """audit --sample, then a refine, then audit --labels fitted its map on the queue's p_clean
    and applied it to the refined one, without a word; a damaged design.json was a traceback."""
    swapped, _ = _demo_truth(str(job))
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(job), "--sample", "10", "--out", str(queue)]) == 0
    labels = _label(queue, tmp_path / "labels.csv", swapped)
    assert main(["refine", str(job), "--method", "ncr", "--executor", "local"]) == 0  # p_clean rewritten
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in job.glob("*.parquet")}
    assert main(["audit", str(job), "--labels", str(labels)]) == 1
    err = capsys.readouterr().err
    assert "the audit sample was drawn from tables rewritten since" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in job.glob("*.parquet")} == before  # nothing applied
    assert main(["audit", str(job), "--sample", "10", "--resample", "--out", str(tmp_path / "q2.csv")]) == 0
    assert main(["audit", str(job), "--labels", str(_label(tmp_path / "q2.csv", tmp_path / "l2.csv", swapped))]) == 0
    design = Path(schema.local_side_path(job, schema.AUDIT_DESIGN_FILE))
    for damaged in (b"", b"{not json", b"[]", b'{"design": {}, "queue": [{"key": "k"}]}', b"\xff\xfe"):
        design.write_bytes(damaged)
        capsys.readouterr()
        assert main(["audit", str(job), "--labels", str(labels)]) == 1
        err = capsys.readouterr().err
        assert "is not an audit sample pairclean wrote" in err and err.count("\n") == 1, (damaged, err)


def test_a_rerun_gives_the_shards_it_commits_the_audit_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After ``audit --labels`` a rerun that committed a repaired shard wrote the model's
    ``p_clean`` and no ``p_clean_model`` beside the recalibrated tables: the same pairs read
    0.991 in one table and 0.560 in the other, and polars and duckdb refused the folder."""
    import pyarrow.dataset as ds

    from pairclean.read.shards import iter_raw_samples
    from pairclean_workers.cli import sample_shard

    truth = {s.key for s in iter_raw_samples(sample_shard()) if json.loads(s.files["json"]).get("swapped")}
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(sample_shard(), shards / "a-000000.tar")
    whole = Path(sample_shard()).read_bytes()
    (shards / "b-000000.tar").write_bytes(whole[:3000])  # cut short: it fails this run
    out = tmp_path / "out"
    run = ["score", str(shards), "--out", str(out), "--no-progress", "--executor", "local"]
    assert main(run) != 0
    queue = tmp_path / "queue.csv"
    assert main(["audit", str(out), "--sample", "10", "--seed", "3", "--out", str(queue)]) == 0
    assert main(["audit", str(out), "--labels", str(_label(queue, tmp_path / "labels.csv", truth))]) == 0
    (shards / "b-000000.tar").write_bytes(whole)  # repaired
    assert main(run) == 0
    a, b = (pq.read_table(out / f"{s}-000000.parquet") for s in ("a", "b"))
    assert a.schema.names == b.schema.names and "p_clean_model" in b.schema.names
    assert a.column("p_clean").to_pylist() == b.column("p_clean").to_pylist()  # the same pairs, one scale
    assert ds.dataset(str(out)).to_table().num_rows == 20
    # the sample holds pairs of shard a only: the labels' figures describe that shard, and say so
    capsys.readouterr()
    assert main(["audit", str(out), "--labels", str(tmp_path / "labels.csv")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: the audit queue was drawn when 1 shards were committed; 2 are now (a rerun)" in err
    assert f"pairclean audit {out} --sample N --resample" in err
    assert "drawn when 1 shards" in json.loads((tmp_path / f"out{schema.SIDE_SUFFIX}/state/audit.json").read_text())["warning"]
