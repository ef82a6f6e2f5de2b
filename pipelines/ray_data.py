"""A ready callable class for Ray Data's ``map_batches``: score image-caption pairs with a
model loaded once per actor and a calibration frozen from an existing job.

    import ray
    from pairclean.ray_data import ScorePairs

    ds = ray.data.read_images("/data/images", include_paths=True)           # {"image": H x W x 3 uint8, ...}
    ds = ds.map_batches(ScorePairs, fn_constructor_kwargs={"calibration": "/data/weights"},
                        batch_size=64, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=2))

Why a frozen calibration: ``score_pairs`` on a batch alone calibrates on that batch, so a
pair's weight would depend on which batch Ray put it in (and on a small batch fall back to
hard 0/1). ``calibration`` is a scored job's output folder (``pairclean score ... --out``),
a file saved with ``pairclean.api.save_calibration``, or a ``Calibration``; the job's model
must be the one loaded here (checked).

This module imports no Ray: the class is plain Python that Ray instantiates in its actors
(``fn_constructor_kwargs``), so ``pairclean`` stays free of it (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ScorePairs"]

#: The columns ``ScorePairs`` adds to each batch.
OUTPUT_COLUMNS = ("similarity", "weight", "noisy", "p_clean", "status", "error")  # and judge_score where the job has a judge


class ScorePairs:
    """``ScorePairs(batch) -> batch`` with ``similarity``, ``weight``, ``noisy``, ``p_clean``,
    ``status`` and ``error`` columns added (numpy batch format, rows in order).

    ``calibration``: required (see the module docstring). ``image_column`` holds decoded
    uint8 arrays as Ray Data's readers give them (``read_images``, ``read_webdataset``'s
    default decoder: ``H x W x 3``), encoded bytes (``decoder=None``) or paths;
    ``caption_column`` strings or bytes. A job whose calibration has a judge adds a
    ``judge_score`` column, and its weights are the job's (``judge_checkpoint``: the job's
    judge file, where it was not the shipped one). On img2dataset folders (json-only samples of failed
    downloads) read with ``read_webdataset(..., decoder=None)``: Ray Data cannot batch its
    decoded images beside missing ones, and pairclean decodes each image itself (a bad one
    is a status row). ``drop_image``: leave the image column out of
    the output (it is the bulk of a batch). ``threads``: torch threads of this actor (Ray
    sets ``OMP_NUM_THREADS=1`` in workers; default: the CPUs Ray gave the actor, at least 1).
    A pair that cannot be scored is a row with its status, never a failed batch.
    """

    def __init__(
        self,
        calibration: Any,
        *,
        model: str = "pairclean-lite",
        checkpoint: str | None = None,
        precision: str = "auto",
        device: str = "auto",
        image_column: str = "image",
        caption_column: str = "caption",
        drop_image: bool = True,
        threads: int | None = None,
        batch_size: int = 64,
        storage_options: Any = None,
        judge_checkpoint: str | None = None,
    ) -> None:
        from pairclean.api import load_calibration, load_estimator

        _set_threads(threads)
        self.estimator = load_estimator(model, checkpoint=checkpoint, precision=precision, device=device)
        self.calibration = load_calibration(calibration, model=self.estimator.info.model_id, storage_options=storage_options)
        self.image_column, self.caption_column = image_column, caption_column
        self.drop_image = drop_image
        self.batch_size = batch_size
        self.judge_checkpoint = judge_checkpoint

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from pairclean.api import score_pairs

        if self.image_column not in batch and self.caption_column not in batch:
            raise KeyError(f"ScorePairs: the batch has neither {self.image_column!r} nor {self.caption_column!r} "
                           f"(it has {sorted(batch)}): pass image_column= / caption_column=")
        n = len(next(iter(batch.values())))
        # A block without one of the columns (samples of a shard whose downloads all failed)
        # gives rows with a missing_image / empty_text status, not a failed batch.
        images = [_missing_as_none(x) for x in _rows(batch[self.image_column])] if self.image_column in batch else [None] * n
        raw = _rows(batch[self.caption_column]) if self.caption_column in batch else [None] * n
        captions = [_text(c) for c in raw]
        result = score_pairs(images, captions, estimator=self.estimator, calibration=self.calibration, batch_size=self.batch_size,
                             judge_checkpoint=self.judge_checkpoint)
        out = {k: v for k, v in batch.items() if not (self.drop_image and k == self.image_column)}
        out.update(similarity=result.similarity, weight=result.weight, noisy=result.noisy, p_clean=result.p_clean,
                   status=np.asarray(result.status, dtype=object), error=np.asarray(result.error, dtype=object))
        if result.judge_score is not None:
            out["judge_score"] = result.judge_score
        return out


def _rows(column: Any) -> list[Any]:
    """A batch column as a list of its rows: an ``N x H x W x C`` array (images of one size)
    gives N arrays, an object array (sizes differ) its items."""
    if isinstance(column, np.ndarray):
        return list(column) if column.dtype != object else column.tolist()
    return list(column)


def _missing_as_none(value: Any) -> Any:
    """None for a missing image cell (pandas and Ray put NaN there), else the value."""
    return None if isinstance(value, float) and value != value else value


def _text(value: Any) -> str:
    """A caption cell as text: bytes decoded, a missing one (None, or the NaN pandas/Ray put
    into a missing cell) empty, so the pair gets the ``empty_text`` status."""
    if isinstance(value, (bytes, bytearray)):
        from pairclean.read.shards import decode_caption

        return decode_caption(bytes(value))  # as a shard's .txt member is read
    return value if isinstance(value, str) else ""


def _set_threads(threads: int | None) -> None:
    import os

    import torch

    if threads is None:
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (1 by default): use that many, not 1 less.
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1))
    torch.set_num_threads(threads)
