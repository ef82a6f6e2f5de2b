"""The notebook API: score in-memory pairs with an estimator loaded once; read a job's scores."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import pairclean
from pairclean.read.shards import iter_raw_samples

SAMPLE = Path(pairclean.__file__).parent / "data" / "sample" / "demo-000000.tar"


def _demo_pairs() -> tuple[list[bytes], list[str], list[bool]]:
    images, captions, swapped = [], [], []
    for s in iter_raw_samples(str(SAMPLE)):
        images.append(s.files["jpg"] if "jpg" in s.files else s.files["png"])
        captions.append(s.files["txt"].decode())
        swapped.append(bool(json.loads(s.files["json"]).get("swapped")))
    return images, captions, swapped


@pytest.mark.slow
def test_score_pairs_flags_the_swapped_captions_of_the_demo_like_a_job(tmp_path: Path) -> None:
    from PIL import Image

    images, captions, swapped = _demo_pairs()
    est = pairclean.load_estimator("pairclean-lite", device="cpu")
    # paths, bytes and PIL images are all accepted; a broken image and an empty caption become statuses
    (tmp_path / "first.jpg").write_bytes(images[0])
    mixed: list[object] = [str(tmp_path / "first.jpg"), *images[1:]]
    mixed[1] = Image.open(io.BytesIO(images[1]))
    result = pairclean.score_pairs(mixed + [b"broken", images[0]], captions + ["a caption", "  "], estimator=est,
                                   allow_small_calibration=True)  # 10 ok pairs: fewer than a batch needs to calibrate itself
    n = len(captions)
    assert result.status[:n] == ["ok"] * n and result.status[n:] == ["decode_error", "empty_text"]
    assert result.weight[n:].tolist() == [0, 0] and result.noisy[n:].all()
    assert set(np.flatnonzero(result.noisy[:n])) == {i for i, s in enumerate(swapped) if s}
    assert ((result.p_clean >= 0) & (result.p_clean <= 1)).all()
    assert result.calibration.recipe in ("gmm", "random-inputs")
    # the same estimator object is reused; the demo job scores the same pairs the same way
    assert main_demo_similarities(tmp_path) == pytest.approx(result.similarity[:n].tolist(), abs=1e-4)
    assert list(result.to_pandas().columns) == ["similarity", "weight", "noisy", "p_clean", "status", "error"]


def main_demo_similarities(tmp_path: Path) -> list[float]:
    from pairclean_workers.cli import main

    assert main(["score", str(SAMPLE), "--out", str(tmp_path / "job"), "--executor", "local", "--no-progress", "--device", "cpu"]) == 0
    return pairclean.read_scores(tmp_path / "job", columns=["similarity"]).column("similarity").to_pylist()


def test_score_pairs_refuses_unequal_lengths() -> None:
    from pairclean.errors import InputError

    with pytest.raises(InputError, match="pair up one to one"):
        pairclean.score_pairs([b"x"], ["a", "b"], estimator="pairclean-tiny-test")


def test_a_batch_too_small_to_calibrate_itself_is_refused_unless_asked() -> None:
    from pairclean.errors import InputError

    images, captions, _ = _demo_pairs()
    with pytest.raises(InputError, match="too few to calibrate themselves.*calibration="):
        pairclean.score_pairs(images[:5], captions[:5], estimator="pairclean-tiny-test")
    small = pairclean.score_pairs(images[:5], captions[:5], estimator="pairclean-tiny-test", allow_small_calibration=True)
    assert set(small.weight.tolist()) <= {0.0, 1.0}  # what "too small" means: a hard 0/1


def test_a_frozen_calibration_gives_each_pair_the_jobs_weight_whatever_the_batch(tmp_path: Path) -> None:
    from PIL import Image

    from pairclean.api import load_calibration, save_calibration
    from pairclean.errors import InputError
    from pairclean_workers.cli import main

    out = tmp_path / "job"
    assert main(["score", str(SAMPLE), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    job = pairclean.read_scores(out, columns=["similarity", "weight", "p_clean"]).to_pydict()
    images, captions, _ = _demo_pairs()
    est = pairclean.load_estimator("pairclean-tiny-test")
    whole = pairclean.score_pairs(images, captions, estimator=est, calibration=out)
    assert whole.similarity.tolist() == pytest.approx(job["similarity"], abs=1e-6)
    assert whole.weight.tolist() == pytest.approx(job["weight"], abs=1e-6)
    assert whole.p_clean.tolist() == pytest.approx(job["p_clean"], abs=1e-6)
    # batches of 1 and 3, decoded arrays (as Ray Data gives them), a saved calibration file
    arrays = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in images]
    save_calibration(whole.calibration, tmp_path / "cal.json", model=est.info.model_id)
    for size in (1, 3):
        parts = [pairclean.score_pairs(arrays[i : i + size], captions[i : i + size], estimator=est, calibration=tmp_path / "cal.json")
                 for i in range(0, len(arrays), size)]
        assert np.concatenate([p.weight for p in parts]).tolist() == pytest.approx(whole.weight.tolist(), abs=0.02)
        assert np.concatenate([p.similarity for p in parts]).tolist() == pytest.approx(whole.similarity.tolist(), abs=0.02)
    with pytest.raises(InputError, match="made with model 'pairclean-tiny-test', not 'other'"):
        load_calibration(out, model="other")
    with pytest.raises(InputError, match="holds no calibration"):
        load_calibration(tmp_path / "nothing-here")


def test_a_frozen_calibration_with_the_corpus_contrast_brings_its_bank(make_shards, tmp_path: Path) -> None:
    from pairclean.api import load_calibration, save_calibration
    from pairclean.errors import InputError
    from pairclean_workers.cli import main

    shard = make_shards(n_shards=1, per_shard=20)[0]
    out = tmp_path / "job"
    assert main(["score", str(shard), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    job = pairclean.read_scores(out, columns=["weight", "p_clean", "adjusted_similarity"]).to_pydict()
    samples = list(iter_raw_samples(str(shard)))
    images, captions = [s.files["jpg"] for s in samples], [s.files["txt"].decode() for s in samples]
    est = pairclean.load_estimator("pairclean-tiny-test")
    cal = load_calibration(out)
    assert cal.bank is not None and "bank" not in cal.to_json()
    scored = pairclean.score_pairs(images, captions, estimator=est, calibration=out)
    assert scored.weight.tolist() == pytest.approx(job["weight"], abs=1e-6)
    assert scored.p_clean.tolist() == pytest.approx(job["p_clean"], abs=1e-6)
    # a saved file holds no bank: refused with what to pass instead
    save_calibration(cal, tmp_path / "cal.json", model=est.info.model_id)
    with pytest.raises(InputError, match="pass calibration=<that folder>"):
        pairclean.score_pairs(images, captions, estimator=est, calibration=tmp_path / "cal.json")
