"""The notebook API: score image-caption pairs held in memory, with an estimator loaded once.

    import pairclean
    est = pairclean.load_estimator("pairclean-lite")          # load once, reuse
    result = pairclean.score_pairs(images, captions, estimator=est)
    result.weight, result.noisy, result.p_clean, result.similarity, result.calibration

The same data flow as a job (decode -> embeddings -> similarity -> calibration -> weight),
on arrays instead of shards: images that cannot be decoded get a status, never an
exception. Calibration uses the pairs given (the first ``calibration_pairs`` ok ones), so
a batch of pairs is calibrated like a job of one shard.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["PairScores", "load_estimator", "score_pairs"]


def load_estimator(model: str = "pairclean-lite", *, checkpoint: str | None = None, precision: str = "auto", device: str = "auto") -> Any:
    """Build an estimator once (``pairclean-lite``, ``pairclean-tiny-test`` or an open_clip
    architecture with a local ``checkpoint``); pass it to ``score_pairs`` as often as needed."""
    from pairclean.embed.estimators import EstimatorSpec
    from pairclean.embed.estimators import load_estimator as _load

    return _load(EstimatorSpec(model, checkpoint=checkpoint, precision=precision, device=device))


@dataclass(frozen=True)
class PairScores:
    """Per-pair arrays (length N, in input order) and the calibration that made them.

    ``status`` is ``ok`` or why a pair could not be scored (``decode_error``,
    ``too_large``, ``empty_text``); such pairs have NaN similarity, weight 0, ``p_clean`` 0
    and ``noisy`` True, as in a job's score table.
    """

    similarity: NDArray[np.float32]
    weight: NDArray[np.float32]
    noisy: NDArray[np.bool_]
    p_clean: NDArray[np.float32]
    status: list[str]
    error: list[str | None]
    calibration: Any

    def to_pandas(self) -> Any:
        """The arrays as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.DataFrame({"similarity": self.similarity, "weight": self.weight, "noisy": self.noisy,
                             "p_clean": self.p_clean, "status": self.status, "error": self.error})


def _image_bytes(image: Any) -> bytes:
    """Encoded bytes of a path, bytes, or PIL image (re-encoded losslessly as PNG)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as fh:
            return fh.read()
    if hasattr(image, "save"):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be a path, bytes or a PIL image, not {type(image).__name__}")


def score_pairs(
    images: Sequence[Any],
    captions: Sequence[str],
    *,
    estimator: Any = None,
    beta_recipe: str | None = None,
    weighting: str = "p-clean",
    beta_k: int = 256,
    seed: int = 0,
    batch_size: int = 64,
    calibration_pairs: int = 4096,
    max_pixels: int | None = None,
) -> PairScores:
    """Score ``images[i]`` against ``captions[i]`` for every i.

    ``images``: paths, encoded bytes or PIL images. ``estimator``: a loaded estimator
    (``load_estimator``), a model name, or None for pairclean-lite. ``beta_recipe``: None
    picks the estimator's measured default. Raises ``InputError`` when the lengths differ
    or no pair can be scored with a corpus recipe.
    """
    from pairclean import schema
    from pairclean.calibrate.calibration import needs_corpus
    from pairclean.read.decode import DEFAULT_MAX_PIXELS
    from pairclean.errors import InputError
    from pairclean.embed.estimators import default_beta_recipe
    from pairclean.spec import JobSpec
    from pairclean.embed.shard import ScoreOptions
    from pairclean.output.tables import scores_table
    from pairclean.read.shards import PairSample
    from pairclean.job.work import calibrate_on, random_beta_fn

    if len(images) != len(captions):
        raise InputError(f"{len(images)} images but {len(captions)} captions: they must pair up one to one")
    est = load_estimator(estimator) if isinstance(estimator, str) else (estimator or load_estimator())
    recipe = beta_recipe or default_beta_recipe(est.info.model_id)
    samples = [_pair(i, image, caption, PairSample, schema) for i, (image, caption) in enumerate(zip(images, captions))]
    options = ScoreOptions(batch_size=batch_size, max_pixels=max_pixels or DEFAULT_MAX_PIXELS)
    result = _score_samples(samples, est, options)
    spec = JobSpec(("in-memory",), est.info.model_id, None, None, est.info.precision, recipe, beta_k, weighting, seed,
                   batch_size, options.max_pixels, None, False, calibration_pairs)
    if needs_corpus(recipe, weighting) and not result.ok_mask.any():
        raise InputError("no pair could be scored (every image failed to decode or every caption was empty)")
    calibration = calibrate_on([result], spec, random_beta_fn(est, beta_k, seed), int(est.info.embed_dim))
    table = scores_table("in-memory", result.keys, result.idx, result.status, result.error, result.similarity, calibration, {})
    return PairScores(
        similarity=result.similarity, weight=table.column(schema.COL_WEIGHT).to_numpy(),
        noisy=table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False),
        p_clean=table.column(schema.COL_P_CLEAN).to_numpy(), status=result.status, error=result.error,
        calibration=calibration,
    )


def _pair(i: int, image: Any, caption: str, pair_cls: Any, schema: Any) -> Any:
    text = caption.strip() if isinstance(caption, str) else ""
    status, error = (schema.STATUS_OK, None) if text else (schema.STATUS_EMPTY_TEXT, "empty caption")
    return pair_cls(key=f"{i:09d}", idx=i, image=_image_bytes(image), text=text or None, status=status, error=error)


def _score_samples(samples: list[Any], estimator: Any, options: Any) -> Any:
    """A ``ShardResult`` for in-memory samples: the scoring path of a shard, without the tar."""
    from pairclean.embed.shard import score_shard

    return score_shard("in-memory", estimator, options, samples=samples)
