"""The cascade in `pairclean score --judge off|band|all`: columns, p_clean, metadata, resume,
on the tiny real estimator with a tiny random judge (real shards, real Parquet)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pairclean import schema
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--executor", "local", "--calibration-pairs", "12"]


def _score(shards: list[Path], out: Path, *extra: str) -> int:
    return main(["score", *map(str, shards), "--out", str(out), *TINY, *extra])


def _table(out: Path, stem: str):
    return pq.read_table(out / f"{stem}.parquet")


def _meta(out: Path, stem: str) -> dict:
    return json.loads(pq.read_schema(out / f"{stem}.parquet").metadata[schema.META_KEY])


@pytest.fixture
def judge_file(tmp_path: Path, tiny_judge) -> Path:
    return tiny_judge(tmp_path / "tiny-judge.safetensors")


def test_judge_all_scores_every_pair_and_records_itself(make_shards, tmp_path: Path, judge_file: Path) -> None:
    shards = make_shards(n_shards=2, per_shard=8)
    out = tmp_path / "out"
    assert _score(shards, out, "--judge", "all", "--judge-checkpoint", str(judge_file)) == 0
    for stem in ("part-00000", "part-00001"):
        rows = _table(out, stem).to_pylist()
        meta = _meta(out, stem)["judge"]
        # the metadata states the rule the noisy column follows
        assert _meta(out, stem)["noisy_rule"].startswith("p_clean <= 0.5 where judged")
        assert meta["mode"] == "all" and meta["band"] == ["-inf", "inf"] and meta["id"] == judge_file.name
        assert len(meta["sha256"]) == 64 and 0.02 <= meta["prior_clean"] <= 0.98 and meta["pairs"] == 12
        logit_prior = math.log(meta["prior_clean"] / (1 - meta["prior_clean"]))
        for r in rows:
            assert r["status"] == "ok" and math.isfinite(r[schema.COL_JUDGE_SCORE])
            # the judge's p_clean: its ratio under the corpus prior; weight = p_clean; noisy = p_clean <= 0.5
            expected = 1 / (1 + math.exp(-(r[schema.COL_JUDGE_SCORE] + logit_prior)))
            assert r["p_clean"] == pytest.approx(expected, abs=1e-5)
            assert r["weight"] == r["p_clean"] and r["noisy"] == (r["p_clean"] <= 0.5)
            assert -1 <= r["similarity"] <= 1
    # a judge without a near-miss map replaces OSA's p_clean: rescoring keeps its ratios and answers
    before = _table(out, "part-00000").to_pylist()
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "p-clean"]) == 0
    after = _table(out, "part-00000").to_pylist()
    assert [r[schema.COL_JUDGE_SCORE] for r in after] == [r[schema.COL_JUDGE_SCORE] for r in before]
    assert [r["p_clean"] for r in after] == [r["p_clean"] for r in before]
    assert _meta(out, "part-00000")["beta"]["recipe"] == "shuffled" and _meta(out, "part-00000")["judge"]["mode"] == "all"
    job = json.loads(schema.local_side_path(out, schema.JOB_FILE).read_text())["spec"]
    assert job["judge"] == "all" and job["judge_sha256"] == meta["sha256"] and job["judge_checkpoint"] == str(judge_file)


def test_a_judge_with_a_word_grounding_scores_through_it_and_records_it(make_shards, tmp_path: Path, tiny_judge) -> None:
    """The grounding moves the judge's scores, the metadata names it, and resume with it works."""
    shards = make_shards(n_shards=1, per_shard=8)
    plain, grounded = tiny_judge(tmp_path / "plain.safetensors"), tiny_judge(tmp_path / "grounded.safetensors", words=2.0)
    assert _score(shards, tmp_path / "a", "--judge", "all", "--judge-checkpoint", str(plain)) == 0
    assert _score(shards, tmp_path / "b", "--judge", "all", "--judge-checkpoint", str(grounded)) == 0
    a, b = _table(tmp_path / "a", "part-00000").to_pylist(), _table(tmp_path / "b", "part-00000").to_pylist()
    assert all(r["status"] == "ok" for r in a + b)
    assert max(abs(x[schema.COL_JUDGE_SCORE] - y[schema.COL_JUDGE_SCORE]) for x, y in zip(a, b)) > 1e-3
    meta = _meta(tmp_path / "b", "part-00000")["judge"]
    assert meta["words"]["weight"] == 2.0 and meta["words"]["config"]["layers"] == 1 and "words" not in _meta(tmp_path / "a", "part-00000")["judge"]
    # resuming with the same grounded judge finds the shard done: its table is not written again
    table = tmp_path / "b" / "part-00000.parquet"
    written = (table.stat().st_ino, table.stat().st_mtime_ns)
    assert _score(shards, tmp_path / "b", "--judge", "all", "--judge-checkpoint", str(grounded)) == 0
    assert (table.stat().st_ino, table.stat().st_mtime_ns) == written


def test_a_near_miss_judge_is_combined_with_osa_and_rescored_alike(make_shards, tmp_path: Path, tiny_judge,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from pairclean.judge import posterior
    from pairclean.judge.posterior import fine_llr, p_clean_of

    monkeypatch.setattr(posterior, "MIN_FINE_PAIRS", 8)  # a 12-pair calibration sizes the near-misses here
    monkeypatch.setattr(posterior, "MIN_FINE_PRIOR", 0.0)  # and a random judge's prior is trusted
    # with dev pass rates: the near-miss prior is an adjusted count (posterior.adjusted_count)
    judge = tiny_judge(tmp_path / "fine-judge.safetensors", platt_fine=(2.0, 0.5), fine_rates=(0.9, 0.2))
    shards = make_shards(n_shards=2, per_shard=8)
    off, judged = tmp_path / "off", tmp_path / "judged"
    assert _score(shards, off, "--judge", "off") == 0
    assert _score(shards, judged, "--judge", "all", "--judge-checkpoint", str(judge)) == 0
    for stem in ("part-00000", "part-00001"):
        meta = _meta(judged, stem)["judge"]
        assert meta["platt_fine"] == [2.0, 0.5] and meta["fine_rates"] == [0.9, 0.2] and 0.02 <= meta["fine_prior"] <= 0.995
        for a, b in zip(_table(off, stem).to_pylist(), _table(judged, stem).to_pylist()):
            # clean = OSA's p_clean (the same one pass, the same calibration) times the judge's
            # posterior that no word is wrong
            q = p_clean_of(fine_llr(np.array([b[schema.COL_JUDGE_SCORE]]), (1.0, 0.0), (2.0, 0.5)), meta["fine_prior"])[0]
            assert b["p_clean"] == pytest.approx(a["p_clean"] * q, abs=1e-5) and b["p_clean"] <= a["p_clean"] + 1e-6
            assert b["weight"] == b["p_clean"] and b["noisy"] == (b["p_clean"] <= 0.5)
    from pairclean.output.folder import OutputDir
    from pairclean.output.report import format_summary, summarize

    text = format_summary(summarize(OutputDir(str(judged))))
    assert "p_clean = OSA's x its word check (corpus share with every word right: " in text
    osa_rule = _meta(off, "part-00000")["noisy_rule"]  # the job without the judge: OSA's rule
    assert osa_rule.endswith("similarity <= beta") and f"flagged noisy ({osa_rule})" in format_summary(summarize(OutputDir(str(off))))
    assert f"flagged noisy (p_clean <= 0.5 where judged (judge_score not NaN), else {osa_rule})" in text
    # rescoring to other options gives what a fresh judged score with those options writes
    fresh = tmp_path / "fresh"
    assert _score(shards, fresh, "--judge", "all", "--judge-checkpoint", str(judge), "--beta-recipe", "shuffled") == 0
    assert main(["rescore", str(judged), "--beta-recipe", "shuffled", "--weighting", "p-clean"]) == 0
    for stem in ("part-00000", "part-00001"):
        a, b = _table(fresh, stem).to_pylist(), _table(judged, stem).to_pylist()
        for col in ("p_clean", "weight", schema.COL_JUDGE_SCORE):
            np.testing.assert_allclose([r[col] for r in a], [r[col] for r in b], atol=1e-6)
        assert _meta(fresh, stem)["judge"]["fine_prior"] == pytest.approx(_meta(judged, stem)["judge"]["fine_prior"], abs=1e-9)


def test_rescore_under_a_band_refits_the_word_check_on_every_calibration_pair(
        make_shards, tmp_path: Path, tiny_judge, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --judge band the tables hold the judge's ratios inside the band only; the folder
    keeps every calibration pair's ratio with its similarity, so a rescore fits the word
    check's prior on what a fresh score fitted it on (it used to refit on the in-band ratios
    alone), and only where the file is of the same pairs."""
    from pairclean.errors import InputError
    from pairclean.judge import posterior
    from pairclean.output.folder import OutputDir

    monkeypatch.setattr(posterior, "MIN_FINE_PAIRS", 4)
    monkeypatch.setattr(posterior, "MIN_FINE_PRIOR", 0.0)
    # a near-miss map that puts this random judge's ratios on both sides of 0
    judge = tiny_judge(tmp_path / "fine-judge.safetensors", platt_fine=(1.0, 1.0), fine_rates=(0.99, 0.01))
    shards = make_shards(n_shards=2, per_shard=8)
    flags = ["--judge", "band", "--judge-budget", "0.5", "--judge-checkpoint", str(judge)]
    band, fresh = tmp_path / "band", tmp_path / "fresh"
    assert _score(shards, band, *flags) == 0
    stems = ("part-00000", "part-00001")
    folder = OutputDir(str(band))
    stored = folder.read_judge_ratios()
    # the calibration sample: the first 12 ok pairs (TINY's --calibration-pairs)
    tables = [_table(band, stem) for stem in stems]
    in_tables = np.concatenate([t[schema.COL_JUDGE_SCORE].to_numpy() for t in tables])[:12]
    sims = np.concatenate([t["similarity"].to_numpy() for t in tables])[:12]
    assert stored is not None and stored.shape == (2, 12) and np.isfinite(stored).all()
    np.testing.assert_array_equal(stored[0], sims)  # which pairs the ratios are of
    judged = np.isfinite(in_tables)
    assert 0 < judged.sum() < 12  # outside the band, no ratio in the table
    np.testing.assert_allclose(stored[1][judged], in_tables[judged], atol=1e-6)
    assert _score(shards, fresh, *flags, "--beta-recipe", "shuffled") == 0

    def rescored_prior() -> float:
        assert main(["rescore", str(band), "--beta-recipe", "shuffled", "--weighting", "p-clean"]) == 0
        return float(_meta(band, "part-00000")["judge"]["fine_prior"])

    fresh_prior = float(_meta(fresh, "part-00000")["judge"]["fine_prior"])
    assert rescored_prior() == pytest.approx(fresh_prior, abs=1e-9)
    for stem in stems:
        np.testing.assert_allclose(_table(band, stem)["p_clean"].to_numpy(), _table(fresh, stem)["p_clean"].to_numpy(), atol=1e-6)
    # the prior is refitted on the kept ratios, all of them: ratios made higher raise it
    folder.write_judge_ratios(stored[0], stored[1] + 3.0)
    raised = rescored_prior()
    assert raised > fresh_prior + 0.05
    # ... but only where they are of the same pairs: other similarities (a shard re-scored
    # since) and the tables' ratios are used instead
    folder.write_judge_ratios(stored[0] + 0.01, stored[1] + 3.0)
    assert rescored_prior() < raised - 0.05
    # a folder scored before the ratios were kept rescores from its tables' (in-band) ratios
    schema.local_side_path(band, schema.JUDGE_RATIOS_FILE).unlink()
    assert rescored_prior() < raised - 0.05
    # a damaged or empty file is one line naming it
    for data in (b"not an array", b""):
        schema.local_side_path(band, schema.JUDGE_RATIOS_FILE).write_bytes(data)
        with pytest.raises(InputError, match="judge-calibration-ratios.npy is damaged"):
            folder.read_judge_ratios()


def test_a_judge_with_a_near_miss_mixture_doubts_pairs_that_look_like_unseen_word_edits(
        make_shards, tmp_path: Path, tiny_judge, monkeypatch: pytest.MonkeyPatch) -> None:
    from pairclean.judge import posterior
    from pairclean.judge.posterior import FineMixture, fine_llr, mixture_p_clean

    monkeypatch.setattr(posterior, "MIN_FINE_PAIRS", 8)
    monkeypatch.setattr(posterior, "MIN_FINE_PRIOR", 0.0)
    shards = make_shards(n_shards=2, per_shard=8)
    counted = tmp_path / "counted"
    plain = tiny_judge(tmp_path / "plain.safetensors", platt_fine=(2.0, 0.5), fine_rates=(0.9, 0.2))
    assert _score(shards, tmp_path / "off", "--judge", "off") == 0
    assert _score(shards, counted, "--judge", "all", "--judge-checkpoint", str(plain)) == 0
    rows = [r for stem in ("part-00000", "part-00001") for r in _table(counted, stem).to_pylist()]
    fine = fine_llr(np.array([r[schema.COL_JUDGE_SCORE] for r in rows]), (1.0, 0.0), (2.0, 0.5))
    # the same judge, told on "dev" that edits with words it never saw score like this corpus,
    # and clean pairs well above it
    mixture = FineMixture.of({"clean": np.r_[fine, fine] + 10, "edits": np.r_[fine, fine] - 10, "other": np.r_[fine, fine]}, "extra", 2.0)
    doubting = tiny_judge(tmp_path / "mixed.safetensors", platt_fine=(2.0, 0.5), fine_rates=(0.9, 0.2), fine_mixture=mixture.to_doc())
    mixed = tmp_path / "mixed"
    assert _score(shards, mixed, "--judge", "all", "--judge-checkpoint", str(doubting)) == 0
    for stem in ("part-00000", "part-00001"):
        meta = _meta(mixed, stem)["judge"]
        assert meta["fine_mixture"] == mixture.to_doc() and "fine_mixture_fit" not in _meta(counted, stem)["judge"]
        fit = meta["fine_mixture_fit"]
        assert fit["used"] and fit["gain"] > 2.0 and fit["shares"][2] > 0.5
        for a, b, c in zip(_table(tmp_path / "off", stem).to_pylist(), _table(mixed, stem).to_pylist(), _table(counted, stem).to_pylist()):
            q = mixture_p_clean(fine_llr(np.array([b[schema.COL_JUDGE_SCORE]]), (1.0, 0.0), (2.0, 0.5)), mixture,
                                tuple(fit["shares"]))[0]
            assert b["p_clean"] == pytest.approx(a["p_clean"] * q, abs=1e-5) and b["noisy"] == (b["p_clean"] <= 0.5)
            assert b[schema.COL_JUDGE_SCORE] == pytest.approx(c[schema.COL_JUDGE_SCORE], abs=1e-6)
    mean = {name: np.mean([r["p_clean"] for stem in ("part-00000", "part-00001") for r in _table(out, stem).to_pylist()])
            for name, out in (("counted", counted), ("mixed", mixed))}
    assert mean["mixed"] < mean["counted"]  # the corpus looks like unseen-word edits: less sure it is clean
    from pairclean.output.folder import OutputDir
    from pairclean.output.report import format_summary, summarize

    assert "its word check under the near-miss mixture (every word right " in format_summary(summarize(OutputDir(str(mixed))))
    assert "under the near-miss mixture" not in format_summary(summarize(OutputDir(str(counted))))
    # rescoring refits the mixture's shares as a fresh score does
    before = [r["p_clean"] for r in _table(mixed, "part-00000").to_pylist()]
    assert main(["rescore", str(mixed), "--beta-recipe", "random-inputs", "--weighting", "p-clean"]) == 0
    np.testing.assert_allclose([r["p_clean"] for r in _table(mixed, "part-00000").to_pylist()], before, atol=1e-6)
    assert _meta(mixed, "part-00000")["judge"]["fine_mixture_fit"]["used"]


def test_a_near_miss_judge_stays_off_where_its_prior_cannot_be_trusted(make_shards, tmp_path: Path, tiny_judge,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pairclean.judge import posterior

    judge = tiny_judge(tmp_path / "fine-judge.safetensors", platt_fine=(2.0, -3.0))  # says "a word is wrong" everywhere
    shards = make_shards(n_shards=1, per_shard=12)
    off = tmp_path / "off"
    assert _score(shards, off, "--judge", "off") == 0
    for name, patch, reason in (("few", {}, "fewer than 100"), ("prior", {"MIN_FINE_PAIRS": 8}, "near-miss prior")):
        for attr, value in patch.items():
            monkeypatch.setattr(posterior, attr, value)
        out = tmp_path / name
        assert _score(shards, out, "--judge", "all", "--judge-checkpoint", str(judge)) == 0
        meta = _meta(out, "part-00000")["judge"]
        assert meta["fine_prior"] is None and reason in meta["fine_off"]
        assert _meta(out, "part-00000")["noisy_rule"] == _meta(off, "part-00000")["noisy_rule"]  # OSA's rule stays
        from pairclean.output.folder import OutputDir
        from pairclean.output.report import format_summary, summarize

        assert "word check left out of p_clean: " + meta["fine_off"] in format_summary(summarize(OutputDir(str(out))))
        for a, b in zip(_table(off, "part-00000").to_pylist(), _table(out, "part-00000").to_pylist()):
            # the judge's score is written, OSA's outputs stay
            assert math.isfinite(b[schema.COL_JUDGE_SCORE])
            assert (b["p_clean"], b["weight"], b["noisy"]) == (a["p_clean"], a["weight"], a["noisy"])


def test_band_judges_its_window_and_keeps_osa_outside(make_shards, tmp_path: Path, judge_file: Path) -> None:
    shards = make_shards(n_shards=2, per_shard=8)
    off, band = tmp_path / "off", tmp_path / "band"
    assert _score(shards, off, "--judge", "off") == 0
    assert _score(shards, band, "--judge", "band", "--judge-budget", "0.5", "--judge-checkpoint", str(judge_file)) == 0
    assert schema.COL_JUDGE_SCORE not in _table(off, "part-00000").column_names
    assert "judge" not in _meta(off, "part-00000") and "judge" not in json.loads(schema.local_side_path(off, schema.JOB_FILE).read_text())["spec"]
    judged_total = 0
    for stem in ("part-00000", "part-00001"):
        a, b = _table(off, stem).to_pylist(), _table(band, stem).to_pylist()
        meta = _meta(band, stem)["judge"]
        lo, hi = (float(x) for x in meta["band"])
        assert meta["mode"] == "band" and meta["budget"] == 0.5
        for ra, rb in zip(a, b):
            assert rb["similarity"] == ra["similarity"]  # the same one pass of the towers
            inside = lo <= rb["similarity"] <= hi
            assert math.isfinite(rb[schema.COL_JUDGE_SCORE]) == inside
            if not inside:  # outside the band: exactly OSA's outputs
                assert (rb["p_clean"], rb["weight"], rb["noisy"]) == (ra["p_clean"], ra["weight"], ra["noisy"])
            judged_total += inside
    # the band holds half of the 12 calibration pairs; over both shards, some but not all are judged
    assert 0 < judged_total < 16


def test_resume_with_the_judge_on_and_a_changed_judge_is_refused(make_shards, tmp_path: Path, judge_file: Path, tiny_judge,
                                                               crash_mid_job, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards(n_shards=6, per_shard=6)
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    flags = ["--judge", "band", "--judge-budget", "0.5", "--judge-checkpoint", str(judge_file)]
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", str(shards[0].parent / "part-{00000..00005}.tar"),
           "--out", str(out), *TINY[:-2], "--calibration-pairs", "8", *flags]
    crash_mid_job(cmd, out, commits=2)  # killed in the scoring phase, after the judge's band was frozen
    done = len(list(out.glob("part-*.parquet")))
    assert 2 <= done < 6
    result = subprocess.run(cmd, capture_output=True, timeout=300, text=True)
    assert result.returncode == 0, result.stderr
    assert "already done" in result.stdout
    # the resumed job wrote exactly what an uninterrupted one writes
    assert subprocess.run([*cmd[:cmd.index("--out") + 1], str(fresh), *cmd[cmd.index("--out") + 2:]], capture_output=True, timeout=300).returncode == 0
    for i in range(6):
        assert (out / f"part-{i:05d}.parquet").read_bytes() == (fresh / f"part-{i:05d}.parquet").read_bytes()
    assert json.loads(schema.local_side_path(out, schema.CALIBRATION_FILE).read_text())["extra"]["judge"]["band"] == \
        json.loads(schema.local_side_path(fresh, schema.CALIBRATION_FILE).read_text())["extra"]["judge"]["band"]
    # another judge setting into the same folder is another job: refused
    capsys.readouterr()
    for changed in (["--judge", "off"], ["--judge", "all", "--judge-checkpoint", str(judge_file)],
                    ["--judge", "band", "--judge-budget", "0.25", "--judge-checkpoint", str(judge_file)]):
        assert _score(shards, out, *changed, "--calibration-pairs", "8") == 1
        assert "different spec" in capsys.readouterr().err
    # the same path with other weights: refused too (the spec records the judge's sha256)
    tiny_judge(judge_file, seed=1)
    assert _score(shards, out, *flags, "--calibration-pairs", "8") == 1
    assert "different spec" in capsys.readouterr().err


def test_bad_judge_flags_are_clear_errors(make_shards, tmp_path: Path, judge_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards(n_shards=1, per_shard=4)
    with pytest.raises(SystemExit) as usage:  # not a fraction: a usage error
        _score(shards, tmp_path / "a", "--judge", "band", "--judge-budget", "1.5", "--judge-checkpoint", str(judge_file))
    assert usage.value.code == 2 and "argument --judge-budget: expected a fraction" in capsys.readouterr().err
    assert _score(shards, tmp_path / "a", "--judge", "band", "--judge-budget", "0", "--judge-checkpoint", str(judge_file)) == 1
    assert "--judge-budget must be in (0, 1]" in capsys.readouterr().err
    assert _score(shards, tmp_path / "b", "--judge", "all", "--judge-checkpoint", str(tmp_path / "nope.safetensors")) == 1
    assert "judge weights not found" in capsys.readouterr().err
    # the shipped judge reads pairclean-lite's towers: auto turns it off for another model
    assert _score(shards, tmp_path / "c") == 0
    assert "judge" not in json.loads(schema.local_side_path(tmp_path / "c", schema.JOB_FILE).read_text())["spec"]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_workers_run_the_cascade(make_shards, tmp_path: Path, judge_file: Path) -> None:
    shards = make_shards(n_shards=2, per_shard=8)
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    flags = ["--judge", "band", "--judge-budget", "0.5", "--judge-checkpoint", str(judge_file)]
    assert _score(shards, local, *flags) == 0
    tiny_ray = [a for a in TINY if a not in ("--executor", "local")]
    assert main(["score", *map(str, shards), "--out", str(ray_out), *tiny_ray, "--executor", "ray", "--num-actors", "1", *flags]) == 0
    for stem in ("part-00000", "part-00001"):
        a, b = _table(local, stem), _table(ray_out, stem)
        np.testing.assert_allclose(a[schema.COL_JUDGE_SCORE].to_numpy(), b[schema.COL_JUDGE_SCORE].to_numpy(), atol=1e-4)
        np.testing.assert_allclose(a["p_clean"].to_numpy(), b["p_clean"].to_numpy(), atol=1e-4)
        assert _meta(ray_out, stem)["judge"]["sha256"] == _meta(local, stem)["judge"]["sha256"]


def test_auto_keeps_a_resumed_folders_judge_setting(make_shards, tmp_path: Path, judge_file: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    shards = make_shards(n_shards=1, per_shard=6)
    spec = lambda out: json.loads(schema.local_side_path(out, schema.JOB_FILE).read_text())["spec"]  # noqa: E731
    # a new folder: auto with a judge for this estimator judges every pair
    new = tmp_path / "new"
    assert _score(shards, new, "--judge-checkpoint", str(judge_file)) == 0
    assert spec(new)["judge"] == "all"
    # folders started with another setting resume as they began instead of being refused
    for name, flags, mode in (("off", ["--judge", "off"], None), ("band", ["--judge", "band", "--judge-budget", "0.5"], "band")):
        out = tmp_path / name
        assert _score(shards, out, *flags, "--judge-checkpoint", str(judge_file)) == 0
        capsys.readouterr()
        assert _score(shards, out, "--judge-checkpoint", str(judge_file)) == 0
        assert "different spec" not in capsys.readouterr().err
        assert spec(out).get("judge") == mode


def test_refine_keeps_what_score_calibrated_the_contrast_and_the_word_check(make_shards, tmp_path: Path, tiny_judge,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21, item 5 (refine never hurts): refining a judged job with the corpus contrast
    keeps its ``adjusted_similarity`` and ``judge_score``; an ensemble that chose OSA gives the
    scored ``p_clean`` exactly; another method's raw score is mapped onto OSA's ``p_clean`` by
    quantiles and multiplied by the judge's word check, as ``score`` does."""
    from pairclean.calibrate.contrast import owner_p_clean
    from pairclean.job.work import judged_p_clean, osa_p_clean
    from pairclean.judge import posterior
    from pairclean.output.folder import OutputDir
    from pairclean.refine import ensemble

    monkeypatch.setattr(posterior, "MIN_FINE_PAIRS", 8)
    monkeypatch.setattr(posterior, "MIN_FINE_PRIOR", 0.0)
    judge = tiny_judge(tmp_path / "fine-judge.safetensors", platt_fine=(2.0, 0.5), fine_rates=(0.9, 0.2))
    shards = make_shards(n_shards=2, per_shard=12)
    out = tmp_path / "judged"
    assert _score(shards, out, "--judge", "all", "--judge-checkpoint", str(judge), "--calibration-pairs", "24") == 0
    scored = {stem: _table(out, stem).to_pylist() for stem in ("part-00000", "part-00001")}
    assert _meta(out, "part-00000")["contrast"] is not None and schema.COL_ADJUSTED in scored["part-00000"][0]
    fast = ["--set", "warmup_epochs=1", "--set", "epochs=1", "--executor", "local"]

    monkeypatch.setattr(ensemble, "MIN_GAIN", 1e9)  # the ensemble keeps OSA alone
    assert main(["refine", str(out), *fast]) == 0
    for stem, before in scored.items():
        after = _table(out, stem).to_pylist()
        assert _meta(out, stem)["refine"]["p_clean_map"] == {"kind": "osa"}
        for a, b in zip(before, after):
            assert b[schema.COL_ADJUSTED] == a[schema.COL_ADJUSTED] and b[schema.COL_JUDGE_SCORE] == a[schema.COL_JUDGE_SCORE]
            assert b["p_clean"] == pytest.approx(a["p_clean"], abs=1e-6) and b["weight"] == b["p_clean"]
            assert math.isfinite(b["ensemble_score"])

    from pairclean.output.report import format_summary, summarize

    assert "refined: ensemble (raw score in ensemble_score, members used: osa (learned share 0)); p_clean: the scored p_clean" \
        in format_summary(summarize(OutputDir(str(out))))
    assert main(["refine", str(out), "--method", "ncr", *fast]) == 0
    calibration = OutputDir(str(out)).read_calibration()
    assert calibration is not None
    mapped, osa_sample = [], []
    for stem, before in scored.items():
        rows = _table(out, stem).to_pylist()
        doc = _meta(out, stem)["refine"]
        assert doc["method"] == "ncr" and doc["p_clean_map"]["kind"] == "quantile"
        knots_raw, knots_p = np.array(doc["p_clean_map"]["raw"]), np.array(doc["p_clean_map"]["p"])
        assert (np.diff(knots_raw) >= 0).all() and (np.diff(knots_p) >= 0).all()
        raw = np.array([r["ncr_score"] for r in rows], np.float32)
        base = np.interp(raw, knots_raw, knots_p).astype(np.float32)
        llr = np.array([r[schema.COL_JUDGE_SCORE] for r in rows], np.float32)
        expected = judged_p_clean(llr, base, calibration.extra["judge"])
        # the contrast's owners (version 3) lower p_clean after the judge, as in the scored table
        margin = np.array([r[schema.COL_OWNER_MARGIN] for r in rows], np.float32)
        expected = owner_p_clean(expected, margin, calibration.extra["contrast"]["owner_odds"])
        np.testing.assert_allclose([r["p_clean"] for r in rows], expected, atol=1e-6)
        assert [r[schema.COL_ADJUSTED] for r in rows] == [r[schema.COL_ADJUSTED] for r in before]
        mapped += list(base)
        osa_sample += list(osa_p_clean(np.array([r[schema.COL_ADJUSTED] for r in before], np.float32), calibration))
    # the map keeps OSA's p_clean distribution (every ok pair is in the sample here): the same
    # share of sure and unsure pairs, only the order is the method's
    np.testing.assert_allclose(np.sort(mapped), np.sort(osa_sample), atol=0.05)
    # a refined judged job can still be rescored (its tables keep the judge's ratios): back to the score's p_clean
    spec = json.loads(schema.local_side_path(out, schema.JOB_FILE).read_text())["spec"]
    assert main(["rescore", str(out), "--beta-recipe", spec["beta_recipe"], "--weighting", "p-clean"]) == 0
    for stem, before in scored.items():
        np.testing.assert_allclose([r["p_clean"] for r in _table(out, stem).to_pylist()], [r["p_clean"] for r in before], atol=1e-6)


@pytest.mark.parametrize("option, value, message", [("--train-edits", "9", "--train-edits must be 1-5, got 9"),
                                                     ("--train-captions", "0", "--train-captions must be 1-5, got 0"),
                                                     ("--members", "0", "--members must be 1-8, got 0"),
                                                     ("--word-epochs", "0", "--word-epochs must be 1-100, got 0"),
                                                     ("--words", "keep", "--words keep needs --judge-from FILE (the grounding to keep)"),
                                                     ("--edits-per-positive", "2",
                                                      "--edits-per-positive must be 1-1 (--train-edits), got 2")])
def test_train_judge_refuses_out_of_range_options_in_one_line_before_any_work(tmp_path: Path, option: str, value: str, message: str,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train-judge", "--out", str(tmp_path / "j.safetensors"), option, value]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: {message}" and not (tmp_path / "j.safetensors").exists()


def test_train_judge_from_a_file_that_is_not_a_judge_is_one_line_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "not-a-judge.safetensors").write_bytes(b"nope")
    assert main(["train-judge", "--out", str(tmp_path / "j.safetensors"), "--judge-from", str(tmp_path / "not-a-judge.safetensors")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is not a pairclean judge file" in err and "\n" not in err
    assert not (tmp_path / "j.safetensors").exists()


def test_the_notebook_api_and_ray_data_apply_a_job_s_judge_as_its_workers_do(make_shards, tmp_path: Path, judge_file: Path,
                                                                            tiny_judge) -> None:
    import pairclean
    from pairclean.errors import InputError
    from pairclean.ray_data import ScorePairs
    from pairclean.read.shards import iter_raw_samples

    shards = make_shards(n_shards=1, per_shard=16)
    out = tmp_path / "judged"
    assert _score(shards, out, "--judge", "all", "--judge-checkpoint", str(judge_file)) == 0
    job = _table(out, "part-00000").to_pydict()
    samples = list(iter_raw_samples(str(shards[0])))
    images, captions = [s.files["jpg"] for s in samples], [s.files["txt"].decode() for s in samples]
    est = pairclean.load_estimator("pairclean-tiny-test")
    scored = pairclean.score_pairs(images, captions, estimator=est, calibration=out, judge_checkpoint=str(judge_file))
    assert scored.judge_score is not None
    assert scored.judge_score.tolist() == pytest.approx(job[schema.COL_JUDGE_SCORE], abs=1e-5)
    # the judge replaces OSA's p_clean here (a judge without a near-miss map): the job's weights, not OSA's
    assert scored.weight.tolist() == pytest.approx(job["weight"], abs=1e-5)
    assert scored.p_clean.tolist() == pytest.approx(job["p_clean"], abs=1e-5)
    assert list(scored.to_pandas().columns[:5]) == ["similarity", "weight", "noisy", "p_clean", "judge_score"]
    # Ray Data's callable (plain Python here) gives the same column, batch by batch
    actor = ScorePairs(str(out), model="pairclean-tiny-test", image_column="jpg", caption_column="txt", judge_checkpoint=str(judge_file))
    half = actor({"jpg": np.array(images[:5], dtype=object), "txt": np.array([c.encode() for c in captions[:5]], dtype=object)})
    assert half["judge_score"].tolist() == pytest.approx(job[schema.COL_JUDGE_SCORE][:5], abs=1e-5)
    assert half["weight"].tolist() == pytest.approx(job["weight"][:5], abs=1e-5)
    # another judge file (or the shipped one) is not the job's: refused, naming what to pass
    with pytest.raises(InputError, match="pass judge_checkpoint= the job's judge file"):
        pairclean.score_pairs(images, captions, estimator=est, calibration=out,
                              judge_checkpoint=str(tiny_judge(tmp_path / "other.safetensors", seed=1)))
    # a job without a judge gives no judge_score
    plain = tmp_path / "plain"
    assert _score(shards, plain) == 0
    assert pairclean.score_pairs(images, captions, estimator=est, calibration=plain).judge_score is None


def test_the_notebook_api_reads_captions_as_a_shard_does() -> None:
    import io

    from PIL import Image

    import pairclean

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    captions = ["   \u200b", "\u200b\u200b", "   ", "a red square"]
    scored = pairclean.score_pairs([buf.getvalue()] * 4, captions, estimator="pairclean-tiny-test", allow_small_calibration=True)
    assert scored.status == ["empty_text", "empty_text", "empty_text", "ok"]
