"""`pairclean score / rescore / inspect` end to end on real shards with the tiny real model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pairclean

from pairclean import schema
from pairclean.output.folder import OutputDir
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--executor", "local"]


def _score(shards: list[str], out: Path, *extra: str) -> int:
    return main(["score", *shards, "--out", str(out), *TINY, *extra])


def _rows(out: Path, stem: str) -> list[dict]:
    return pq.read_table(out / f"{stem}.parquet").to_pylist()


def _manifest(out: Path) -> list[dict]:
    """Completion records of committed shards, in spec order."""
    return [r.to_json() for r in OutputDir(str(out)).iter_committed()]


def test_score_writes_one_keyed_parquet_per_shard_with_metadata(make_shards, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = {1: {"jpg": b"not an image"}, 2: {"txt": " "}, 3: {"jpg": None}}
    shards = make_shards(n_shards=2, per_shard=6, extra=bad)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out, "--shard-timeout", "5", "--num-actors", "3") == 0
    # the Ray executor's options do nothing here (TINY runs --executor local): said, not ignored
    assert "--num-actors: Ray executor options, not applied with --executor local" in caplog.text  # a limit applies
    for shard in shards:
        stem = shard.name[: -len(".tar")]
        rows = _rows(out, stem)
        keys = [r["key"] for r in rows]
        assert len(rows) == 6 and keys == sorted(keys)  # tar order, the shard's own keys
        assert all(r["shard"] == str(shard) for r in rows)
        assert [r["idx"] for r in rows] == list(range(6))
        assert all(r["uid"].startswith("uid-") and r["url"].startswith("https://") for r in rows)
        for r in rows:
            if r["status"] == "ok":
                assert -1 <= r["similarity"] <= 1 and 0 <= r["weight"] <= 1
            else:
                assert np.isnan(r["similarity"]) and r["weight"] == 0 and r["noisy"] and r["error"]
    first = _rows(out, "part-00000")
    assert [r["status"] for r in first[:4]] == ["ok", "decode_error", "empty_text", "missing_image"]
    meta = json.loads(pq.read_schema(out / "part-00000.parquet").metadata[schema.META_KEY])
    assert meta["model"]["model_id"] == "pairclean-tiny-test"
    assert meta["beta"]["recipe"] == "random-inputs" and meta["beta"]["k"] == 256
    assert meta["weighting"]["name"] == "p-clean" and meta["pairclean_version"]
    assert meta["p_clean"] == {"recipe": "hard", "version": 0, "rule": "similarity > beta"}
    # the default weight is p_clean (here the hard s > beta: 9 ok pairs are too few for a mixture)
    assert all(r["weight"] == r["p_clean"] == (0.0 if r["noisy"] else 1.0) for r in first)
    emb = pq.read_table(schema.local_side_path(out, "_emb/part-00000.parquet"))
    assert emb.column("key").to_pylist() == [r["key"] for r in first]
    # rows that are not ok hold zero vectors, never nulls (pyarrow 18-25 cannot write or read those back)
    assert emb.column("image_emb").null_count == 0
    vectors = np.array(emb.column("image_emb").to_pylist(), dtype=np.float32)
    assert [bool(np.any(v != 0)) for v in vectors] == [r["status"] == "ok" for r in first]
    manifest = _manifest(out)
    assert [m["stem"] for m in manifest] == ["part-00000", "part-00001"]
    assert manifest[0]["statuses"] == {"decode_error": 1, "empty_text": 1, "missing_image": 1, "ok": 3}
    job = json.loads(schema.local_side_path(out, schema.JOB_FILE).read_text())
    assert job["spec"]["shards"] == [str(s) for s in shards]


def test_rerun_resumes_and_a_different_spec_is_refused(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    shards = [str(s) for s in make_shards(n_shards=3, per_shard=4)]
    out = tmp_path / "out"
    assert _score(shards[:2] + shards[2:], out) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    assert _score(shards, out) == 0
    assert "3 already done" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before
    # A shard rewritten in place since (re-downloaded, regenerated) is scored again, saying so;
    # the others stay as they were (the table used to keep describing the old file)
    make_shards(n_shards=1, per_shard=6, offset=20)  # part-00000.tar again, 6 other pairs
    capsys.readouterr()
    assert _score(shards, out) == 0
    assert "part-00000.tar changed since it was committed (" in caplog.text
    assert len(_rows(out, "part-00000")) == 6 and [r["rows"] for r in _manifest(out)] == [6, 4, 4]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-0000[12].parquet")} == {
        k: v for k, v in before.items() if k != "part-00000.parquet"}
    # ... and one replaced by another file of the same size (tars are padded to 10 KiB records):
    # by size alone it was kept as done, its table describing the file it replaced
    data = Path(shards[1]).read_bytes()
    at = data.index(b"uid-")  # a json member's text: the same length, another content
    Path(shards[1]).write_bytes(data[:at] + b"UID-" + data[at + 4:])
    table_before = (out / "part-00001.parquet").stat().st_mtime_ns
    caplog.clear()
    assert _score(shards, out) == 0
    assert "part-00001.tar changed since it was committed (modified since, same size)" in caplog.text
    assert (out / "part-00001.parquet").stat().st_mtime_ns != table_before
    assert {r["uid"] for r in _rows(out, "part-00001")} & {f"UID-{i}" for i in range(100)}
    assert _score(shards, out, "--weighting", "reference") == 1
    assert "different spec" in capsys.readouterr().err
    assert _score(shards, out, "--weighting", "reference", "--overwrite") == 0
    assert len(_manifest(out)) == 3


def test_a_changed_shard_that_now_fails_is_no_longer_read_as_committed(make_shards, tmp_path: Path) -> None:
    """A shard re-downloaded short since it was committed failed on the rerun, but its old
    table and record stayed: inspect, read_scores and export kept using the old rows."""
    shards = [str(s) for s in make_shards(n_shards=2, per_shard=4)]
    out = tmp_path / "out"
    assert _score(shards, out, "--embeddings") == 0
    assert main(["export", str(out)]) == 0
    Path(shards[1]).write_bytes(Path(shards[1]).read_bytes()[:20_000])  # cut short
    assert _score(shards, out, "--embeddings", "--max-failed-fraction", "0.5") == 4  # PARTIAL
    folder = OutputDir(str(out))
    assert list(folder.committed()) == ["part-00000"] and list(folder.quarantined()) == ["part-00001"]
    assert not (out / "part-00001.parquet").exists()
    assert set(pairclean.read_scores(out).column("shard").to_pylist()) == {shards[0]}
    # the exports trainers read without asking follow (no shard committed again, yet they changed)
    weights = json.loads(schema.local_side_path(out, f"{schema.EXPORT_DIR}/shard_weights.json").read_text())
    assert Path(shards[1]).name not in weights and Path(shards[0]).name in weights, weights


def test_a_changed_shard_is_scored_again_after_a_rescore_too(make_shards, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A rescore gives the job another digest, which its embedding sidecars do not carry: the
    sidecar of a shard scored again is still this folder's own (it was refused as another job's)."""
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=4)]
    out = tmp_path / "out"
    assert _score(shards, out, "--embeddings") == 0
    assert main(["rescore", str(out), "--beta-recipe", "random-inputs", "--weighting", "paper"]) == 0
    make_shards(n_shards=1, per_shard=6, offset=20)  # the same shard, re-made with 6 pairs
    assert _score(shards, out, "--embeddings", "--beta-recipe", "random-inputs", "--weighting", "paper") == 0
    assert "changed since it was committed" in caplog.text and len(_rows(out, "part-00000")) == 6


def test_scores_are_reproducible_byte_for_byte(make_shards, tmp_path: Path) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=6)]
    _score(shards, tmp_path / "a")
    _score(shards, tmp_path / "b")
    assert (tmp_path / "a/part-00000.parquet").read_bytes() == (tmp_path / "b/part-00000.parquet").read_bytes()


def test_rescore_agrees_with_a_fresh_score(make_shards, tmp_path: Path) -> None:
    shards = [str(s) for s in make_shards(n_shards=2, per_shard=10)]
    for recipe, weighting in (("shuffled", "reference"), ("gmm", "reference-batch"), ("random-inputs", "paper")):
        fresh, redo = tmp_path / f"fresh-{recipe}", tmp_path / f"redo-{recipe}"
        assert _score(shards, fresh, "--beta-recipe", recipe, "--weighting", weighting, "--beta-k", "16") == 0
        assert _score(shards, redo, "--beta-k", "16") == 0
        assert main(["rescore", str(redo), "--beta-recipe", recipe, "--weighting", weighting, "--device", "cpu"]) == 0
        for stem in ("part-00000", "part-00001"):
            a, b = _rows(fresh, stem), _rows(redo, stem)
            assert [r["key"] for r in a] == [r["key"] for r in b]
            np.testing.assert_allclose([r["weight"] for r in a], [r["weight"] for r in b], atol=1e-6)
            np.testing.assert_allclose([r["p_clean"] for r in a], [r["p_clean"] for r in b], atol=1e-6)
            assert [r["noisy"] for r in a] == [r["noisy"] for r in b]
        meta = json.loads(pq.read_schema(redo / "part-00000.parquet").metadata[schema.META_KEY])
        assert meta["beta"]["recipe"] == recipe and meta["weighting"]["name"] == weighting
        ok_pairs = sum(r["status"] == "ok" for stem in ("part-00000", "part-00001") for r in _rows(redo, stem))
        # p_clean is self-describing: the corpus-mixture curve (refitted from the sidecars) when
        # the options calibrate on the corpus and it has 16+ ok pairs (random-inputs + paper: none)
        corpus = recipe != "random-inputs" or weighting in ("reference", "p-clean")
        assert meta["p_clean"]["recipe"] == ("corpus-mixture" if corpus and ok_pairs >= 16 else "hard")
        # rerunning `score` with the rescored options resumes instead of refusing
        assert _score(shards, redo, "--beta-recipe", recipe, "--weighting", weighting, "--beta-k", "16") == 0


def test_inspect_prints_counts_noise_rate_and_histogram(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=20, extra={0: {"jpg": b"not an image"}})]
    _score(shards, tmp_path / "o")
    # score's last line: what the corpus-mixture p_clean counted, from its fit, and how to
    # measure what it cannot see
    fit = OutputDir(str(tmp_path / "o")).read_calibration().extra["p_clean"]["fit"]
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith(f"p_clean: the calibration sample shows {100 * fit['pi_random']:.1f}% random and "
                           f"{100 * fit['pi_near']:.1f}% near-miss pairs (near-miss share: {fit['near_share_source']})")
    assert note.endswith(f"measure them with `pairclean audit {tmp_path / 'o'} --sample 200`")
    assert main(["inspect", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "ok=19" in text and "decode_error=1" in text and "weight histogram" in text
    # listed pairs name their shard as well as their key (keys repeat across shards in many corpora)
    lowest = text.split("lowest-weight pairs:\n")[1].splitlines()
    assert lowest and all(line.split()[0].startswith(Path(shards[0]).stem.split(".")[0] + "/") for line in lowest)
    # the noise-rate estimate is the wrong captions p_clean expects; the random-mismatch share
    # (a lower bound) is its own line
    table = pq.read_table(tmp_path / "o")
    p_clean = table.column("p_clean").to_numpy()[np.array(table.column("status").to_pylist()) == "ok"]
    assert f"noise-rate estimate (1 - mean p_clean over ok pairs: the wrong captions p_clean expects): {100 * (1 - p_clean.mean()):.1f}%" in text
    assert "random-mismatch share (pairs below the median of random mismatched pairs x 2" in text
    assert main(["inspect", str(tmp_path / "o"), "--json"]) == 0

    def no_nan(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")  # the failed row's similarity was a bare NaN

    doc = json.loads(capsys.readouterr().out, parse_constant=no_nan)
    assert doc["pairs"] == 20 and doc["expected_noise"] == pytest.approx(1 - p_clean.astype(float).mean())
    assert [r["similarity"] for r in doc["first"] if r["status"] == "decode_error"] == [None]
    with pytest.raises(SystemExit) as usage:
        main(["inspect", str(tmp_path / "o"), "--rows", "-1"])
    assert usage.value.code == 2
    capsys.readouterr()
    for wrong in (tmp_path / "no-such-folder", tmp_path / "o" / "part-00000.parquet"):  # said "holds no committed shard"
        assert main(["inspect", str(wrong)]) == 1
        assert "is not a pairclean output folder" in capsys.readouterr().err


def test_bad_input_gives_clear_errors_and_exit_codes(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _score([str(tmp_path / "missing.tar")], tmp_path / "o1") == 1
    assert "shard not found" in capsys.readouterr().err
    assert _score(["ftp://host/x.tar"], tmp_path / "o2") == 1
    assert "unsupported URI scheme" in capsys.readouterr().err
    good = [str(s) for s in make_shards(n_shards=1, per_shard=3)]
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"garbage" * 500)
    assert _score(good + [str(junk)], tmp_path / "o3") == 3  # FAILED: 1 of 2 shards > 5%
    captured = capsys.readouterr()
    assert "junk.tar" in captured.err and "FAILED" in captured.out
    assert [m["stem"] for m in _manifest(tmp_path / "o3")] == ["part-00000"]  # the good one
    failed = OutputDir(str(tmp_path / "o3")).quarantined()
    assert list(failed) == ["junk"] and failed["junk"]["state"] == "quarantined" and "junk.tar" in failed["junk"]["error"]
    assert _score(good + [str(junk)], tmp_path / "o3", "--max-failed-fraction", "0.5") == 4  # PARTIAL
    assert "PARTIAL" in capsys.readouterr().out
    # rescoring keeps the quarantine record
    assert main(["rescore", str(tmp_path / "o3"), "--beta-recipe", "gmm", "--weighting", "paper"]) == 0
    assert sorted(OutputDir(str(tmp_path / "o3")).quarantined()) == ["junk"]
    # ... and inspect names it beside the committed count
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "o3")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("shards: 1/2 committed") and "; 1 failed (a rerun retries them): junk (" in first and "junk.tar" in first
    # An output that is an existing file: one line naming it, exit 1, no traceback (issue 10, item 6).
    (tmp_path / "a-file").write_text("x")
    assert _score(good, tmp_path / "a-file") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "a-file") in err and "Traceback" not in err and err.count("\n") == 1
    assert "is a file, not a folder" in err and (tmp_path / "a-file").read_text() == "x"
    assert not Path(f"{tmp_path / 'a-file'}{schema.SIDE_SUFFIX}").exists()  # refused before anything was scored
    # A user's file where the state folder goes (OUT.pairclean): named, kept, nothing written
    # (it ended in "Not a directory: .../lock.json")
    side = Path(f"{tmp_path / 'o4'}{schema.SIDE_SUFFIX}")
    side.write_text("mine")
    assert _score(good, tmp_path / "o4") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"{side} is a file pairclean did not write" in err
    assert side.read_text() == "mine" and not (tmp_path / "o4").exists()
    # Counts that cannot run (--calibration-pairs 0 used to report SUCCEEDED), a fraction
    # outside [0, 1], a lock that never expires, a storage option without "=": usage errors
    # (exit 2, as README says of every usage error; the counts exited 1), one line, nothing written
    for flag, value in (("--calibration-pairs", "0"), ("--max-pixels", "-5"), ("--batch-size", "0"), ("--storage-option", "foo"),
                        ("--max-failed-fraction", "2"), ("--max-failed-fraction", "-1"), ("--lock-ttl", "-5"), ("--lock-ttl", "nan"),
                        ("--seed", "-1"), ("--threads", "-2"), ("--num-actors", "0"), ("--max-retries", "-1"),
                        ("--judge-budget", "nan"), ("--shard-timeout", "inf")):
        with pytest.raises(SystemExit) as usage:
            main(["score", *good, "--out", str(tmp_path / "o4"), *TINY, flag, value])
        assert usage.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err
        assert not (tmp_path / "o4").exists()
    # A mistyped --caption-field: one line before anything is scored, and the corrected command runs there
    assert _score(good, tmp_path / "o6", "--caption-field", "captoin") == 1
    err = capsys.readouterr().err
    assert "no json field 'captoin'" in err and "check --caption-field" in err and err.count("\n") == 1
    assert not list((tmp_path / "o6").glob("*.parquet"))
    assert _score(good, tmp_path / "o6") == 0
    capsys.readouterr()
    # Captions in a member pairclean does not read, images in one it does not either, and no
    # --caption-field: one line naming the fields the samples carry, nothing written (this
    # used to write a corpus of empty rows and report SUCCEEDED)
    shards_txt: list[str] = []
    for moved, status, hint in (("txt", "missing_text", "(--caption-field .caption)"), ("jpg", "missing_image", "jpg/jpeg/png/webp")):
        renamed = {i: {moved: None, "caption" if moved == "txt" else "image": b"a dog runs" if moved == "txt" else b"moved"} for i in range(6)}
        shards = [str(s) for s in make_shards(n_shards=2, per_shard=3, prefix=f"moved-{moved}", extra=renamed)]
        shards_txt = shards if moved == "txt" else shards_txt
        assert _score(shards, tmp_path / f"o7-{moved}") == 1
        err = capsys.readouterr().err
        assert f"(6 rows: {status}=6;" in err and hint in err and err.count("\n") == 1 and "Traceback" not in err
        assert "its fields: caption, jpg, json" in err if moved == "txt" else "its fields: image, json, txt" in err
        assert not list((tmp_path / f"o7-{moved}").glob("*.parquet"))
        # ... also where the calibration needs no corpus (and reads no shard with the model)
        assert _score(shards, tmp_path / f"o9-{moved}", "--beta-recipe", "random-inputs", "--weighting", "paper", "--judge", "off") == 1
        assert f"from the first 2 shard(s) (6 rows: {status}=6;" in capsys.readouterr().err
        assert not list((tmp_path / f"o9-{moved}").glob("*.parquet"))
    # the corrected command reads the caption member (a leading dot names a member) in the same folder
    assert _score(shards_txt, tmp_path / "o7-txt", "--caption-field", ".caption") == 0
    assert {r["status"] for r in _rows(tmp_path / "o7-txt", "moved-txt-00000")} == {"ok"}
    capsys.readouterr()
    # ... while shards whose pairs all fail on their data (images that do not decode) stay rows with a status
    broken = [str(s) for s in make_shards(n_shards=1, per_shard=3, prefix="broken", extra={i: {"jpg": b"not an image"} for i in range(3)})]
    assert _score(broken, tmp_path / "o8") == 0
    assert [r["status"] for r in _rows(tmp_path / "o8", "broken-00000")] == ["decode_error"] * 3
    capsys.readouterr()
    # A corrupt image among captions in an unread member does not hide the misnamed field (it
    # used to: any status besides missing_* kept the check quiet) ...
    mostly = {i: {"txt": None, "caption": b"a dog runs"} for i in range(4)} | {4: {"jpg": b"not an image"}}
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=5, prefix="mostly", extra=mostly)]
    for extra_args in ((), ("--beta-recipe", "random-inputs", "--weighting", "paper", "--judge", "off")):
        assert _score(shards, tmp_path / f"o10-{len(extra_args)}", *extra_args) == 1
        err = capsys.readouterr().err
        assert "(5 rows: decode_error=1, missing_text=4;" in err and "(--caption-field .caption)" in err and err.count("\n") == 1
        assert not list((tmp_path / f"o10-{len(extra_args)}").glob("*.parquet"))
    # ... but a first shard of captionless samples before good ones is data, there too (it
    # refused the whole job: only the first shard was read)
    first = [str(s) for s in make_shards(n_shards=1, per_shard=3, prefix="bare", extra={i: {"txt": None} for i in range(3)})]
    good_too = [str(s) for s in make_shards(n_shards=1, per_shard=3, prefix="fine", offset=3)]
    assert _score(first + good_too, tmp_path / "o12", "--beta-recipe", "random-inputs", "--weighting", "paper", "--judge", "off") == 0
    capsys.readouterr()
    # ... and a shard of mostly corrupt images with a caption missing here and there is data: rows
    mostly_broken = {i: {"jpg": b"not an image"} for i in range(3)} | {3: {"txt": None}}
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=4, prefix="mbroken", extra=mostly_broken)]
    assert _score(shards, tmp_path / "o11") == 0
    assert sorted(r["status"] for r in _rows(tmp_path / "o11", "mbroken-00000")) == ["decode_error"] * 3 + ["missing_text"]
    capsys.readouterr()
    # Nothing scored is FAILED even where every shard may fail: PARTIAL says some work is there
    assert _score([str(junk)], tmp_path / "o5", "--max-failed-fraction", "1") == 3
    assert "FAILED" in capsys.readouterr().out


def test_missing_object_storage_credentials_are_one_line(make_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=2)]
    assert main(["score", *shards, "--out", "s3://no-such-bucket-pairclean/out", *TINY]) == 1
    err = capsys.readouterr().err
    assert err == "error: object storage: NoCredentialsError: Unable to locate credentials\n"


def test_rescoring_a_job_without_ok_pairs_is_one_line(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards(n_shards=1, per_shard=2, extra={0: {"jpg": b"not an image"}, 1: {"jpg": b"nor this"}})
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0  # every row failed: nothing to calibrate on
    capsys.readouterr()
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "paper"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the shuffled recipe needs the embeddings of at least 2 ok pairs") and err.count("\n") == 1


def test_an_output_bucket_that_does_not_exist_is_named_in_the_error(make_shards, s3_endpoint: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=2)]
    assert main(["score", *shards, "--out", "s3://no-such-bucket/out", *TINY, "--storage-option", f"endpoint_url={s3_endpoint}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "s3://no-such-bucket/out" in err and "Traceback" not in err and err.count("\n") == 1


def test_a_start_that_failed_before_calibrating_does_not_block_the_corrected_command(
        make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=4)]
    out = tmp_path / "out"
    args = ["--no-progress", "--batch-size", "4", "--executor", "local"]
    assert main(["score", *shards, "--out", str(out), "--model", "no-such-model", *args]) == 1
    assert "unknown model" in capsys.readouterr().err
    assert _score(shards, out) == 0  # not "holds a job with a different spec"
    assert len(_manifest(out)) == 1
    # Once a job has done work, a different spec is still refused.
    assert _score(shards, out, "--weighting", "reference") == 1
    assert "different spec" in capsys.readouterr().err
    # A job whose every shard failed before it could calibrate left nothing to resume either:
    # the corrected command takes the folder, and the old failures are not reported as its own
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar" * 100)
    assert _score([str(junk)], tmp_path / "out2") == 3
    capsys.readouterr()
    assert _score(shards, tmp_path / "out2") == 0
    assert len(_manifest(tmp_path / "out2")) == 1 and not OutputDir(str(tmp_path / "out2")).quarantined()


@pytest.mark.slow
def test_kill_9_mid_job_then_rerun_commits_every_shard_exactly_once(make_shards, tmp_path: Path, crash_mid_job) -> None:
    shards = make_shards(n_shards=8, per_shard=8)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", str(shards[0].parent / "part-{00000..00007}.tar"), "--out", str(out), *TINY,
           "--calibration-pairs", "8"]  # a short calibration phase, so the kill lands in the scoring phase
    crash_mid_job(cmd, out, commits=2)
    before = {m["stem"]: (out / m["output"]).stat().st_mtime_ns for m in _manifest(out)}
    assert 2 <= len(before) < 8, "the kill should land in the middle of the job"
    result = subprocess.run(cmd, capture_output=True, timeout=300, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{len(before)} already done" in result.stdout
    manifest = _manifest(out)
    stems = [m["stem"] for m in manifest]
    assert stems == [f"part-{i:05d}" for i in range(8)]
    # committed before the kill: not redone (same file, untouched)
    assert all((out / f"{stem}.parquet").stat().st_mtime_ns == t for stem, t in before.items())
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("_"))
    assert visible == sorted(f"part-{i:05d}.parquet" for i in range(8))
    assert sorted(p.name for p in schema.local_side_path(out, schema.EMB_DIR).iterdir()) == sorted(f"part-{i:05d}.parquet" for i in range(8))
    assert not list(out.rglob(".*"))  # no temporary left behind
    for m in manifest:
        data = (out / m["output"]).read_bytes()
        assert pq.read_table(out / m["output"]).num_rows == m["rows"] == 8
        assert hashlib.sha256(data).hexdigest() == m["sha256"] and len(data) == m["bytes"]


def test_the_corpus_contrast_is_on_by_default_recorded_and_rescored_alike(make_shards, tmp_path: Path) -> None:
    shards = [str(s) for s in make_shards(n_shards=2, per_shard=12)]
    fresh, plain = tmp_path / "fresh", tmp_path / "plain"
    assert _score(shards, fresh) == 0
    folder = OutputDir(str(fresh))
    cal = folder.read_calibration()
    assert cal is not None and cal.extra["contrast"]["recipe"] == "bank-contrast"
    assert cal.extra["contrast"]["bank_rows"] == 24
    assert folder.read_contrast_bank().shape[:2] == (2, 24)
    spec = folder.read_spec()
    assert spec is not None and spec.contrast
    meta = json.loads(pq.read_schema(fresh / "part-00000.parquet").metadata[schema.META_KEY])
    assert meta["contrast"]["bank_sha256"] == cal.extra["contrast"]["bank_sha256"]
    rows = _rows(fresh, "part-00000")
    adjusted = np.array([r[schema.COL_ADJUSTED] for r in rows])
    sims = np.array([r["similarity"] for r in rows])
    assert np.isfinite(adjusted).all() and not np.allclose(adjusted, sims)  # a column of its own, not a copy
    from pairclean.output.report import format_summary, summarize

    text = format_summary(summarize(folder))
    # 24 calibration pairs: fewer than MIN_GATE_PAIRS, so version 3's contrast (no bounds)
    assert ("corpus contrast: on (bank-contrast v3: caption rival x1, image rival x0.75; a caption with a better owner "
            "(another image, in the bank or the pair's shard, whose caption is at cosine >= 0.98 and which fits it better; "
            "owner_margin > 0) keeps x0.1 of its odds, unless it has at most 2 content words and 10 or more other photos "
            "carry it and fit it plausibly (a shared caption: no owner, p_clean at most 0.6, owner_margin -inf); bank of 24") in text
    # a version-4 record's line says where the gate acts (a floor of 0 reads 0.000, never -0.000)
    from pairclean.output.report import _contrast_line

    v4 = {**cal.extra["contrast"], "version": 4, "caption_floor": -0.15, "image_floor": 0.0, "owner_min_fit": 0.12}
    assert ("a caption rival more than 0.150 (an image rival more than 0.000) below its mean lifts a pair only as far as "
            "the pair beats it; bank of 24") in _contrast_line(v4)
    assert "10 or more other photos carry it and fit it at least 0.105 (a shared caption" in _contrast_line({**v4, "repeat_min_fit": 0.105})
    assert "flagged noisy (adjusted_similarity <= beta, or p_clean <= 0.5 where owner_margin > 0)" in text
    assert "noise share by the p_clean mixture (calibration sample): " in text and "near-miss" in text
    # rerunning resumes (auto keeps the folder's setting); --contrast off is another job
    assert _score(shards, fresh) == 0
    assert _score(shards, fresh, "--contrast", "off") == 1
    # off: no column, no bank, and the spec (digest) a job had before contrast existed
    assert _score(shards, plain, "--contrast", "off") == 0
    assert schema.COL_ADJUSTED not in pq.read_schema(plain / "part-00000.parquet").names
    assert "contrast" not in json.loads((tmp_path / "plain.pairclean" / "state" / "job.json").read_text())["spec"]
    # rescoring the plain job with the contrast on gives the fresh job's numbers, from the sidecars
    assert main(["rescore", str(plain), "--beta-recipe", "random-inputs", "--weighting", "p-clean", "--contrast", "on",
                 "--device", "cpu"]) == 0
    for stem in ("part-00000", "part-00001"):
        a, b = _rows(fresh, stem), _rows(plain, stem)
        for col in (schema.COL_ADJUSTED, schema.COL_OWNER_MARGIN, "weight", "p_clean"):
            np.testing.assert_allclose([r[col] for r in a], [r[col] for r in b], atol=1e-6)
        assert [r["noisy"] for r in a] == [r["noisy"] for r in b]


def test_the_sidecar_keeps_each_captions_content_word_count(make_shards, tmp_path: Path) -> None:
    """The corpus contrast's shared-caption rule reads how many content words a caption has;
    the sidecar keeps the count (-1 where the row is not ok) so that a rescore sees what the
    score saw."""
    from pairclean.output.tables import read_caption_words
    from pairclean.read.words import content_word_count

    shards = make_shards(n_shards=1, per_shard=10, extra={2: {"txt": "a dog"}, 4: {"jpg": b"not a jpeg"}})
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    folder = OutputDir(str(out))
    record = next(iter(folder.iter_committed()))
    side = folder.read_embeddings_table(record)
    words = read_caption_words(side, side.num_rows)
    assert words is not None and words.dtype == np.int16
    rows = _rows(out, record.stem)
    expected = [content_word_count(_caption(shards[0], i)) if r["status"] == "ok" else -1 for i, r in enumerate(rows)]
    assert words.tolist() == expected
    assert words[2] == 1 and words[4] == -1 and rows[4]["status"] != "ok" and min(words[[0, 1, 3]]) >= 3
    assert read_caption_words(side.drop_columns([schema.COL_CAPTION_WORDS]), side.num_rows) is None  # an older sidecar
    assert read_caption_words(side, side.num_rows + 1) is None  # another table's rows


def test_a_rescore_of_sidecars_written_before_the_word_counts_records_no_shared_caption_rule(make_shards, tmp_path: Path) -> None:
    """Sidecars without ``caption_words`` (written before the count) say no caption is short: a
    rescore fits its contrast without the shared-caption rule, so the record (and ``inspect``)
    does not claim a rule that cannot act; with the counts it keeps it."""
    import pyarrow.parquet as pq

    shards = [str(s) for s in make_shards(n_shards=2, per_shard=12)]
    out = tmp_path / "out"
    assert _score(shards, out) == 0
    rescore = ["rescore", str(out), "--beta-recipe", "random-inputs", "--weighting", "p-clean", "--device", "cpu"]
    assert main(rescore) == 0
    doc = OutputDir(str(out)).read_calibration().extra["contrast"]  # type: ignore[union-attr]
    assert doc["repeat_carriers"] == 10 and doc["shared_p_clean"] == 0.6
    folder = OutputDir(str(out))
    for record in folder.iter_committed():
        path = schema.local_side_path(out, record.emb_output)
        side = pq.read_table(path)
        pq.write_table(side.drop_columns([schema.COL_CAPTION_WORDS]), path)  # as an earlier release wrote it
    assert main(rescore) == 0
    doc = OutputDir(str(out)).read_calibration().extra["contrast"]  # type: ignore[union-attr]
    assert "repeat_carriers" not in doc and "shared_p_clean" not in doc


def _caption(shard: Path, index: int) -> str:
    """The ``txt`` member of the shard's ``index``-th sample."""
    import tarfile

    with tarfile.open(shard) as tar:
        texts = [m for m in tar.getmembers() if m.name.endswith(".txt")]
        data = tar.extractfile(texts[index])
        assert data is not None
        return data.read().decode()


def test_a_caption_copied_onto_another_photo_has_a_better_owner(make_shards, tmp_path: Path) -> None:
    """Contrast version 3: pair 5 carries pair 3's caption word for word. Whichever of the two
    photos fits it worse has an owner (``owner_margin`` > 0, at least the other's fit less its
    own) and keeps ``owner_odds`` of its odds; every row's p_clean is OSA's under that rule."""
    from pairclean.calibrate.contrast import owner_p_clean
    from pairclean.job.work import osa_p_clean

    source = make_shards(n_shards=1, per_shard=20, noise=0.0, folder=tmp_path / "a")[0]
    shards = make_shards(n_shards=1, per_shard=20, noise=0.0, folder=tmp_path / "b", extra={5: {"txt": _caption(source, 3)}})
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    cal = OutputDir(str(out)).read_calibration()
    assert cal is not None and cal.extra["contrast"]["version"] == 3  # under MIN_GATE_PAIRS: no version-4 bounds
    meta = json.loads(pq.read_schema(out / "part-00000.parquet").metadata[schema.META_KEY])
    assert meta["noisy_rule"] == "adjusted_similarity <= beta, or p_clean <= 0.5 where owner_margin > 0"
    rows = _rows(out, "part-00000")
    sims = np.array([r["similarity"] for r in rows])
    margin = np.array([r[schema.COL_OWNER_MARGIN] for r in rows], np.float32)
    worse, better = (3, 5) if sims[3] < sims[5] else (5, 3)
    assert margin[worse] > 0 and margin[worse] >= sims[better] - sims[worse] - 2e-3
    adjusted = np.array([r[schema.COL_ADJUSTED] for r in rows], np.float32)
    osa_p = osa_p_clean(adjusted, cal)
    expected = owner_p_clean(osa_p, margin, cal.extra["contrast"]["owner_odds"])
    np.testing.assert_allclose([r["p_clean"] for r in rows], expected, atol=1e-6)
    assert expected[worse] < osa_p[worse]
    owned = np.nan_to_num(margin, nan=-1.0) > 0
    assert [r["noisy"] for r in rows] == list((adjusted <= cal.beta) | (owned & (expected <= 0.5)))
    # inspect says how many pairs have one
    from pairclean.output.report import format_summary, summarize

    summary = summarize(OutputDir(str(out)))
    assert summary.owned == pytest.approx(owned.mean()) and summary.owned > 0
    assert f"; {100 * owned.mean():.1f}% of ok pairs have a better owner" in format_summary(summary)
    # and how many carry a shared caption (owner_margin -inf), where the contrast has the rule
    from dataclasses import replace

    assert summary.shared == 0.0 and "carry a shared caption" in format_summary(summary)
    shared = replace(summary, shared=0.25)
    assert "; 25.0% carry a shared caption, p_clean capped" in format_summary(shared)
    assert "before the audit's recalibration" in format_summary(replace(shared, audit={"labels": 200}))
    assert "shared caption" not in format_summary(replace(shared, contrast={k: v for k, v in summary.contrast.items()
                                                                           if k != "shared_p_clean"}))


def test_a_contrast_job_without_sidecars_cannot_be_rescored_with_it(make_shards, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    shards = [str(s) for s in make_shards(n_shards=1, per_shard=20)]
    out = tmp_path / "out"
    assert _score(shards, out, "--no-embeddings") == 0
    assert schema.COL_ADJUSTED in pq.read_schema(out / "part-00000.parquet").names
    assert main(["rescore", str(out), "--beta-recipe", "random-inputs", "--weighting", "p-clean", "--device", "cpu"]) != 0
    assert "the corpus contrast needs them" in capsys.readouterr().err
    assert main(["rescore", str(out), "--beta-recipe", "random-inputs", "--weighting", "p-clean", "--contrast", "off",
                 "--device", "cpu"]) == 0
    assert schema.COL_ADJUSTED not in pq.read_schema(out / "part-00000.parquet").names


def test_sigterm_stops_a_run_like_ctrl_c_one_line_lock_released_and_the_rerun_resumes(make_shards, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    shards = [str(s) for s in make_shards(n_shards=40, per_shard=16)]
    out = tmp_path / "o"
    command = [sys.executable, "-m", "pairclean_workers.cli", "score", *shards, "--out", str(out), *TINY, "--batch-size", "1",
               "--calibration-pairs", "16"]  # a long scoring phase, shard by shard
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # until the scoring phase has committed a shard
        if Path(schema.local_side_path(out, schema.JOB_FILE)).exists() and OutputDir(str(out)).committed():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1] == "terminated (SIGTERM): committed shards are kept; rerun the same command to resume"
    assert "Traceback" not in err
    assert not Path(schema.local_side_path(out, schema.LOCK_FILE)).exists()  # released: the rerun needs no takeover
    done = len(_manifest(out))
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and f"resuming: {done} of 40 shards already committed" in rerun.stderr
    assert len(list(out.glob("*.parquet"))) == 40 and 0 < done < 40


def _zero_bomb(path: Path, jpg: bytes, caption: str, gib: int) -> Path:
    """A ``.tar.gz`` of one pair and an unused field of ``gib`` GiB of zeros: the same gzip
    member of 512 MiB of zeros repeated (a multi-member gzip reads as their concatenation),
    so the file is about 1 MB a GiB and takes seconds to expand."""
    import gzip
    import io
    import tarfile

    head = io.BytesIO()
    for name, data in (("a.jpg", jpg), ("a.txt", caption.encode())):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        head.write(info.tobuf(tarfile.PAX_FORMAT) + data + bytes(-len(data) % 512))
    big = tarfile.TarInfo("a.npy")
    big.size = gib * 2**30
    head.write(big.tobuf(tarfile.PAX_FORMAT))
    chunk = gzip.compress(bytes(512 * 2**20), compresslevel=9)
    end = bytes(1024)
    end += bytes(-(head.tell() + big.size + len(end)) % tarfile.RECORDSIZE)
    with open(path, "wb") as fh:
        fh.write(gzip.compress(head.getvalue()))
        for _ in range(gib * 2):
            fh.write(chunk)
        fh.write(gzip.compress(end))
    return path


def test_a_shard_past_its_time_limit_fails_under_the_local_executor_too(make_shards, tmp_path: Path) -> None:
    """``--shard-timeout`` did nothing with ``--executor local`` (the default of the README's
    job and of small runs): a .tar.gz that expands a thousandfold held the job for as long as
    it took. Now the shard fails once its limit has passed, named with the limit, and the job
    goes on with the others."""
    good = make_shards(n_shards=2, per_shard=4)
    first = _rows_of_tar(good[0])
    bomb = _zero_bomb(tmp_path / "shards" / "part-00002.tar.gz", first["jpg"], first["txt"], gib=24)
    out = tmp_path / "out"
    assert _score([str(g) for g in good] + [str(bomb)], out, "--shard-timeout", "4", "--max-failed-fraction", "0.5") == 4
    failed = OutputDir(str(out)).quarantined()
    assert list(failed) == ["part-00002"]
    assert "took longer than its 4 s limit (--shard-timeout)" in failed["part-00002"]["error"]
    assert [r["stem"] for r in _manifest(out)] == ["part-00000", "part-00001"]


def _rows_of_tar(path: Path) -> dict[str, Any]:
    """The first sample's jpg bytes and caption of a plain tar shard."""
    import tarfile

    with tarfile.open(path) as tar:
        members = {m.name.rsplit(".", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()[:4] if m.isfile()}  # type: ignore[union-attr]
    return {"jpg": members["jpg"], "txt": members["txt"].decode()}


def test_a_truncated_sidecar_or_table_is_scored_again_not_a_failed_job(make_shards, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A sidecar cut short (a full disk, a failed copy) made a resume withdraw the shard,
    delete its intact table, then refuse the damaged sidecar as "not written by pairclean":
    the finished job failed at every rerun. A truncated table did the same and stayed in OUT,
    breaking every reader. Both are pairclean's own files, damaged: they are replaced."""
    shards = make_shards(n_shards=2, per_shard=6)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    before = _rows(out, "part-00001")
    sidecar = schema.local_side_path(out, "_emb/part-00001.parquet")
    sidecar.write_bytes(sidecar.read_bytes()[: sidecar.stat().st_size // 2])
    table = out / "part-00000.parquet"
    table.write_bytes(table.read_bytes()[:100])
    assert main(["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"]) == 1  # said as it is
    assert "part-00000.parquet is not a readable Parquet table (cut short?)" in capsys.readouterr().err
    assert _score([str(s) for s in shards], out) == 0
    assert "scoring it again" in caplog.text
    assert _rows(out, "part-00001") == before and pq.read_table(sidecar).num_rows == 6
    assert pq.read_table(out).num_rows == 12  # every reader reads OUT again
    mine = out / "part-00000.parquet"  # a readable file that pairclean did not write stays untouched
    pq.write_table(pq.read_table(mine).replace_schema_metadata(None), mine)
    theirs = mine.read_bytes()
    assert _score([str(s) for s in shards], out) == 3
    assert mine.read_bytes() == theirs


def test_tables_changed_by_hand_are_named_and_a_resume_scores_them_again(
        make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Round 6: the records hold each table's rows, size and sha256, and nothing compared them.
    A table copied over another's made ``export`` count one shard twice and skip the other; rows
    deleted by hand were exported short and crashed ``rescore``; a deleted table left a job that
    a resume called finished and every reader then failed on."""
    import shutil

    shards = make_shards(n_shards=3, per_shard=6)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    tables = {stem: (out / f"{stem}.parquet").read_bytes() for stem in ("part-00000", "part-00001", "part-00002")}
    table = pq.read_table(out / "part-00002.parquet")
    pq.write_table(table.slice(0, 4), out / "part-00002.parquet")  # its pairclean metadata kept
    capsys.readouterr()
    assert main(["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"]) == 1
    assert "part-00002.parquet changed since pairclean wrote it" in capsys.readouterr().err
    shutil.copy(out / "part-00000.parquet", out / "part-00001.parquet")
    assert main(["export", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "part-00001.parquet: its rows belong to shard" in err
    # ... also for a reader of a few columns (pseudo-pair reads key, status, noisy; the public
    # read_scores any): it took the copied table's rows as this shard's
    from pairclean.errors import InputError
    from pairclean.output.folder import OutputDir

    folder = OutputDir(str(out))
    with pytest.raises(InputError, match="its rows belong to shard"):
        folder.read_scores(folder.committed()["part-00001"], [schema.COL_KEY, schema.COL_STATUS, schema.COL_NOISY])
    assert folder.read_scores(folder.committed()["part-00000"], [schema.COL_KEY]).column_names == [schema.COL_KEY]
    (out / "part-00001.parquet").unlink()
    assert _score([str(s) for s in shards], out) == 0
    assert "the table of shard" in caplog.text and "scoring it again" in caplog.text
    # a table that is a link to the same bytes (cp -rs, DVC caches) is not "gone"
    real = tmp_path / "cache.parquet"
    (out / "part-00000.parquet").rename(real)
    (out / "part-00000.parquet").symlink_to(real)
    caplog.clear()
    assert _score([str(s) for s in shards], out) == 0
    assert "scoring it again" not in caplog.text and (out / "part-00000.parquet").is_symlink()
    for stem, data in tables.items():
        assert (out / f"{stem}.parquet").read_bytes() == data  # scored again, byte for byte
    assert main(["export", str(out)]) == 0


def test_overwrite_keeps_a_file_a_user_put_in_a_tables_place(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--overwrite`` deleted whatever lay at a path the records list: a user's own file put
    in a table's place went with the job's files. It is kept, and named."""
    import pyarrow as pa

    shards = make_shards(n_shards=2, per_shard=6)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    mine = out / "part-00000.parquet"
    pq.write_table(pa.table({"key": ["my", "own"], "note": ["kept", "please"]}), mine)
    data = mine.read_bytes()
    before = {p: p.read_bytes() for p in (*out.iterdir(), *Path(f"{out}{schema.SIDE_SUFFIX}").rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert _score([str(s) for s in shards], out, "--overwrite") == 1
    assert mine.read_bytes() == data
    err = capsys.readouterr().err
    assert "part-00000.parquet exists and was not written by pairclean; it is left untouched" in err
    # checked before anything went: the rest of the job is as it was (it was deleted, then the run failed)
    assert "--overwrite deleted nothing" in err
    after = {p: p.read_bytes() for p in (*out.iterdir(), *Path(f"{out}{schema.SIDE_SUFFIX}").rglob("*")) if p.is_file()}
    assert {p: b for p, b in after.items() if p.name != "lock.json"} == {p: b for p, b in before.items() if p.name != "lock.json"}
    # a file under pairclean's metadata key that holds no JSON object is not pairclean's either
    # (each check of the name raised a JSON traceback)
    for garbage, flags, code in ((b"{not json", ("--overwrite",), 1), (b"[1, 2]", ("--overwrite",), 1),
                                 (b"{not json", (), 3)):  # --overwrite refuses; a rerun fails that shard alone
        pq.write_table(pa.table({"key": ["my"]}).replace_schema_metadata({schema.META_KEY: garbage}), mine)
        assert _score([str(s) for s in shards], out, *flags) == code
        err = capsys.readouterr().err
        assert "part-00000.parquet exists and was not written by pairclean" in err and "Traceback" not in err
        assert pq.read_schema(mine).metadata[schema.META_KEY] == garbage


def test_review_of_round_6_duplicate_keys_json_surrogates_and_sidecars(dev_images: list, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The read checks refused a shard's own duplicate_key rows when ``columns`` left out
    ``status``; a json url holding a lone surrogate (valid JSON) still killed the job; a
    sidecar deleted by hand was not scored again on resume."""
    from pairclean.lite.evaldata import write_shard

    def sample(key: str, i: int) -> dict:
        return {"__key__": key, "jpg": dev_images[i].path.read_bytes(), "txt": dev_images[i].captions[0],
                "json": '{"url": "http://x/\\udcff", "uid": "u\\udcfe"}'}

    shard = write_shard(tmp_path / "s0.tar", [sample("a", 0), sample("b", 1), sample("a", 2), sample("c", 3)])
    out = tmp_path / "out"
    assert _score([str(shard)], out) == 0
    rows = pairclean.read_scores(str(out)).to_pylist()
    assert [r["status"] for r in rows].count(schema.STATUS_DUPLICATE_KEY) == 1
    assert (rows[0]["url"], rows[0]["uid"]) == ("http://x/\\xff", "u\\xfe")  # written, the stray bytes escaped
    assert pairclean.read_scores(str(out), columns=["key", "weight"]).num_rows == 4
    # export counts a repeated key as WeightStage weighs it: neither copy kept (round 7)
    capsys.readouterr()
    assert main(["export", str(out)]) == 0
    ok_once = [r for r in rows if r["key"] != "a" and r["status"] == "ok" and not r["noisy"]]
    assert f"kept pairs (ok, not noisy): {len(ok_once)} of 4" in capsys.readouterr().out
    sums = json.loads(schema.local_side_path(out, f"{schema.EXPORT_DIR}/shard_weights.json").read_text())
    assert sums["s0.tar"] == pytest.approx(sum(r["weight"] for r in rows if r["key"] != "a"), abs=1e-5)
    sidecar = next((tmp_path / f"out{schema.SIDE_SUFFIX}").rglob("emb/*.parquet"))
    data = sidecar.read_bytes()
    sidecar.unlink()
    assert _score([str(shard)], out) == 0
    assert "the sidecar of shard" in caplog.text and sidecar.read_bytes() == data


def test_a_bug_in_a_service_job_keeps_its_traceback_out_of_the_tenants_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A job process's bug printed its traceback, which ``/jobs/{id}/logs`` showed the tenant
    with the server's source paths. In a job the service starts, it goes to the operator's
    folder and the log gets one line; run by hand, the traceback is printed as before."""
    from pairclean_workers.cli import BUG_REPORT_DIR_ENV

    def extend(sub: object) -> None:
        sub.add_parser("boom")  # type: ignore[attr-defined]

    def boom(_: object) -> int:
        raise RuntimeError("a bug at /srv/secret/path.py")

    with pytest.raises(RuntimeError):
        main(["boom"], extend, {"boom": boom})
    monkeypatch.setenv(BUG_REPORT_DIR_ENV, str(tmp_path / "bugs"))
    capsys.readouterr()
    assert main(["boom"], extend, {"boom": boom}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (a bug, not the input): RuntimeError" in err and "/srv/secret" not in err
    (kept,) = (tmp_path / "bugs").iterdir()
    assert "a bug at /srv/secret/path.py" in kept.read_text() and kept.name in err


def test_export_of_a_partial_job_names_the_shards_in_none_of_its_files(make_shards, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Round 7: export of a job with a failed shard said nothing, and open_clip then failed on
    its sizes.json with a bare KeyError for that shard."""
    good = make_shards(n_shards=2, per_shard=4)
    junk = good[0].parent / "junk.tar"
    junk.write_bytes(b"not a tar" * 100)
    out = tmp_path / "out"
    assert _score([str(g) for g in good] + [str(junk)], out, "--max-failed-fraction", "0.5") == 4
    mine = schema.local_side_path(out, f"{schema.EXPORT_DIR}/sizes.json")
    mine.parent.mkdir(parents=True)
    mine.write_text('{"my": "own"}')  # a user's file where export writes: never replaced (round 7)
    capsys.readouterr()
    assert main(["export", str(out)]) == 1
    assert "sizes.json exists and pairclean did not write it" in capsys.readouterr().err and mine.read_text() == '{"my": "own"}'
    mine.unlink()
    assert main(["export", str(out)]) == 0
    said = capsys.readouterr().out
    assert "note: 1 of the job's 3 shards are in none of these files (1 failed scoring" in said and "junk.tar" in said
    assert main(["export", str(out)]) == 0  # its own files it replaces


@pytest.mark.ray
@pytest.mark.slow
def test_under_ray_the_calibrations_shards_are_held_to_the_time_limit_too(make_shards, tmp_path: Path) -> None:
    """Round 7: Ray's driver times shards out by killing their task, and the calibration reads
    its shards in one task, so a huge first shard was read whole and calibrated on under Ray
    (SUCCEEDED) where the local executor set it aside (PARTIAL): different weights."""
    good = make_shards(n_shards=2, per_shard=4)
    first = _rows_of_tar(good[0])
    bomb = _zero_bomb(tmp_path / "shards" / "a-bomb.tar.gz", first["jpg"], first["txt"], gib=24)
    out = tmp_path / "out"
    ray = [a for a in TINY if a not in ("--executor", "local")] + ["--executor", "ray", "--num-actors", "1"]
    code = main(["score", str(bomb), *map(str, good), "--out", str(out), *ray, "--shard-timeout", "4", "--max-failed-fraction", "0.5"])
    assert code == 4
    failed = OutputDir(str(out)).quarantined()
    assert list(failed) == ["a-bomb"] and "took longer than its 4 s limit" in failed["a-bomb"]["error"]


def test_a_rewrite_refuses_a_table_another_tool_wrote_before_rewriting_anything(make_shards, tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Round 7: a table rewritten by the user's own tool (same rows, no pairclean metadata)
    crashed ``rescore`` halfway with a traceback, its rewrite left marked: every verb then
    refused the folder."""
    shards = make_shards(n_shards=3, per_shard=4)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    first = (out / "part-00000.parquet").read_bytes()
    table = pq.read_table(out / "part-00001.parquet")
    pq.write_table(table.replace_schema_metadata(None), out / "part-00001.parquet")
    capsys.readouterr()
    assert main(["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "part-00001.parquet has no pairclean metadata" in err
    assert (out / "part-00000.parquet").read_bytes() == first  # nothing rewritten
    # no rewrite left marked (every verb refused the folder): export names the table, not a rewrite
    assert main(["export", str(out)]) == 1 and not schema.local_side_path(out, schema.REWRITE_FILE).exists()
    err = capsys.readouterr().err
    assert "part-00001.parquet changed since pairclean wrote it" in err and "not exported" in err and "rewriting" not in err
    # A column added with pyarrow (which keeps pairclean's metadata): the rewrite built the
    # table from its own columns and the user's column was gone, without a word.
    pq.write_table(table.append_column("my_label", pa.array(["x"] * table.num_rows)), out / "part-00001.parquet")
    for verb in (["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"], ["refine", str(out), "--method", "ncr"]):
        assert main(verb) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "part-00001.parquet changed since pairclean wrote it" in err, err
    assert "my_label" in pq.read_table(out / "part-00001.parquet").column_names
    assert (out / "part-00000.parquet").read_bytes() == first


def test_damaged_state_files_are_one_line(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Round 7: a damaged calibration or completion-record file gave tracebacks of 34-44 lines."""
    import shutil

    shards = make_shards(n_shards=2, per_shard=4)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    side = Path(f"{out}{schema.SIDE_SUFFIX}")
    shutil.copytree(side, tmp_path / "kept")
    calibration = schema.local_side_path(out, schema.CALIBRATION_FILE)
    calibration.write_text('{"beta": 0.1, "trunc')
    capsys.readouterr()
    assert _score([str(s) for s in shards], out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "calibration.json is damaged" in err
    shutil.rmtree(side)
    shutil.copytree(tmp_path / "kept", side)
    segment = next(schema.local_side_path(out, schema.MANIFEST_DIR).glob("*.parquet"))
    segment.write_bytes(segment.read_bytes()[:40])
    for verb in (["inspect", str(out)], ["export", str(out)]):
        assert main(verb) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "(completion records) is damaged" in err


def test_an_object_stores_refusal_names_what_was_worked_on(capsys: pytest.CaptureFixture[str]) -> None:
    """Round 7: wrong credentials for an S3 output printed only "error: Forbidden"."""
    def extend(sub: Any) -> None:
        sub.add_parser("put").add_argument("--out")

    def put(_: object) -> int:
        raise PermissionError(13, "Forbidden")

    assert main(["put", "--out", "s3://bucket/out"], extend, {"put": put}) == 1
    assert capsys.readouterr().err == "error: Forbidden (working on s3://bucket/out); check the credentials and permissions\n"


@pytest.mark.parametrize("argv, says", [
    (["pseudo-pair", "OUT", "--min-weight", "nan"], "--min-weight: expected a finite number"),
    (["pseudo-pair", "OUT", "--neighbours", "0"], "--neighbours: expected a whole number of at least 1"),
    (["pseudo-pair", "OUT", "--nprobe", "-1"], "--nprobe: expected a whole number of at least 1"),
    (["rescore", "OUT", "--beta-recipe", "gmm", "--weighting", "paper", "--beta-k", "0"], "--beta-k: expected a whole number"),
    (["rescore", "OUT", "--beta-recipe", "gmm", "--weighting", "paper", "--device", "bogus"], "--device: expected auto, cpu"),
    (["score", "x.tar", "--out", "OUT", "--beta-k", "100000000"], "--beta-k: expected a whole number of at most 4,096"),
    (["score", "x.tar", "--out", "OUT", "--caption-field", ""], "--caption-field: expected a json field name or .ext"),
])
def test_options_out_of_range_are_usage_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Round 3 of the verbs attack: these were taken (a pseudo-pair run of NaN weight that wrote
    nothing over a good one, --neighbours 0 as the default, --beta-k 0 ignored and 10^8 written
    into the spec, --device bogus ignored) or ended in FAISS's or torch's traceback."""
    with pytest.raises(SystemExit) as usage:
        main(argv)
    err = capsys.readouterr().err
    assert usage.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_shard_name_with_terminal_escapes_is_printed_escaped(make_shards, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The FAILED line, inspect's failed shards and export's note printed a shard's name raw:
    an escape sequence in it reached the terminal (row keys were already escaped)."""
    good = make_shards(n_shards=1, per_shard=4)[0]
    bad = tmp_path / "x\x1b[2Jy.tar"
    bad.write_bytes(b"not a tar" * 100)
    out = tmp_path / "out"
    assert _score([str(good), str(bad)], out) != 0
    failed = capsys.readouterr().err
    assert "FAILED" in failed and "\x1b" not in failed and "\\x1b[2Jy" in failed
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "failed (a rerun retries them)" in printed


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of http://127.0.0.1:PORT/metrics, parsed by prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_batch_job_serves_the_service_metric_families_while_it_runs(make_shards, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--metrics-port``: the driver of a CLI job serves what the service's runner counts, by
    the same names (one dashboard for both), plus the job's progress; a taken port is one line."""
    import re
    import socket

    from pairclean_service.metrics import exported_names

    shards = [str(s) for s in make_shards(n_shards=3, per_shard=6)]
    broken = Path(shards[2]).read_bytes()
    Path(shards[2]).write_bytes(broken[: len(broken) // 3])  # cut short: quarantined
    from pairclean_workers.cli import EXIT_PARTIAL

    assert _score(shards, tmp_path / "out", "--metrics-port", "0", "--metrics-host", "127.0.0.1",
                  "--max-failed-fraction", "0.5") == EXIT_PARTIAL
    port = int(re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", capsys.readouterr().err).group(1))
    got = _scrape(port)  # the exporter's thread lives as long as the process: this test's

    def value(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert value("pairclean_batch_shards", state="total") == 3
    assert value("pairclean_batch_shards", state="committed") == 2
    assert value("pairclean_batch_shards", state="quarantined") == 1
    assert value("pairclean_shards_total", state="committed") == 2 and value("pairclean_shards_total", state="quarantined") == 1
    assert value("pairclean_pairs_scored_total", status="ok") == 12
    assert value("pairclean_pair_weight_count") == 12 and value("pairclean_stage_seconds_count", stage="embed") == 2
    assert value("pairclean_shard_attempts_failed_total") >= 1
    # the job families are the service's, by name: the dashboard and the alert rules read both
    job_families = {n for n, _ in got if n.startswith("pairclean_") and not n.startswith("pairclean_batch_")}
    assert job_families <= exported_names()
    # a port already taken: one line, nothing scored
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        assert _score(shards[:1], tmp_path / "o2", "--metrics-port", busy, "--metrics-host", "127.0.0.1") == 1
    err = capsys.readouterr().err
    assert f"--metrics-port {busy}: cannot listen on 127.0.0.1" in err and "Traceback" not in err
    assert not (tmp_path / "o2").exists()


def test_inspect_names_tables_another_tool_rewrote(make_shards, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A table re-saved in place by pandas (which drops pairclean's metadata key) ended
    ``inspect`` in a KeyError traceback. With another table whole, the summary reads that
    one's record; with none, one line saying what happened."""
    import pandas as pd

    shards = make_shards(n_shards=2, per_shard=6)
    out = tmp_path / "out"
    assert _score([str(s) for s in shards], out) == 0
    pd.read_parquet(out / "part-00000.parquet").to_parquet(out / "part-00000.parquet", index=False)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.startswith("shards: 2/2 committed, pairs: 12")
    pd.read_parquet(out / "part-00001.parquet").to_parquet(out / "part-00001.parquet", index=False)
    assert main(["inspect", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no table of ") and "carries pairclean's metadata" in err and err.count("\n") == 1
