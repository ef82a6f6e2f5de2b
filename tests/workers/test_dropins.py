"""Issue 23: pairclean's output where data teams' own tools read it. An img2dataset folder
whose first shard is empty (every download failed) and whose second holds json members only,
scored as a folder, read by pyarrow, pandas, duckdb, polars, Ray Data and Hugging Face
``datasets`` with each one's default call, exported for DataComp's resharder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pairclean import schema
from pairclean.output.folder import OutputDir
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--executor", "local"]
COLUMNS = ["key", "shard", "idx", "status", "error", "similarity", "weight", "noisy", "p_clean", "adjusted_similarity", "owner_margin", "uid", "url",
           "image_offset", "image_size", "caption_offset", "caption_size"]
ROWS = 30  # 0 + 10 json-only + 10 + 10


@pytest.fixture
def scored(img2dataset_folder: Path, tmp_path: Path) -> Path:
    """The img2dataset folder scored as a folder (``pairclean score FOLDER``) into OUT."""
    out = tmp_path / "weights"
    assert main(["score", str(img2dataset_folder), "--out", str(out), *TINY]) == 0
    return out


def test_a_folder_expands_to_its_shards_in_name_order(img2dataset_folder: Path, scored: Path) -> None:
    spec = OutputDir(str(scored)).read_spec()
    assert spec is not None
    assert [Path(s).name for s in spec.shards] == ["00000.tar", "00001.tar", "00002.tar", "00003.tar"]
    assert sorted(p.name for p in scored.iterdir()) == [f"{i:05d}.parquet" for i in range(4)]


def test_a_folder_without_shards_says_what_to_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    assert main(["score", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), *TINY]) == 1
    err = capsys.readouterr().err
    assert "no shards in it" in err and f"'{tmp_path / 'empty'}/*.tar'" in err and "Traceback" not in err


def test_every_table_has_one_schema_even_the_empty_shards(scored: Path) -> None:
    schemas = {p.name: pq.read_schema(p).names for p in sorted(scored.glob("*.parquet"))}
    assert all(names == COLUMNS for names in schemas.values()), schemas
    assert pq.read_metadata(scored / "00000.parquet").num_rows == 0
    first = pq.read_table(scored / "00001.parquet")
    assert set(first.column("status").to_pylist()) == {"missing_image"} and first.column("uid").null_count == 0


def test_out_reads_as_exactly_the_score_tables_in_each_reader(scored: Path) -> None:
    assert main(["export", str(scored)]) == 0  # exports must not disturb readers
    import pyarrow.dataset as ds

    assert ds.dataset(scored).schema.names == COLUMNS and ds.dataset(scored).count_rows() == ROWS
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(scored)
    assert list(frame.columns) == COLUMNS and len(frame) == ROWS and frame["uid"].notna().sum() == ROWS
    duckdb = pytest.importorskip("duckdb")
    for source in (f"'{scored}/*.parquet'", f"read_parquet('{scored}')"):
        got = duckdb.sql(f"select count(*), count(uid), count(distinct shard) from {source}").fetchall()
        assert got == [(ROWS, ROWS, 3)], source
    pl = pytest.importorskip("polars")
    assert pl.scan_parquet(scored).collect().columns == COLUMNS
    assert pl.read_parquet(scored).shape == (ROWS, len(COLUMNS))
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    loaded = datasets.load_dataset("parquet", data_dir=str(scored), cache_dir=str(scored.parent / "hf-cache"))
    assert loaded["train"].column_names == COLUMNS and loaded["train"].num_rows == ROWS


@pytest.mark.ray
def test_ray_data_reads_out_as_the_score_tables(scored: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        rd = ray.data.read_parquet(str(scored))
        assert rd.schema().names == COLUMNS and rd.count() == ROWS
    finally:
        ray.shutdown()


def test_the_state_sidecars_and_exports_live_beside_out(scored: Path) -> None:
    side = Path(f"{scored}{schema.SIDE_SUFFIX}")
    assert (side / "state" / "job.json").is_file()
    assert sorted(p.name for p in (side / "emb").iterdir()) == [f"{i:05d}.parquet" for i in range(4)]
    assert main(["export", str(scored)]) == 0
    assert sorted(p.name for p in (side / "export").iterdir()) == ["datacomp_keep.npy", "shard_weights.json", "sizes.json"]


def test_export_keeps_the_datacomp_file_when_a_shard_is_empty(img2dataset_folder: Path, scored: Path) -> None:
    assert main(["export", str(scored)]) == 0
    side = Path(f"{scored}{schema.SIDE_SUFFIX}") / "export"
    keep = np.load(side / "datacomp_keep.npy")
    table = pq.read_table(scored, columns=["uid", "status", "noisy"]).to_pylist()
    kept = sorted(r["uid"] for r in table if r["status"] == "ok" and not r["noisy"])
    assert keep.dtype == np.dtype("u8,u8") and len(keep) == len(kept) > 0
    assert [f"{hi:016x}{lo:016x}" for hi, lo in keep.tolist()] == kept  # sorted as the resharder needs
    sizes = json.loads((side / "sizes.json").read_text())
    assert sizes == {"00000.tar": 0, "00001.tar": 10, "00002.tar": 10, "00003.tar": 10}


def test_a_folder_of_the_older_layout_still_reads_resumes_and_exports(img2dataset_folder: Path, scored: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """State inside OUT (``OUT/_pairclean``, ``OUT/_emb``), as pairclean wrote it before issue 23."""
    import pairclean

    side = Path(f"{scored}{schema.SIDE_SUFFIX}")
    for physical, logical in (("state", "_pairclean"), ("emb", "_emb")):
        (side / physical).rename(scored / logical)
    side.rmdir()
    out = OutputDir(str(scored))
    assert out.legacy and len(out.committed()) == 4
    assert pairclean.read_scores(scored).num_rows == ROWS
    capsys.readouterr()
    assert main(["score", str(img2dataset_folder), "--out", str(scored), *TINY]) == 0  # a resume, in place
    assert "4 already done" in capsys.readouterr().out
    assert main(["export", str(scored)]) == 0
    assert (scored / "_export" / "datacomp_keep.npy").is_file() and not side.exists()


def test_the_keep_file_lists_each_uid_once_and_is_empty_rather_than_stale() -> None:
    """DataComp's resharder writes a sample once per entry of the keep file: a pair two
    shards held was listed (and written) twice. A job of DataComp uids that keeps no pair
    after a rescore left its older keep file, listing pairs flagged noisy since."""
    from pairclean.output.exports import ExportReport, keep_list

    a, b = "0" * 31 + "a", "0" * 31 + "b"
    report = ExportReport()
    records = keep_list([b, a, b], [], True, False, report)
    assert records is not None and [f"{hi:016x}{lo:016x}" for hi, lo in records.tolist()] == [a, b]
    assert any("1 kept uids appear in more than one row" in n for n in report.notes)
    empty = keep_list([], [], True, False, ExportReport())  # uids in the job, none kept: an empty file
    assert empty is not None and len(empty) == 0
    none = ExportReport()
    assert keep_list([], [("x-1", "k", "s.tar")], False, False, none) is None and "none (they have e.g. 'x-1')" in none.notes[0]
    with pytest.raises(Exception, match="--skip-bad-uids"):
        keep_list([a], [("x-1", "k", "s.tar")], True, False, ExportReport())


def test_a_shard_held_twice_is_kept_once_in_the_keep_file(img2dataset_folder: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copy(img2dataset_folder / "00002.tar", img2dataset_folder / "00004.tar")  # the same pairs, the same uids
    out = tmp_path / "weights"
    assert main(["score", str(img2dataset_folder), "--out", str(out), *TINY]) == 0
    assert main(["export", str(out)]) == 0
    keep = np.load(Path(f"{out}{schema.SIDE_SUFFIX}") / "export" / "datacomp_keep.npy")
    table = pq.read_table(out, columns=["uid", "status", "noisy"]).to_pylist()
    kept = {r["uid"] for r in table if r["status"] == "ok" and not r["noisy"]}
    assert len(keep) == len(kept) == len({tuple(r) for r in keep.tolist()}) > 0


def test_relative_shards_are_recorded_absolute_so_another_folder_cannot_resume_into_the_job(
        img2dataset_writer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job scored as ``pairclean score shards --out weights`` recorded ``shards/00000.tar``:
    the same command run from another job's folder (img2dataset names every folder's shards
    alike) passed the spec check, took that folder's shards as "changed" and replaced the
    first job's tables with them; export wrote sizes.json beside the other folder's shards."""
    for job in ("a", "b"):
        img2dataset_writer(tmp_path / job / "shards")
    import shutil

    shutil.copy(tmp_path / "b" / "shards" / "00002.tar", tmp_path / "b" / "shards" / "00003.tar")  # same name, other pairs
    monkeypatch.chdir(tmp_path / "a")
    assert main(["score", "shards", "--out", "weights", *TINY]) == 0
    spec = OutputDir(str(tmp_path / "a" / "weights")).read_spec()
    assert spec is not None and all(s.startswith(str(tmp_path / "a" / "shards")) for s in spec.shards)
    before = {p.name: p.read_bytes() for p in (tmp_path / "a" / "weights").glob("*.parquet")}
    monkeypatch.chdir(tmp_path / "b")
    assert main(["score", "shards", "--out", str(tmp_path / "a" / "weights"), *TINY]) != 0  # another job's shards: refused
    assert {p.name: p.read_bytes() for p in (tmp_path / "a" / "weights").glob("*.parquet")} == before
    assert main(["export", str(tmp_path / "a" / "weights"), "--sizes-beside-shards"]) == 0
    assert (tmp_path / "a" / "shards" / "sizes.json").is_file() and not (tmp_path / "b" / "shards" / "sizes.json").exists()
    monkeypatch.chdir(tmp_path / "a")
    assert main(["score", "shards", "--out", "weights", *TINY]) == 0  # the job's own folder resumes it


def test_exports_a_killed_run_left_stale_are_written_by_the_next_run(img2dataset_folder: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A rerun that committed a repaired shard and was killed inside the export refresh left
    sizes.json without that shard; the next run had nothing to commit, so it did not refresh,
    and nothing recorded that the exports were stale."""
    import pairclean.job.runner as runner

    whole = (img2dataset_folder / "00003.tar").read_bytes()
    (img2dataset_folder / "00003.tar").write_bytes(whole[:3000])  # cut: it fails the first run
    out = tmp_path / "weights"
    run = ["score", str(img2dataset_folder), "--out", str(out), *TINY]
    assert main(run) != 0
    assert main(["export", str(out)]) == 0
    sizes = Path(f"{out}{schema.SIDE_SUFFIX}") / "export" / "sizes.json"
    assert "00003.tar" not in json.loads(sizes.read_text())
    (img2dataset_folder / "00003.tar").write_bytes(whole)

    def killed(out_dir: object) -> None:
        raise KeyboardInterrupt  # the run is killed inside its refresh, after the commit

    monkeypatch.setattr(runner, "refresh_exports", killed)
    assert main(run) == 130  # the CLI's exit for an interrupt
    monkeypatch.undo()
    assert "00003.tar" not in json.loads(sizes.read_text())  # stale: the table of 00003 is committed
    assert schema.local_side_path(out, schema.EXPORTS_STALE_FILE).is_file()
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0  # says so (it said nothing: a rescore killed there left no other trace)
    assert "WARNING: the exports (sizes.json, shard_weights.json, datacomp_keep.npy) may hold the earlier weights" in \
        capsys.readouterr().out
    assert main(run) == 0  # nothing left to score: the exports are written anyway
    assert json.loads(sizes.read_text())["00003.tar"] == 10
    assert not schema.local_side_path(out, schema.EXPORTS_STALE_FILE).exists()
    assert main(["inspect", str(out)]) == 0 and "WARNING" not in capsys.readouterr().out
    # a rescore killed inside its refresh (after its rewrite ended) is said too, and repaired
    import pairclean.job.rescore as rescore

    monkeypatch.setattr(rescore, "refresh_exports", killed)
    assert main(["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"]) == 130
    monkeypatch.undo()
    assert main(["inspect", str(out)]) == 0 and "may hold the earlier weights" in capsys.readouterr().out
    assert main(["export", str(out)]) == 0
    assert not schema.local_side_path(out, schema.EXPORTS_STALE_FILE).exists()


def test_a_job_read_through_a_link_to_its_folder_is_that_job(scored: Path, tmp_path: Path) -> None:
    """``export LINK`` (LINK -> the job's OUT) said the job held no committed shard and left an
    empty ``LINK.pairclean`` behind: the side folder was looked for beside the link."""
    link = tmp_path / "link"
    link.symlink_to(scored, target_is_directory=True)
    assert main(["export", str(link)]) == 0
    assert not Path(f"{link}{schema.SIDE_SUFFIX}").exists()
    assert (Path(f"{scored}{schema.SIDE_SUFFIX}") / "export" / "sizes.json").is_file()
    assert [r.stem for r in OutputDir(str(link)).iter_committed()] == [r.stem for r in OutputDir(str(scored)).iter_committed()]


def test_verbs_on_a_mistyped_folder_leave_nothing_behind(scored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``export nope`` made ``nope.pairclean/state/`` (its lock), and ``export OUT/x.parquet`` a
    folder inside the score folder, which the next score then called someone else's files."""
    from pairclean_workers.cli import main

    table = next(scored.glob("*.parquet"))
    for target in (tmp_path / "nope", table):
        for verb in (["export"], ["rescore", "--beta-recipe", "gmm", "--weighting", "paper"], ["refine"], ["pseudo-pair"]):
            capsys.readouterr()
            assert main([verb[0], str(target), *verb[1:]]) == 1
            err = capsys.readouterr().err
            assert "is not a pairclean output folder" in err or "lies inside the pairclean output" in err
            assert not Path(f"{target}{schema.SIDE_SUFFIX}").exists() and not (tmp_path / "nope").exists()
