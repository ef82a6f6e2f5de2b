"""``pairclean.job.work``: one worker's calibration phase, scoring and writing, with the tiny
real model on real shards cut from the bundled demo sample."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from numpy.typing import NDArray

from pairclean import osa, schema
from pairclean.calibrate.calibration import Calibration
from pairclean.embed.estimators import Estimator
from pairclean.errors import ForeignOutputError, InputError, ShardReadError
from pairclean.job.runner import score_options
from pairclean.job.work import ShardWork, calibrate_on
from pairclean.output.folder import OutputDir
from pairclean.spec import JobSpec, spec_digest
from pairclean.storage import sha256_file

NOT_AN_IMAGE = {"jpg": b"not an image"}


def _work(estimator: Estimator, spec: JobSpec, out: Path) -> ShardWork:
    return ShardWork(estimator, spec, OutputDir(str(out)), score_options(spec))


def _sidecar(path: Path) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """The ok rows' (image, text) embeddings of a sidecar, as stored (float16 -> float32)."""
    from pairclean.output.tables import read_embeddings

    return read_embeddings(pq.read_table(path))


def _meta(path: Path) -> dict[str, Any]:
    return json.loads(pq.read_schema(path).metadata[schema.META_KEY])


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_calibration_phase_uses_the_first_ok_pairs_in_shard_order_and_writes_those_shards(
    tiny_estimator: Estimator, make_spec, write_shards, tmp_path: Path
) -> None:
    shards = write_shards([3, 3, 3, 3], bad={1: NOT_AN_IMAGE})  # shard 0: 2 ok pairs
    spec = make_spec(shards, beta_recipe="shuffled", weighting="paper", calibration_pairs=5, embeddings=True)
    work = _work(tiny_estimator, spec, tmp_path / "out")
    phase = work.calibrate(shards)
    # 2 ok pairs after shard 0, 5 after shard 1: the phase stops there
    assert [o.uri for o in phase.outcomes] == shards[:2] and all(o.error is None for o in phase.outcomes)
    cal = phase.calibration
    assert cal is not None and (cal.recipe, cal.calibration_pairs, cal.k) == ("shuffled", 5, 8)
    first, second = (o.record for o in phase.outcomes)
    assert first is not None and second is not None
    assert first.statuses == {schema.STATUS_DECODE_ERROR: 1, schema.STATUS_OK: 2} and second.statuses == {schema.STATUS_OK: 3}
    # beta is exactly the shuffled recipe on the first 5 ok pairs as the sidecars store them
    # (float16), so that a rescore from the sidecars reproduces it
    parts = [_sidecar(schema.local_side_path(tmp_path / "out", r.emb_output)) for r in (first, second) if r.emb_output]
    img = np.concatenate([p[0] for p in parts])[:5]
    txt = np.concatenate([p[1] for p in parts])[:5]
    assert len(img) == 5
    assert cal.beta == osa.beta_shuffled(img, txt, spec.beta_k * spec.beta_k, spec.seed)
    # the shards of the phase are written with the calibration; later ones are not touched
    for record in (first, second):
        path = tmp_path / "out" / record.output
        assert record.sha256 == sha256_file(path) and record.bytes == path.stat().st_size
        assert _meta(path)["beta"]["value"] == cal.beta
    assert _files(tmp_path / "out") == sorted([first.output, second.output])  # OUT: the score tables only
    assert _files(tmp_path / "out.pairclean" / "emb") == sorted(Path(str(r.emb_output)).name for r in (first, second))


def test_calibration_phase_reports_unreadable_shards_and_calibrates_on_the_rest(
    tiny_estimator: Estimator, make_spec, write_shards, corrupt, tmp_path: Path
) -> None:
    shards = write_shards([2, 2])
    corrupt(shards[0])
    work = _work(tiny_estimator, make_spec(shards, beta_recipe="gmm", weighting="paper"), tmp_path / "out")
    phase = work.calibrate(shards)
    assert [(o.uri, o.record is None, o.attempts) for o in phase.outcomes] == [(shards[0], True, 1), (shards[1], False, 1)]
    assert "unreadable tar" in str(phase.outcomes[0].error)
    assert phase.calibration is not None and phase.calibration.calibration_pairs == 2
    # and when every shard is unreadable there is nothing to calibrate on
    corrupt(shards[1])
    empty = _work(tiny_estimator, make_spec(shards, beta_recipe="gmm", weighting="paper"), tmp_path / "out2").calibrate(shards)
    assert empty.calibration is None and [o.uri for o in empty.outcomes] == shards
    assert all(o.record is None and o.error for o in empty.outcomes)
    assert _files(tmp_path / "out2") == []


def test_a_recipe_needing_no_corpus_scores_nothing_and_caches_its_beta(
    tiny_estimator: Estimator, make_spec, write_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    shards = write_shards([2])
    spec = make_spec(shards, beta_recipe="random-inputs", weighting="reference-batch", beta_k=4, seed=3)
    work = _work(tiny_estimator, spec, tmp_path / "out")
    phase = work.calibrate(shards)
    assert phase.outcomes == [] and _files(tmp_path / "out") == []
    cal = phase.calibration
    assert cal is not None and (cal.calibration_pairs, cal.weighting_batch_size) == (0, spec.batch_size)
    img, txt = tiny_estimator.random_input_embeddings(4, 3)
    assert cal.beta == pytest.approx(osa.beta_from_cross(img, txt), abs=1e-6)
    (entry,) = (tmp_path / "cache" / "beta").glob("*.json")
    identity = json.loads(entry.read_text())["identity"]
    assert (identity["model_id"], identity["k"], identity["seed"], identity["precision"]) == ("pairclean-tiny-test", 4, 3, "fp32")
    # the second time beta is read from the cache, not recomputed
    entry.write_text(json.dumps({"beta": 0.777, "identity": identity}))
    assert work.random_beta() == 0.777
    # another seed is another identity
    _work(tiny_estimator, make_spec(shards, beta_k=4, seed=4), tmp_path / "out").random_beta()
    assert len(list((tmp_path / "cache" / "beta").glob("*.json"))) == 2


def test_score_writes_a_table_weighted_with_the_frozen_calibration(
    tiny_estimator: Estimator, make_spec, write_shards, tmp_path: Path
) -> None:
    (shard,) = write_shards([5], bad={1: NOT_AN_IMAGE, 3: {"txt": b"   "}})
    spec = make_spec([shard], weighting="paper")
    frozen = Calibration(beta=0.02, recipe="random-inputs", k=8, seed=0, weighting="paper")
    record = _work(tiny_estimator, spec, tmp_path / "out").score(shard, frozen)
    path = tmp_path / "out" / "part-00000.parquet"
    assert (record.shard, record.stem, record.output, record.rows) == (shard, "part-00000", "part-00000.parquet", 5)
    assert record.statuses == {schema.STATUS_DECODE_ERROR: 1, schema.STATUS_EMPTY_TEXT: 1, schema.STATUS_OK: 3}
    assert record.sha256 == sha256_file(path) and record.bytes == path.stat().st_size
    assert record.size == os.path.getsize(shard)
    assert record.emb_output is None and _files(tmp_path / "out") == ["part-00000.parquet"]
    assert "write" in record.timings
    table = pq.read_table(path).to_pydict()
    assert table[schema.COL_KEY] == [f"p{i:04d}" for i in range(5)]
    ok = np.array(table[schema.COL_STATUS]) == schema.STATUS_OK
    sims = np.array(table[schema.COL_SIMILARITY], dtype=np.float32)
    weight = np.array(table[schema.COL_WEIGHT], dtype=np.float32)
    assert np.array_equal(weight[ok], osa.weight_paper(sims[ok], 0.02))
    assert (weight[~ok] == 0).all() and all(np.array(table[schema.COL_NOISY])[~ok])
    assert np.array_equal(np.array(table[schema.COL_NOISY])[ok], sims[ok] <= 0.02)
    meta = _meta(path)
    assert meta["job"] == spec_digest(spec) and meta["shard"] == shard
    assert meta["beta"]["value"] == 0.02 and meta["weighting"]["name"] == "paper"
    assert meta["model"]["model_id"] == "pairclean-tiny-test"
    # equal inputs, equal bytes
    again = _work(tiny_estimator, spec, tmp_path / "out2").score(shard, frozen)
    assert again.sha256 == record.sha256


def test_scoring_an_unreadable_shard_raises_and_writes_nothing(
    tiny_estimator: Estimator, make_spec, write_shards, corrupt, tmp_path: Path
) -> None:
    (shard,) = write_shards([3])
    corrupt(shard)
    frozen = Calibration(beta=0.0, recipe="random-inputs", k=8, seed=0, weighting="paper")
    with pytest.raises(ShardReadError, match="unreadable tar"):
        _work(tiny_estimator, make_spec([shard]), tmp_path / "out").score(shard, frozen)
    assert _files(tmp_path / "out") == []


def test_writing_never_replaces_a_file_pairclean_did_not_write(
    tiny_estimator: Estimator, make_spec, write_shards, tmp_path: Path
) -> None:
    (shard,) = write_shards([2])
    spec = make_spec([shard], embeddings=True)
    frozen = Calibration(beta=0.0, recipe="random-inputs", k=8, seed=0, weighting="paper")
    out = tmp_path / "out"
    out.mkdir()
    users = out / "part-00000.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), users)  # a user's Parquet file with the output's name
    before = users.read_bytes()
    work = _work(tiny_estimator, spec, out)
    with pytest.raises(ForeignOutputError, match="not written by pairclean"):
        work.score(shard, frozen)
    assert users.read_bytes() == before
    # a leftover pairclean wrote (a crashed attempt) is replaced
    users.unlink()
    work.score(shard, frozen)
    leftover = users.read_bytes()
    record = work.score(shard, Calibration(beta=0.5, recipe="random-inputs", k=8, seed=0, weighting="paper"))
    assert users.read_bytes() != leftover and _meta(users)["beta"]["value"] == 0.5
    assert record.emb_output == f"{schema.EMB_DIR}/part-00000.parquet"


def test_a_recipe_that_cannot_calibrate_on_the_job_is_an_input_error(make_spec) -> None:
    spec = make_spec(["/x/part-00000.tar"], beta_recipe="shuffled")
    with pytest.raises(InputError, match="the shuffled recipe needs the embeddings of at least 2 ok pairs"):
        calibrate_on([], spec, lambda: 0.0, 32)


def test_fit_calibration_returns_the_contrast_the_calibration_recorded(make_spec) -> None:
    """On a junk-heavy sample ``calibrate`` refits with ``random_fit`` set: the contrast that
    ``fit_calibration`` returns (the calibrating worker adjusts its tables with it and caches
    it) must be the recorded one, as every other worker and ``pairclean rescore`` read it."""
    from pairclean.calibrate import contrast as cm
    from pairclean.embed.shard import ShardResult
    from pairclean.job.work import as_recorded, fit_calibration

    rng = np.random.default_rng(0)
    n, dim = 800, 40

    def unit(x: NDArray[np.float64]) -> NDArray[np.float32]:
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    # photos in pairs of look-alikes, captions near their own photo (test_contrast's corpus), then
    # half the photos replaced by placeholders near no caption
    base = rng.normal(size=(n // 2, 32))
    photos = unit(np.repeat(base, 2, axis=0) + 0.5 * rng.normal(size=(n, 32)))
    captions = unit(photos + 1.5 * rng.normal(size=(n, 32)) / np.sqrt(32))
    img, txt = np.hstack([photos, np.zeros((n, 8), np.float32)]), np.hstack([captions, np.zeros((n, 8), np.float32)])
    junk = np.random.default_rng(6)
    img[:400] = unit(np.hstack([0.1 * junk.normal(size=(400, 32)), junk.normal(size=(400, 8))]))
    img, txt = img.astype(np.float16).astype(np.float32), txt.astype(np.float16).astype(np.float32)
    result = ShardResult(uri="s.tar", keys=[f"{i:05d}" for i in range(n)], idx=np.arange(n), status=["ok"] * n,
                         error=[None] * n, similarity=(img * txt).sum(1), image_emb=img, text_emb=txt, uid=None, url=None)
    spec = make_spec(["s.tar"], beta_recipe="gmm", weighting="p-clean", embeddings=True, contrast=True, calibration_pairs=n)
    calibration, contrast = fit_calibration([result], spec, lambda: 0.0, dim)
    doc = calibration.extra["contrast"]
    assert contrast is not None and "random_fit" in doc and contrast.random_fit == doc["random_fit"]
    assert contrast.to_json() == doc
    np.testing.assert_array_equal(contrast.adjust(result.similarity, img, txt),
                                  cm.from_json(doc, contrast.bank).adjust(result.similarity, img, txt))
    assert as_recorded(calibration, None) is None
