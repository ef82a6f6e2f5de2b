"""The verbs that rewrite a finished job's tables (rescore, refine, audit) and export, against
each other and against a crash: the run lock, the interrupted-rewrite marker, temporaries
(real CLI, tiny real estimator, real Parquet)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pairclean

from pairclean import schema
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "8", "--executor", "local"]


@pytest.fixture
def scored(make_shards, tmp_path: Path) -> tuple[Path, list[str]]:
    shards = [str(s) for s in make_shards(n_shards=3, per_shard=8)]
    out = tmp_path / "out"
    command = ["score", *shards, "--out", str(out), *TINY]
    assert main(command) == 0
    return out, command


def test_rescore_and_export_wait_for_no_one_holding_the_folder(scored, capsys) -> None:
    from pairclean.output.lock import RunLock
    from pairclean.output.folder import OutputDir

    out, _ = scored
    with RunLock(OutputDir(str(out)).store, ttl_s=30):  # a score, refine or rescore running on it
        for command in (["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"], ["export", str(out)]):
            assert main(command) == 1
            err = capsys.readouterr().err
            assert "is in use by another pairclean" in err and err.count("\n") == 1
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]) == 0


def test_an_interrupted_rescore_is_reported_everywhere_until_it_is_run_again(scored, monkeypatch, capsys) -> None:
    import pairclean.job.rescore as rescore_module
    from pairclean.errors import InputError
    from pairclean.sampler import WeightStage

    out, command = scored
    rewrite = rescore_module._rewrite
    calls = []

    def dies_after_one(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt  # a kill after the first table
        calls.append(1)
        return rewrite(*args, **kwargs)

    monkeypatch.setattr(rescore_module, "_rewrite", dies_after_one)
    rescore = ["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]
    assert main(rescore) == 130  # the CLI's Ctrl-C exit
    monkeypatch.setattr(rescore_module, "_rewrite", rewrite)
    capsys.readouterr()
    # the tables mix two weightings: every reader says so instead of using them
    assert main(["inspect", str(out)]) == 0
    assert "WARNING: a `pairclean rescore` was interrupted" in capsys.readouterr().out
    for other in (command, ["export", str(out)], ["pseudo-pair", str(out), "--executor", "local"]):
        assert main(other) == 1
        err = capsys.readouterr().err
        assert "a `pairclean rescore` was interrupted while rewriting the tables" in err and err.count("\n") == 1
    with pytest.raises(InputError, match="interrupted while rewriting the tables"):
        WeightStage(out)
    with pytest.raises(InputError, match="interrupted while rewriting the tables"):  # it returned the mix, labelled as the new
        pairclean.read_scores(out)
    # our temporary of a killed write goes; a user's hidden file with ".tmp-" in its name stays
    (out / ".part-001.parquet.tmp-4242-0123abcd").write_bytes(b"half")
    (out / ".notes.tmp-keep").write_text("mine")
    assert main(rescore) == 0
    assert not (out / ".part-001.parquet.tmp-4242-0123abcd").exists() and (out / ".notes.tmp-keep").read_text() == "mine"
    assert main(["inspect", str(out)]) == 0 and "WARNING" not in capsys.readouterr().out
    assert main(["export", str(out)]) == 0
    WeightStage(out)
    assert pairclean.read_scores(out).num_rows > 0


def test_an_export_killed_between_its_record_and_its_sizes_copy_still_knows_its_own_file(scored, tmp_path: Path,
                                                                                        monkeypatch) -> None:
    import pairclean.output.exports as exports

    out, _ = scored
    sizes_dir = tmp_path / "sizes"
    sizes_dir.mkdir()
    export = ["export", str(out), "--sizes-dir", str(sizes_dir), "--sizes-of", "kept"]
    assert main(export) == 0
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]) == 0  # other kept counts

    def killed(path: Path, data: bytes) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(exports, "_atomic_write", killed)
    assert main(export) == 130
    monkeypatch.undo()
    assert main(export) == 0  # it used to refuse its own earlier sizes.json as someone else's
    (sizes_dir / "sizes.json").write_text("{}")  # a file of the user's now: refused
    assert main(export) == 1


def test_overwrite_removes_the_rewrite_marker_with_the_job(scored) -> None:
    from pairclean.output.folder import OutputDir

    out, command = scored
    folder = OutputDir(str(out))
    folder.begin_rewrite("refine")
    assert folder.interrupted_rewrite() == "refine"
    assert main([*command, "--overwrite"]) == 0
    assert OutputDir(str(out)).interrupted_rewrite() is None
    assert not Path(schema.local_side_path(out, schema.REWRITE_FILE)).exists()


def _exports(out: Path) -> dict[str, bytes]:
    side = Path(f"{out}{schema.SIDE_SUFFIX}") / "export"
    return {p.name: p.read_bytes() for p in sorted(side.iterdir())}


def test_exports_follow_every_rewrite_of_the_tables(scored, make_shards, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers read the exports without asking (open_clip sizes.json, DataComp's keep list,
    shard weights): a rescore, an audit or more shards used to leave them on the earlier
    weights with a warning. Each now writes them again with the options of the last export,
    as a fresh export would; where that cannot be done (a copy someone replaced), it says so
    and leaves the tables' rewrite done."""
    import json
    import logging

    out, command = scored
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(out), "--sizes-of", "kept", "--sizes-dir", "copy"]) == 0  # a folder relative to here
    before = _exports(out)
    # a rescore with another weighting changes the flags, so the kept counts and weight sums
    # (run from elsewhere: the copy's folder was recorded as an absolute path)
    monkeypatch.chdir(copy_dir)
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]) == 0
    assert not (copy_dir / "copy").exists()
    after = _exports(out)
    assert after != before and (copy_dir / "sizes.json").read_bytes() == after["sizes.json"]
    assert main(["export", str(out), "--sizes-of", "kept", "--sizes-dir", str(copy_dir)]) == 0
    assert _exports(out) == after  # what a fresh export writes
    # a shard that failed, exported without it, then retried: the rerun that commits it counts it in
    good = make_shards(n_shards=1, per_shard=8, prefix="late", offset=24)[0]
    late = tmp_path / "late-00000.tar"
    late.write_bytes(b"not yet downloaded" * 100)
    job = ["score", command[1], str(late), "--out", str(tmp_path / "partial"), *TINY, "--max-failed-fraction", "0.5"]
    assert main(job) == 4  # PARTIAL
    assert main(["export", str(tmp_path / "partial")]) == 0
    assert "late-00000.tar" not in json.loads(_exports(tmp_path / "partial")["sizes.json"])
    late.write_bytes(good.read_bytes())
    assert main(job) == 0
    assert json.loads(_exports(tmp_path / "partial")["sizes.json"])["late-00000.tar"] == 8
    # a copy outside that someone else replaced: the tables are rescored, the exports refused with a warning
    (copy_dir / "sizes.json").write_text('{"theirs": 1}')
    with caplog.at_level(logging.WARNING):
        assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "p-clean"]) == 0
    assert "still hold the earlier weights" in caplog.text and "pairclean export" in caplog.text
    assert (copy_dir / "sizes.json").read_text() == '{"theirs": 1}'


def test_a_refresh_replaces_only_copies_that_are_there_and_never_waits_on_a_fifo(scored, tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The options a refresh reads come from the job's own exports.json: a record naming
    another folder made a sizes.json there. And a FIFO named sizes.json where a copy goes
    hung the export (with the job's lock held)."""
    import os

    out, _ = scored
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    assert main(["export", str(out), "--sizes-dir", str(copy_dir)]) == 0
    (copy_dir / "sizes.json").unlink()  # the user removed the copy: a rescore does not make it again
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]) == 0
    assert not (copy_dir / "sizes.json").exists()
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "sizes.json")
    capsys.readouterr()
    assert main(["export", str(out), "--sizes-dir", str(fifo_dir)]) == 1
    err = capsys.readouterr().err
    assert "cannot be read as a file" in err and "not a regular file" in err and err.count("\n") == 1


def test_damaged_state_files_are_one_line_errors_or_left_alone(scored, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by attacking the verbs with damaged state: each was a traceback, or a lock no
    run could take."""
    import json
    import time

    import numpy as np

    out, command = scored
    state = Path(schema.local_side_path(out, schema.CALIBRATION_FILE)).parent
    calibration = (state / "calibration.json").read_text()
    for field, value in (("beta", "x"), ("extra", [])):  # a ValueError / AttributeError traceback
        (state / "calibration.json").write_text(json.dumps({**json.loads(calibration), field: value}))
        capsys.readouterr()
        assert main(["refine", str(out), "--executor", "local"]) == 1  # it reads the frozen calibration
        err = capsys.readouterr().err
        assert "calibration.json is damaged" in err and f"its {field} is" in err and err.count("\n") == 1
    (state / "calibration.json").write_text(calibration)
    from pairclean.errors import InputError
    from pairclean.output.folder import OutputDir

    bank = state / "contrast-bank.npy"  # a header declaring a shape no memory holds: numpy's _ArrayMemoryError traceback
    header = np.lib.format.header_data_from_array_1_0(np.zeros((2, 2), np.float16))
    with bank.open("wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {**header, "shape": (2, 10**12, 512)})
    with pytest.raises(InputError, match="contrast-bank.npy is damaged"):
        OutputDir(str(out)).read_contrast_bank()
    bank.unlink()
    # a lock whose pid no process can have, or whose heartbeat is a day ahead, holds nothing
    lock = Path(schema.local_side_path(out, schema.LOCK_FILE))
    import socket

    for doc in ({"pid": 10**20, "host": socket.gethostname(), "heartbeat": time.time()},  # OverflowError before
                {"pid": 1, "host": "elsewhere", "heartbeat": time.time() + 86400}):  # held the folder for good before
        lock.write_text(json.dumps({"run_id": "r", "ttl_s": 60, **doc}))
        assert main(["export", str(out)]) == 0
    # an exports record that is not one pairclean wrote (a traceback in export and in score
    # --overwrite before): export says in one line it will not replace what it cannot call its
    # own; --overwrite goes on and leaves the files that record would name
    exports = Path(schema.local_side_path(out, schema.EXPORTS_FILE))
    for record in ("{not json", json.dumps({"written": 5})):
        exports.write_text(record)
        capsys.readouterr()
        assert main(["export", str(out)]) == 1
        err = capsys.readouterr().err
        assert "pairclean did not write it" in err and err.count("\n") == 1
    sizes = Path(schema.local_side_path(out, f"{schema.EXPORT_DIR}/sizes.json"))
    assert main([*command, "--overwrite"]) == 0 and sizes.exists()
    # a manifest whose statuses are not counts (ArrowTypeError in rescore, AttributeError in refine before)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (segment,) = sorted(Path(schema.local_side_path(out, schema.MANIFEST_DIR)).glob("*.parquet"))
    table = pq.read_table(segment)
    pq.write_table(table.set_column(table.schema.get_field_index("statuses"), "statuses",
                                    pa.array(["[1, 2]"] * table.num_rows, pa.string())), segment)
    for verb in (["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"], ["refine", str(out), "--executor", "local"]):
        capsys.readouterr()
        assert main(verb) == 1
        err = capsys.readouterr().err
        assert "(completion records) is damaged (its statuses is [1, 2])" in err and err.count("\n") == 1, err
