"""The output folder as users meet it: on S3, read by dataset tools, beside other people's
files, and claimed by one run at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pairclean import schema
from pairclean.output.folder import OutputDir
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--executor", "local"]
SCORE_COLUMNS = ["key", "shard", "idx", "status", "error", "similarity", "weight", "noisy", "p_clean", "uid", "url",
                 "image_offset", "image_size", "caption_offset", "caption_size"]


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its mtime and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def _img2dataset_folder(root: Path, make_shards) -> Path:
    """A folder shaped like img2dataset's output: tars, per-shard .parquet and _stats.json."""
    import pyarrow as pa

    for i, made in enumerate(make_shards(n_shards=2, per_shard=3, folder=root)):
        shard = made.rename(root / f"{i:05d}.tar")
        stem = shard.name[: -len(".tar")]
        pq.write_table(pa.table({"url": ["https://x/1.jpg"], "key": ["000000000"], "status": ["success"]}), root / f"{stem}.parquet")
        (root / f"{stem}_stats.json").write_text(json.dumps({"count": 3, "successes": 3}))
    return root


# -- S3 in, S3 out -------------------------------------------------------------------------------


@pytest.mark.slow
def test_s3_in_s3_out_reads_as_one_dataset_and_resumes_after_kill_9(make_shards, s3_endpoint: str, tmp_path: Path, crash_mid_job) -> None:
    import pyarrow.dataset as ds
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir("shards")
    fs.mkdir("weights")
    for i, path in enumerate(make_shards(n_shards=10, per_shard=4)):
        fs.put(str(path), f"shards/{i:05d}.tar")
    opts = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", "s3://shards/{00000..00009}.tar", "--out", "s3://weights/job", *TINY, *opts,
           "--calibration-pairs", "4"]  # a short calibration phase: the kill lands in the scoring phase
    storage = {"endpoint_url": s3_endpoint}
    crash_mid_job(cmd, OutputDir("s3://weights/job", storage), commits=3)
    done_before = len(OutputDir("s3://weights/job", storage).committed())
    assert 3 <= done_before < 10, "the kill should land in the middle of the job"
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{done_before} already done" in rerun.stdout
    out = OutputDir("s3://weights/job", storage)
    records = list(out.iter_committed())
    assert [r.stem for r in records] == [f"{i:05d}" for i in range(10)]
    for record in records:
        data = fs.cat_file(f"weights/job/{record.output}")
        assert len(data) == record.bytes and __import__("hashlib").sha256(data).hexdigest() == record.sha256
    # every object is a finished file: score tables in OUT, sidecars and state beside it; nothing else
    objects = sorted(p[len("weights/job/"):] for p in fs.find("weights/job"))
    assert objects == [f"{i:05d}.parquet" for i in range(10)]
    side = sorted(p[len("weights/job.pairclean/"):] for p in fs.find("weights/job.pairclean"))
    assert [o for o in side if o.startswith("emb/")] == [f"emb/{i:05d}.parquet" for i in range(10)]
    assert any(o.startswith("state/manifest/") for o in side) and "state/lock.json" not in side
    # OUT on S3 reads as exactly the score tables
    dataset = ds.dataset("weights/job", filesystem=fs, format="parquet")
    assert dataset.schema.names == SCORE_COLUMNS and dataset.count_rows() == 40
    # a table deleted by hand: the resume scores its shard again (one listing; round 7: on S3 it
    # said "already done" and every reader then failed on the missing table)
    kept = fs.cat_file("weights/job/00003.parquet")
    fs.rm("weights/job/00003.parquet")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "the table of shard" in again.stderr and "9 already done" in again.stdout, again.stderr[-2000:]
    assert fs.cat_file("weights/job/00003.parquet") == kept


# -- readers ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_out_reads_as_exactly_the_score_tables_in_every_reader(make_shards, tmp_path: Path) -> None:
    shards = [str(s) for s in make_shards(n_shards=3, per_shard=5)]
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), *TINY]) == 0
    assert main(["export", str(out)]) == 0  # export files must not disturb readers either
    import pyarrow.dataset as ds

    dataset = ds.dataset(out)
    assert dataset.schema.names == SCORE_COLUMNS and dataset.count_rows() == 15
    assert sorted(Path(f).name for f in dataset.files) == [f"part-{i:05d}.parquet" for i in range(3)]
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(out)
    assert list(frame.columns) == SCORE_COLUMNS and len(frame) == 15
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(f"select count(*), count(distinct shard), min(weight) >= 0 from '{out}/*.parquet'").fetchall()
    assert rows == [(15, 3, True)]
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        rd = ray.data.read_parquet(str(out))
        assert rd.schema().names == SCORE_COLUMNS and rd.count() == 15
    finally:
        ray.shutdown()
    # the sidecars read as their own dataset
    emb = ds.dataset(schema.local_side_path(out, schema.EMB_DIR))
    assert emb.schema.names == ["key", "image_emb", "text_emb", "caption_words"] and emb.count_rows() == 15


# -- other people's files ------------------------------------------------------------------------


def test_a_folder_of_other_files_is_refused_and_left_untouched(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _img2dataset_folder(tmp_path / "img2dataset", make_shards)
    before = _snapshot(folder)
    shards = [str(p) for p in sorted(folder.glob("*.tar"))]
    for extra in ([], ["--overwrite"]):
        assert main(["score", *shards, "--out", str(folder), *TINY, *extra]) == 1
        err = capsys.readouterr().err
        assert "did not write" in err and "00000.parquet" in err and "Traceback" not in err
        assert _snapshot(folder) == before
        assert not (folder / schema.STATE_DIR).exists() and not Path(f"{folder}{schema.SIDE_SUFFIX}").exists()


def test_an_output_inside_another_jobs_output_is_refused_and_that_job_left_whole(make_shards, tmp_path: Path,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=4)]
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), *TINY]) == 0
    before = _snapshot(tmp_path)
    for inner in (out / "nested", out / "a" / "b", Path(f"{out}{schema.SIDE_SUFFIX}") / "emb" / "z"):
        assert main(["score", *shards, "--out", str(inner), *TINY]) == 1
        err = capsys.readouterr().err
        assert f"lies inside the pairclean output {out}" in err and "Traceback" not in err
        assert _snapshot(tmp_path) == before  # not even a lock was written
    assert main(["score", *shards, "--out", str(tmp_path / "beside"), *TINY]) == 0  # a sibling is fine
    assert len(pq.read_table(out)) == 4


def test_overwrite_deletes_only_what_the_job_wrote(make_shards, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shards = [str(s) for s in make_shards(n_shards=4, per_shard=4)]
    Path(shards[3]).write_bytes(Path(shards[3]).read_bytes()[:3000])  # it fails: no table, no record
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), *TINY]) != 0
    assert main(["export", str(out)]) == 0
    # a user's files put into the job's folder afterwards
    (out / "notes.txt").write_text("mine")
    side = Path(f"{out}{schema.SIDE_SUFFIX}")
    (side / "emb" / "mine.parquet").write_bytes(b"PAR1 not really")
    import pyarrow as pa

    pq.write_table(pa.table({"x": [1]}), out / "user-table.parquet")
    # ... and tables made from the job's own (pyarrow keeps their metadata, which names the
    # job): a copy under another name and the rows with a column of hand labels
    (out / "part-00009.parquet").write_bytes((out / "part-00002.parquet").read_bytes())
    labelled = pq.read_table(out / "part-00001.parquet")
    pq.write_table(labelled.append_column("mine", pa.array(["clean"] * labelled.num_rows)), out / "my-labels.parquet")
    kept = ("notes.txt", "user-table.parquet", "part-00009.parquet", "my-labels.parquet")
    mine = {name: data for name, (_, data) in _snapshot(out).items() if name in kept}
    mine_side = {name: data for name, (_, data) in _snapshot(side).items() if name == "emb/mine.parquet"}
    # a leftover of a crashed attempt: a table at the name of one of the job's shards, with
    # no completion record, whose metadata names the job as its writer
    stray = out / "part-00003.parquet"
    stray.write_bytes((out / "part-00002.parquet").read_bytes())
    import logging

    with caplog.at_level(logging.WARNING):
        assert main(["score", *shards[:2], "--out", str(out), *TINY, "--weighting", "reference", "--overwrite"]) == 0
    assert "holds files that are not score tables (notes.txt)" in caplog.text  # readers of OUT would fail on it
    left, left_side = _snapshot(out), _snapshot(side)
    assert {name: left[name][1] for name in mine} == mine and len(mine) == 4  # untouched
    assert {name: left_side[name][1] for name in mine_side} == mine_side and mine_side
    assert "part-00002.parquet" not in left and "emb/part-00002.parquet" not in left_side  # the old job's shard
    assert "part-00003.parquet" not in left  # at its shard's name, its metadata naming the old job as writer
    assert not any(name.startswith("export/") for name in left_side)  # the old job's exports
    assert [r.stem for r in OutputDir(str(out)).iter_committed()] == ["part-00000", "part-00001"]


def test_a_foreign_file_in_the_way_of_a_shard_is_kept_and_the_shard_fails(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=2, per_shard=3)]
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), *TINY]) == 0
    # Shard 1 is uncommitted again (as after a crash), and a user's file took its name.
    out_dir = OutputDir(str(out))
    out_dir.replace_records([r for r in out_dir.iter_committed() if r.stem == "part-00000"])
    (out / "part-00001.parquet").write_bytes(b"user data")
    capsys.readouterr()
    assert main(["score", *shards, "--out", str(out), *TINY, "--max-failed-fraction", "0.6"]) == 4  # PARTIAL
    assert (out / "part-00001.parquet").read_bytes() == b"user data"
    assert "not written by pairclean" in capsys.readouterr().err
    assert list(OutputDir(str(out)).quarantined()) == ["part-00001"]
    # ... and so is another pairclean job's table copied in (it used to be replaced: only
    # "written by pairclean" was asked, not "by this job")
    other = tmp_path / "other"
    assert main(["score", *shards, "--out", str(other), *TINY, "--seed", "1"]) == 0
    (out / "part-00001.parquet").write_bytes((other / "part-00001.parquet").read_bytes())
    capsys.readouterr()
    assert main(["score", *shards, "--out", str(out), *TINY, "--max-failed-fraction", "0.6"]) == 4
    assert (out / "part-00001.parquet").read_bytes() == (other / "part-00001.parquet").read_bytes()
    assert "part-00001.parquet exists and was written by another pairclean job" in capsys.readouterr().err


def test_shards_whose_tables_readers_would_skip_are_refused(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``_part.tar`` and ``.part.tar`` made ``_part.parquet`` / ``.part.parquet``, which
    pyarrow.dataset and pandas skip as hidden: a job of 30 pairs read as 10."""
    for prefix in ("_part", ".part"):
        shards = [str(s) for s in make_shards(n_shards=1, per_shard=2, prefix=prefix)]
        assert main(["score", *shards, "--out", str(tmp_path / f"o{prefix}"), *TINY]) == 1
        err = capsys.readouterr().err
        assert f"its table would be named '{prefix}-00000.parquet'" in err and "skip as a hidden file" in err and err.count("\n") == 1
        assert not (tmp_path / f"o{prefix}").exists()


# -- one run per output ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_after_kill_9(make_shards, tmp_path: Path,
                                                                                   loopback_http) -> None:
    import http.server
    import threading

    shards = make_shards(n_shards=7, per_shard=24)
    slow = shards[6].read_bytes()
    gate = threading.Event()

    class Held(http.server.BaseHTTPRequestHandler):
        """Serves the last shard once ``gate`` opens: the first run holds the folder until
        then, however fast the machine (it used to finish before the second run started)."""

        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            gate.wait(120)
            self.send_response(200)
            self.send_header("Content-Length", str(len(slow)))
            self.end_headers()
            self.wfile.write(slow)

        def log_message(self, *args: object) -> None:
            pass

    held = loopback_http(Held) + "/part-00006.tar"
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", str(shards[0].parent / "part-{00000..00005}.tar"), held,
           "--out", str(out := tmp_path / "out"), *TINY]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not schema.local_side_path(out, schema.LOCK_FILE).exists() and time.time() < deadline:
            time.sleep(0.05)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert "in use by another pairclean run" in second.stderr and f"pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    gate.set()
    # the holder is dead (same host, no such process): the lock is taken over at once
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert sorted(r.stem for r in OutputDir(str(out)).iter_committed()) == [f"part-{i:05d}" for i in range(7)]
    assert not schema.local_side_path(out, schema.LOCK_FILE).exists()


def test_a_shard_that_fails_leaves_no_table_of_an_earlier_crashed_attempt(make_shards, tmp_path: Path) -> None:
    """A run killed after writing a shard's table and before its record left the table; the
    rerun quarantined the shard (re-downloaded short since) and kept the table, so readers of
    OUT read its old rows beside the committed ones (pyarrow 40 rows, inspect 35)."""
    import pyarrow.dataset as ds

    shards = [str(s) for s in make_shards(n_shards=2, per_shard=4)]
    Path(shards[1]).write_bytes(Path(shards[1]).read_bytes()[:3000])
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), *TINY]) != 0
    leftover = out / "part-00001.parquet"  # what the crash left: a table of this job, no record
    leftover.write_bytes((out / "part-00000.parquet").read_bytes())
    assert main(["score", *shards, "--out", str(out), *TINY]) != 0  # the shard fails again
    assert not leftover.exists()
    assert ds.dataset(str(out)).to_table().num_rows == 4
