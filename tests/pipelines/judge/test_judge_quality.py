"""The shipped judge on real Flickr8k dev photos (slow: loads pairclean-lite)."""

from __future__ import annotations

import numpy as np
import pytest

from pairclean.judge.edits import edit_caption
from pairclean.judge.metrics import roc_auc
from pairclean.judge.runner import JudgeRunner, load_judge

pytestmark = [pytest.mark.flickr, pytest.mark.slow]


def test_shipped_judge_separates_swaps_and_prefers_own_captions_to_their_edits(dev_images) -> None:
    import torch
    from PIL import Image

    from pairclean.embed.estimators import EstimatorSpec, load_estimator

    estimator = load_estimator(EstimatorSpec(model="pairclean-lite"))  # engine auto: the ONNX parts path where installed
    runner = JudgeRunner(load_judge(), estimator)
    photos = dev_images[:96]
    rng = np.random.default_rng(0)
    own = [p.captions[0] for p in photos]
    swapped = [own[(i + 1 + int(rng.integers(len(own) - 1))) % len(own)] for i in range(len(own))]
    edited = [edit_caption(c, "object", rng) or edit_caption(c, "count", rng) for c in own]
    with_edit = [i for i, e in enumerate(edited) if e is not None]
    pixels = []
    for p in photos:
        with Image.open(p.path) as im:
            pixels.append(estimator.preprocess(im.convert("RGB")))
    x = torch.stack(pixels)
    clean = runner.encode_batch(x, own).llr
    noisy = runner.encode_batch(x, swapped).llr
    edit = runner.encode_batch(x[with_edit], [edited[i] for i in with_edit]).llr
    assert np.isfinite(clean).all() and np.isfinite(noisy).all() and np.isfinite(edit).all()
    labels = np.r_[np.ones(len(clean), bool), np.zeros(len(noisy), bool)]
    # alone it separates random swaps less well than the cosine (dev AUC 0.93 against 0.97; here
    # 0.87 on 96 photos): the cascade leaves those to OSA and multiplies in the judge's word check
    assert roc_auc(np.r_[clean, noisy], labels) > 0.8
    # one word changed: the own caption scores higher for most photos (here 0.87; the BCE-only
    # judge before the ranking loss: about 0.7)
    assert len(with_edit) > 60 and np.mean(clean[with_edit] > edit) > 0.8


def test_the_default_score_judges_and_catches_one_word_edits(dev_images, tmp_path) -> None:
    """`pairclean score` with no judge flag on Flickr8k dev pairs, a third of them one-word
    edits: the judge runs (auto = all for pairclean-lite), its factor is on, and edited pairs
    rank below clean ones (hard-noise benchmark at 1,000 pairs: AUC 0.81-0.83, OSA alone 0.60)."""
    import json

    import pyarrow.parquet as pq

    from pairclean import schema
    from pairclean.lite.evaldata import write_pair_shards
    from pairclean_workers.cli import main

    rng = np.random.default_rng(3)
    pairs, edited = [], set()
    for i, photo in enumerate(dev_images[:240]):
        caption = photo.captions[0]
        if i % 3 == 0:
            changed = next((e for k in ("object", "count", "action", "attribute") if (e := edit_caption(caption, k, rng))), None)
            if changed is not None:
                caption = changed
                edited.add(f"p{i:04d}")
        pairs.append((f"p{i:04d}", photo.path, caption))
    shards = write_pair_shards(tmp_path / "shards", pairs, 120, "edits")
    out = tmp_path / "out"
    assert main(["score", *shards, "--out", str(out), "--executor", "local", "--no-progress"]) == 0
    spec = json.loads(schema.local_side_path(out, schema.JOB_FILE).read_text())["spec"]
    meta = json.loads(pq.read_schema(out / "edits-00000.parquet").metadata[schema.META_KEY])["judge"]
    assert spec["judge"] == "all" and meta["fine_prior"] is not None and "fine_off" not in meta
    rows = [r for stem in ("edits-00000", "edits-00001") for r in pq.read_table(out / f"{stem}.parquet").to_pylist()]
    p = np.array([r["p_clean"] for r in rows])
    noisy = np.array([r["key"] in edited for r in rows])
    sims = np.array([r["similarity"] for r in rows])
    assert len(edited) > 60
    assert roc_auc(p, ~noisy) > 0.7 and roc_auc(p, ~noisy) > roc_auc(sims, ~noisy) + 0.1
