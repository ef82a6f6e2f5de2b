"""Scoring one shard: pairs in, similarities and embeddings out; then the output tables.

``score_shard`` reads and decodes in a background thread (bounded queue) while the
calling thread runs the model, so decoding overlaps the forward pass. It never fails
for a bad sample (that becomes a status row), only for a bad shard.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from . import __version__, osa, schema
from .decode import DEFAULT_MAX_PIXELS, DecodeFailure, decode_image
from .estimators import Estimator
from .job import Calibration
from .shards import PairSample, ReadOptions, iter_pairs

__all__ = [
    "ScoreOptions",
    "ShardResult",
    "score_shard",
    "scores_table",
    "embeddings_table",
    "output_metadata",
]


@dataclass(frozen=True)
class ScoreOptions:
    """How pairs are read and batched. ``prefetch``: decoded batches buffered ahead."""

    batch_size: int = 64
    max_pixels: int = DEFAULT_MAX_PIXELS
    read: ReadOptions = ReadOptions()
    prefetch: int = 2


@dataclass
class ShardResult:
    """Everything scored from one shard, rows in tar order.

    ``similarity`` is NaN for rows whose status is not ``ok``; their embedding rows are
    zero and ``ok_mask`` is False.
    """

    uri: str
    keys: list[str]
    idx: NDArray[np.int64]
    status: list[str]
    error: list[str | None]
    similarity: NDArray[np.float32]
    image_emb: NDArray[np.float32]
    text_emb: NDArray[np.float32]
    uid: list[str | None] | None
    url: list[str | None] | None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok_mask(self) -> NDArray[np.bool_]:
        return np.array([s == schema.STATUS_OK for s in self.status], dtype=bool)

    def status_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(self.status).items()))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class _Batch:
    seconds: float  # reading and decoding this batch took
    rows: list[PairSample]
    statuses: list[str]
    errors: list[str | None]
    pixels: Any  # torch.Tensor of the ok rows
    texts: list[str]
    ok_positions: list[int]


_DONE = object()


def _prepare_batch(rows: list[PairSample], estimator: Estimator, options: ScoreOptions, started: float) -> _Batch:
    import torch

    statuses, errors, tensors, texts, ok_positions = [], [], [], [], []
    for pos, row in enumerate(rows):
        status, error = row.status, row.error
        if status == schema.STATUS_OK:
            assert row.image is not None and row.text is not None
            img = decode_image(row.image, options.max_pixels, draft_size=estimator.image_size)
            if isinstance(img, DecodeFailure):
                status, error = img.status, img.error
            else:
                tensors.append(estimator.preprocess(img))
                texts.append(row.text)
                ok_positions.append(pos)
        statuses.append(status)
        errors.append(error)
    size = estimator.image_size
    pixels = torch.stack(tensors) if tensors else torch.zeros((0, 3, size, size))
    return _Batch(time.perf_counter() - started, rows, statuses, errors, pixels, texts, ok_positions)


def _batches(uri: str, estimator: Estimator, options: ScoreOptions) -> Iterator[list[PairSample]]:
    rows: list[PairSample] = []
    for pair in iter_pairs(uri, options.read):
        rows.append(pair)
        if len(rows) == options.batch_size:
            yield rows
            rows = []
    if rows:
        yield rows


def _producer(uri: str, estimator: Estimator, options: ScoreOptions, out: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        started = time.perf_counter()
        for rows in _batches(uri, estimator, options):
            batch = _prepare_batch(rows, estimator, options, started)
            while not stop.is_set():
                try:
                    out.put(batch, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
            started = time.perf_counter()
        out.put(_DONE)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
        out.put(exc)


def _prepared_batches(uri: str, estimator: Estimator, options: ScoreOptions) -> Iterator[_Batch]:
    q: queue.Queue[Any] = queue.Queue(maxsize=max(1, options.prefetch))
    stop = threading.Event()
    thread = threading.Thread(target=_producer, args=(uri, estimator, options, q, stop), daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def score_shard(uri: str, estimator: Estimator, options: ScoreOptions | None = None) -> ShardResult:
    """Read, decode and embed every pair of the shard at ``uri``.

    Raises ``ShardNotFoundError`` / ``ShardReadError`` (naming ``uri``) for a shard that
    cannot be read; per-sample failures are rows.
    """
    opts = options or ScoreOptions()
    dim = estimator.info.embed_dim
    keys: list[str] = []
    idx: list[int] = []
    status: list[str] = []
    error: list[str | None] = []
    uid: list[str | None] = []
    url: list[str | None] = []
    sims: list[NDArray[np.float32]] = []
    img_parts: list[NDArray[np.float32]] = []
    txt_parts: list[NDArray[np.float32]] = []
    read_decode = embed = 0.0
    for batch in _prepared_batches(uri, estimator, opts):
        read_decode += batch.seconds
        t0 = time.perf_counter()
        n = len(batch.rows)
        img = np.zeros((n, dim), dtype=np.float32)
        txt = np.zeros((n, dim), dtype=np.float32)
        if batch.ok_positions:
            img[batch.ok_positions] = estimator.encode_images(batch.pixels)
            txt[batch.ok_positions] = estimator.encode_texts(batch.texts)
        sim = np.full(n, np.nan, dtype=np.float32)
        sim[batch.ok_positions] = osa.cosine_rows(img[batch.ok_positions], txt[batch.ok_positions])
        embed += time.perf_counter() - t0
        sims.append(sim)
        img_parts.append(img)
        txt_parts.append(txt)
        for row in batch.rows:
            keys.append(row.key)
            idx.append(row.idx)
            uid.append(row.uid)
            url.append(row.url)
        status.extend(batch.statuses)
        error.extend(batch.errors)
    return ShardResult(
        uri=uri,
        keys=keys,
        idx=np.asarray(idx, dtype=np.int64),
        status=status,
        error=error,
        similarity=np.concatenate(sims) if sims else np.zeros(0, np.float32),
        image_emb=np.concatenate(img_parts) if img_parts else np.zeros((0, dim), np.float32),
        text_emb=np.concatenate(txt_parts) if txt_parts else np.zeros((0, dim), np.float32),
        uid=uid if any(u is not None for u in uid) else None,
        url=url if any(u is not None for u in url) else None,
        # read_decode runs in the reader thread, overlapping embed: they do not add up.
        timings={"read_decode": round(read_decode, 4), "embed": round(embed, 4)},
    )


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
        "noisy_rule": "similarity <= beta",
        **extra,
    }
    return {schema.META_KEY: json.dumps(doc, sort_keys=True).encode()}


def _weighting_params(calibration: Calibration) -> osa.WeightingParams:
    return osa.WeightingParams(calibration.weighting, calibration.d_ref, calibration.weighting_batch_size)


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
) -> pa.Table:
    """The scores Parquet table: weights and flags from similarities and the calibration.

    Rows that are not ``ok`` get weight 0 and ``noisy = True`` (a trainer must not use
    them as clean pairs).
    """
    ok = np.array([s == schema.STATUS_OK for s in status], dtype=bool)
    sims = np.asarray(similarity, dtype=np.float32)
    weight = np.zeros(len(keys), dtype=np.float32)
    # reference-batch batches consecutive ok pairs, as the released code batches its loader.
    weight[ok] = osa.apply_weighting(sims[ok], calibration.beta, _weighting_params(calibration))
    noisy = osa.noisy_flags(sims, calibration.beta)
    columns: dict[str, Any] = {
        schema.COL_KEY: keys,
        schema.COL_SHARD: [shard] * len(keys),
        schema.COL_IDX: idx,
        schema.COL_STATUS: status,
        schema.COL_ERROR: error,
        schema.COL_SIMILARITY: sims,
        schema.COL_WEIGHT: weight,
        schema.COL_NOISY: noisy,
    }
    if uid is not None:
        columns[schema.COL_UID] = uid
    if url is not None:
        columns[schema.COL_URL] = url
    table_schema = schema.scores_schema(uid is not None, url is not None).with_metadata(metadata)
    return pa.table(columns, schema=table_schema)


def embeddings_table(keys: list[str], image_emb: NDArray[np.float32], text_emb: NDArray[np.float32], ok: NDArray[np.bool_], metadata: dict[bytes, bytes]) -> pa.Table:
    """The float16 embedding sidecar; rows that are not ok hold nulls."""
    dim = image_emb.shape[1]

    def column(emb: NDArray[np.float32]) -> pa.Array:
        flat = pa.array(emb.astype(np.float16).ravel(), type=pa.float16())
        arr = pa.FixedSizeListArray.from_arrays(flat, dim)
        mask = pa.array(~ok)
        return pa.FixedSizeListArray.from_arrays(flat, dim, mask=mask) if (~ok).any() else arr

    return pa.table(
        {schema.COL_KEY: keys, schema.COL_IMAGE_EMB: column(image_emb), schema.COL_TEXT_EMB: column(text_emb)},
        schema=schema.embeddings_schema(dim).with_metadata(metadata),
    )
