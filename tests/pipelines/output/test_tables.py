"""The embedding sidecar's rows without embeddings: zero vectors, readable by every pyarrow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.output.tables import embeddings_table, read_embeddings


def _unit(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_rows_that_are_not_ok_are_zero_vectors_not_nulls_and_read_back_as_absent(tmp_path: Path) -> None:
    img, txt = _unit(5, 8, 0), _unit(5, 8, 1)
    ok = np.array([True, False, True, False, True])
    table = embeddings_table(list("abcde"), img, txt, ok, {})
    # nulls in a fixed-size list: pyarrow 18-24 refuses to write them, pyarrow 25 to read them back
    assert table.column("image_emb").null_count == 0 and table.column("text_emb").null_count == 0
    pq.write_table(table, tmp_path / "emb.parquet")
    got_img, got_txt = read_embeddings(pq.read_table(tmp_path / "emb.parquet"))
    assert got_img.shape == (3, 8) and np.allclose(got_img, img[ok], atol=1e-3) and np.allclose(got_txt, txt[ok], atol=1e-3)


def test_sidecars_of_earlier_releases_with_null_rows_still_read() -> None:
    img, txt = _unit(3, 4, 2), _unit(3, 4, 3)
    mask = pa.array([False, True, False])

    def column(x: np.ndarray) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float16).ravel(), type=pa.float16()), 4, mask=mask)

    old = pa.table({"key": ["a", "b", "c"], "image_emb": column(img), "text_emb": column(txt)})
    got_img, got_txt = read_embeddings(old)
    assert got_img.shape == (2, 4) and np.allclose(got_img, img[[0, 2]], atol=1e-3)


def test_a_shared_caption_keeps_p_clean_at_most_the_contrasts_cap_and_its_flag_follows_the_similarity() -> None:
    """``owner_margin`` -inf marks a shared caption (``contrast.is_shared``): its ``p_clean`` and,
    under ``p-clean``, its weight are at most the contrast's ``shared_p_clean`` and never raised;
    ``noisy`` follows the adjusted similarity alone."""
    from pairclean.calibrate.calibration import Calibration
    from pairclean.output.tables import scores_table

    contrast = {"recipe": "bank-contrast", "version": 3, "owner_odds": 0.1, "owner_cosine": 0.85, "shared_p_clean": 0.5}
    cal = Calibration(beta=0.2, recipe="random-inputs", k=16, seed=0, weighting="p-clean", extra={"contrast": contrast})
    sims = np.array([0.5, 0.5, 0.1, 0.5, 0.5], np.float32)
    margin = np.array([-np.inf, -np.inf, -np.inf, 0.1, np.nan], np.float32)
    table = scores_table("s", list("abcde"), np.arange(5), ["ok"] * 5, [None] * 5, sims, cal, {}, adjusted=sims,
                         owner_margin=margin)
    p = table.column("p_clean").to_numpy()
    assert p[0] == p[1] == 0.5 and p[2] == 0.0  # capped; a low one stays low
    assert p[3] == p[4] == 1.0  # (this calibration's hard p_clean: certainty keeps its odds under an owner)
    assert table.column("weight").to_numpy().tolist() == p.tolist()
    assert table.column("noisy").to_pylist() == [False, False, True, False, False]
    assert np.isneginf(table.column("owner_margin").to_numpy()[:3]).all()
    # a contrast recorded without the rule caps nothing
    old = Calibration(beta=0.2, recipe="random-inputs", k=16, seed=0, weighting="p-clean",
                      extra={"contrast": {k: v for k, v in contrast.items() if k != "shared_p_clean"}})
    plain = scores_table("s", list("abcde"), np.arange(5), ["ok"] * 5, [None] * 5, sims, old, {}, adjusted=sims,
                         owner_margin=margin)
    assert plain.column("p_clean").to_numpy()[0] == 1.0
