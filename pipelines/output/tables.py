"""The output tables of a shard: per-pair scores (weights and flags from similarities and the
frozen calibration), the float16 embedding sidecar, and the self-describing Parquet metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray
from pairclean import __version__, osa, schema
from pairclean.calibrate.calibration import Calibration
from pairclean.calibrate.contrast import has_owner, is_shared, owner_p_clean

__all__ = ["scores_table", "embeddings_table", "read_embeddings", "read_caption_words", "output_metadata", "float_column"]


def _p_clean_doc(calibration: Calibration) -> dict[str, Any]:
    """How this table's ``p_clean`` was made: the recipe, its version and parameters."""
    doc = calibration.extra.get("p_clean")
    if doc:
        return dict(doc)
    mixture = calibration.mixture()
    if mixture is not None:
        return {"recipe": "pinned-mixture", "version": 0, "means": list(mixture[0]), "stds": list(mixture[1]), "noise_weight": mixture[2]}
    return {"recipe": "hard", "version": 0, "rule": "similarity > beta"}


def _noisy_rule(calibration: Calibration, judge: dict[str, Any] | None) -> str:
    """The rule behind the ``noisy`` column (``scores_table``), as the metadata states it: a
    judge whose p_clean is in force (every judge but one whose word check its guard turned
    off, ``fine_prior`` None) flags ``p_clean <= 0.5`` on the pairs it judged; a version-3
    contrast also flags it on pairs whose caption has a better owner."""
    osa_rule = "adjusted_similarity <= beta" if "contrast" in calibration.extra else "similarity <= beta"
    owner = ", or p_clean <= 0.5 where owner_margin > 0" if (calibration.extra.get("contrast") or {}).get("owner_odds") is not None else ""
    if judge is None or ("fine_prior" in judge and judge["fine_prior"] is None):
        return osa_rule + owner
    return f"p_clean <= 0.5 where judged (judge_score not NaN), else {osa_rule}{owner}"


def output_metadata(model_info: dict[str, Any], calibration: Calibration, extra: dict[str, Any]) -> dict[bytes, bytes]:
    """The Parquet key-value metadata: one JSON document under ``schema.META_KEY``.

    Holds the pairclean version, the model (id, checkpoint sha256, precision,
    preprocessing), beta with its recipe, K and seed, and the weighting function. No
    time stamps: equal inputs and specs give byte-identical files.
    """
    doc = {
        "pairclean_version": __version__,
        "model": model_info,
        "beta": {
            "value": calibration.beta,
            "recipe": calibration.recipe,
            "k": calibration.k,
            "seed": calibration.seed,
            "noise_rate_estimate": calibration.noise_rate,
            "calibration_pairs": calibration.calibration_pairs,
        },
        "weighting": {
            "name": calibration.weighting,
            "d_ref": calibration.d_ref,
            "batch_size": calibration.weighting_batch_size,
        },
        "seed": calibration.seed,
        "noisy_rule": _noisy_rule(calibration, extra.get("judge")),
        "p_clean": _p_clean_doc(calibration),
        # what adjusted_similarity is (pairclean.calibrate.contrast); absent: weights read the similarity
        **({"contrast": calibration.extra["contrast"]} if "contrast" in calibration.extra else {}),
        **extra,
    }
    return {schema.META_KEY: json.dumps(doc, sort_keys=True).encode()}


def scores_table(
    shard: str,
    keys: list[str],
    idx: NDArray[np.int64],
    status: list[str],
    error: list[str | None],
    similarity: NDArray[np.float32],
    calibration: Calibration,
    metadata: dict[bytes, bytes],
    uid: list[str | None] | None = None,
    url: list[str | None] | None = None,
    members: Mapping[str, Sequence[int | None]] | None = None,
    second_stage: NDArray[np.float32] | None = None,
    extra_scores: Mapping[str, NDArray[np.float32]] | None = None,
    uid_url: bool = False,
    adjusted: NDArray[np.float32] | None = None,
    owner_margin: NDArray[np.float32] | None = None,
) -> pa.Table:
    """The scores Parquet table: weights and flags from similarities and the calibration.

    ``uid_url``: always write the ``uid`` and ``url`` columns (null where the shard has
    none), so every table of a job has one schema, whether or not a shard (an empty one,
    say) carries them; False keeps the older rule (columns only when the shard has them).

    ``members``: the ``schema.MEMBER_COLUMNS`` by name (where each pair's members lie in
    its tar), written last when given. ``second_stage``: (N,) a second stage's p_clean (the
    judge's) where finite: on those ok rows it replaces OSA's ``p_clean``, ``noisy`` becomes
    ``p_clean <= 0.5`` and, under the ``p-clean`` weighting, ``weight = p_clean``.
    ``extra_scores``: (N,) float32 columns written after ``p_clean`` (the judge's score).
    ``adjusted``: (N,) the corpus-contrast adjusted similarities (a calibration with a
    contrast): weight, noisy and p_clean are computed from them, and they are written as
    the ``adjusted_similarity`` column right after ``p_clean``.
    ``owner_margin``: (N,) ``Contrast.owner_margin`` (a version-3 contrast): written after
    ``adjusted_similarity``; where it is positive, ``p_clean`` (the judge's included) keeps
    ``owner_odds`` of its odds (``contrast.owner_p_clean``), ``noisy`` also holds where that
    ``p_clean`` is at most 0.5, and under the ``p-clean`` weighting ``weight = p_clean``; where
    it is -inf (a shared caption, ``contrast.is_shared``), ``p_clean`` is at most the contrast's
    ``shared_p_clean`` (``noisy`` unchanged) and under ``p-clean`` ``weight = p_clean``.

    Rows that are not ``ok`` get weight 0, ``p_clean`` 0 and ``noisy = True`` (a trainer
    must not use them as clean pairs). ``p_clean`` is the calibration's ``p_clean`` curve
    (``pairclean.calibrate.p_clean``), else (calibrations written before it) the posterior
    of its pinned mixture (``osa.mixture_posterior_clean``); a calibration without either
    (fewer than 16 ok pairs, or written before mixtures were recorded) gives the hard
    ``1 - noisy``.
    """
    ok = schema.ok_mask(status)
    sims = np.asarray(similarity, dtype=np.float32)
    if ("contrast" in calibration.extra) != (adjusted is not None):
        raise ValueError("adjusted similarities go with a calibration that has a contrast, and only with one")
    scored = sims if adjusted is None else np.asarray(adjusted, dtype=np.float32)
    weight = np.zeros(len(keys), dtype=np.float32)
    # reference-batch batches consecutive ok pairs, as the released code batches its loader.
    weight[ok] = osa.apply_weighting(scored[ok], calibration.beta, calibration.weighting_params())
    noisy = osa.noisy_flags(scored, calibration.beta)
    p_clean = np.zeros(len(keys), dtype=np.float32)
    p_clean[ok] = osa.apply_weighting(scored[ok], calibration.beta, calibration.p_clean_params())
    if second_stage is not None:
        judged = ok & np.isfinite(second_stage)
        p_clean[judged] = second_stage[judged]
        noisy = np.where(judged, p_clean <= 0.5, noisy)
        if calibration.weighting == "p-clean":
            weight[judged] = p_clean[judged]
    if owner_margin is not None:
        owned = ok & has_owner(owner_margin)
        moved = owned | (ok & is_shared(owner_margin))
        doc = calibration.extra["contrast"]
        p_clean[moved] = owner_p_clean(p_clean[moved], owner_margin[moved], doc.get("owner_odds"), doc.get("shared_p_clean"))
        noisy = np.where(owned, noisy | (p_clean <= 0.5), noisy)
        if calibration.weighting == "p-clean":
            weight[moved] = p_clean[moved]
    columns: dict[str, Any] = {
        schema.COL_KEY: keys,
        schema.COL_SHARD: [shard] * len(keys),
        schema.COL_IDX: idx,
        schema.COL_STATUS: status,
        schema.COL_ERROR: error,
        schema.COL_SIMILARITY: sims,
        schema.COL_WEIGHT: weight,
        schema.COL_NOISY: noisy,
        schema.COL_P_CLEAN: p_clean,
    }
    extra = {schema.COL_ADJUSTED: scored} if adjusted is not None else {}
    if owner_margin is not None:
        extra[schema.COL_OWNER_MARGIN] = np.where(ok, np.asarray(owner_margin, np.float32), np.nan)
    extra.update(extra_scores or {})
    columns.update((name, np.asarray(values, np.float32)) for name, values in extra.items())
    if uid_url:
        uid = uid if uid is not None else [None] * len(keys)
        url = url if url is not None else [None] * len(keys)
    if uid is not None:
        columns[schema.COL_UID] = uid
    if url is not None:
        columns[schema.COL_URL] = url
    if members is not None:
        columns.update((name, members[name]) for name in schema.MEMBER_COLUMNS)
    table_schema = schema.scores_schema(
        uid is not None, url is not None, extra_scores=tuple(extra), with_members=members is not None
    ).with_metadata(metadata)
    return pa.table(columns, schema=table_schema)


def embeddings_table(keys: list[str], image_emb: NDArray[np.float32], text_emb: NDArray[np.float32], ok: NDArray[np.bool_],
                     metadata: dict[bytes, bytes], caption_words: NDArray[np.int16] | None = None) -> pa.Table:
    """The float16 embedding sidecar; rows that are not ok hold zero vectors.
    ``caption_words`` (N,): each caption's content-word count (``ShardResult.caption_words``),
    stored with -1 where not ok; None: no such column.

    Zeros, not nulls: pyarrow 18-24 refuses to write a fixed-size list with a null entry
    ("Lists with non-zero length null components are not supported": the sidecar of a
    shard with one corrupt image could not be written there) and pyarrow 25 cannot read
    one back (found on a GPU machine's pyarrow 25.0.1). A real embedding has norm 1, so a
    zero vector is never one.
    """
    dim = image_emb.shape[1]
    keep = np.asarray(ok, dtype=bool)[:, None]

    def column(emb: NDArray[np.float32]) -> pa.Array:
        values = np.where(keep, emb, 0.0).astype(np.float16)
        return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel(), type=pa.float16()), dim)

    columns = {schema.COL_KEY: keys, schema.COL_IMAGE_EMB: column(image_emb), schema.COL_TEXT_EMB: column(text_emb)}
    if caption_words is not None:
        columns[schema.COL_CAPTION_WORDS] = pa.array(np.where(keep[:, 0], caption_words, -1).astype(np.int16))
    return pa.table(columns, schema=schema.embeddings_schema(dim, caption_words is not None).with_metadata(metadata))


def read_caption_words(table: pa.Table, rows: int) -> NDArray[np.int16] | None:
    """(``rows``,) the sidecar ``table``'s content-word counts (-1 where not ok), or None where
    it has none (written before them) or holds another number of rows (not this table's)."""
    if schema.COL_CAPTION_WORDS not in table.column_names or table.num_rows != rows:
        return None
    column = table.column(schema.COL_CAPTION_WORDS)
    if not pa.types.is_integer(column.type) or column.null_count:
        return None
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int16)


def read_embeddings(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(image, text) float32 embeddings of the ok rows of one sidecar table: (n, D) each.

    A row without embeddings is a zero vector (``embeddings_table``) or, in sidecars of
    earlier releases, null.
    """
    valid = pa.array(table.column(schema.COL_IMAGE_EMB).is_valid().to_numpy(zero_copy_only=False))
    out = []
    for name in (schema.COL_IMAGE_EMB, schema.COL_TEXT_EMB):
        col = table.column(name).combine_chunks().filter(valid)
        dim = col.type.list_size
        out.append(col.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim))
    present = np.any(out[0] != 0, axis=1) | np.any(out[1] != 0, axis=1)
    return out[0][present], out[1][present]


def float_column(table: pa.Table, name: str) -> NDArray[np.float32] | None:
    """Column ``name`` of a score table as (N,) float32 (nulls as NaN), or None when the
    table has no such column (``judge_score`` of an unjudged job, ``adjusted_similarity``
    of a job without the corpus contrast)."""
    if name not in table.column_names:
        return None
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), np.float32)
