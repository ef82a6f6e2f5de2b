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
