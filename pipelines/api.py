"""The notebook API: score image-caption pairs held in memory, with an estimator loaded once.

    import pairclean
    est = pairclean.load_estimator("pairclean-lite")          # load once, reuse
    result = pairclean.score_pairs(images, captions, estimator=est)
    result.weight, result.noisy, result.p_clean, result.similarity, result.calibration

The same data flow as a job (decode -> embeddings -> similarity -> calibration -> weight),
on arrays instead of shards: images that cannot be decoded get a status, never an
exception. Calibration uses the pairs given (the first ``calibration_pairs`` ok ones), so
a batch of pairs is calibrated like a job of one shard; or pass ``calibration=`` (a scored
job's folder, a saved calibration file, or a ``Calibration``) to apply a frozen one, so a
pair's weight does not depend on the batch it came in (what a Ray Data ``map_batches``
step needs: see ``pairclean.ray_data.ScorePairs``). A batch of fewer than
``MIN_SELF_CALIBRATION_PAIRS`` ok pairs is too small to calibrate itself (its mixture needs
them; below that the weights would fall back to a hard 0/1): refused unless
``allow_small_calibration=True``.
"""

from __future__ import annotations

import io
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["MIN_SELF_CALIBRATION_PAIRS", "PairScores", "load_calibration", "load_estimator", "save_calibration", "score_pairs"]

#: Fewer ok pairs than this cannot calibrate a batch by themselves (``calibration.MIN_MIXTURE_PAIRS``).
MIN_SELF_CALIBRATION_PAIRS = 16


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
    #: The judge's score (log likelihood ratio clean : noisy; NaN where it did not judge),
    #: as a job's ``judge_score`` column; None when the calibration has no judge.
    judge_score: NDArray[np.float32] | None = None

    def to_pandas(self) -> Any:
        """The arrays as a pandas DataFrame (needs pandas); ``judge_score`` where there is one."""
        import pandas as pd

        judge = {} if self.judge_score is None else {"judge_score": self.judge_score}
        return pd.DataFrame({"similarity": self.similarity, "weight": self.weight, "noisy": self.noisy,
                             "p_clean": self.p_clean, **judge, "status": self.status, "error": self.error})


def load_calibration(source: Any, *, model: str | None = None, storage_options: Any = None) -> Any:
    """A frozen ``Calibration`` from a scored job's output folder (local or object store),
    a JSON file (``save_calibration``'s, or a job's ``OUT.pairclean/state/calibration.json``),
    or a ``Calibration`` as is. ``model``: the estimator's model id; a job or file that
    names another model is refused (its beta means nothing for this one). Raises
    ``InputError`` when there is no calibration to read."""
    import json

    from pairclean.calibrate.calibration import Calibration
    from pairclean.errors import InputError, first_line
    from pairclean.output.folder import OutputDir

    if isinstance(source, Calibration):
        return source
    path = os.fspath(source)
    if os.path.isfile(path):
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
        found_model = doc.get("model") if "calibration" in doc else None
        try:
            calibration = Calibration.from_json(doc["calibration"] if "calibration" in doc else doc)
        except TypeError as exc:
            raise InputError(f"{path} is not a calibration pairclean wrote ({first_line(exc)})") from None
    else:
        out = OutputDir(path, storage_options)
        spec, frozen = out.read_spec(), out.read_calibration()
        if spec is None or frozen is None:
            raise InputError(f"{path} holds no calibration: give a scored job's output folder or a saved calibration file")
        calibration, found_model = frozen, spec.model
        if "contrast" in frozen.extra:  # the corpus contrast's bank travels with it (actors, pickles)
            calibration = replace(frozen, bank=out.read_contrast_bank().astype(np.float16))
    if model is not None and found_model is not None and found_model != model:
        raise InputError(f"the calibration in {path} was made with model {found_model!r}, not {model!r}: "
                         "score with the same model, or calibrate on a job of this one")
    return calibration


def _frozen_contrast(frozen: Any) -> Any:
    """The corpus contrast of a frozen calibration (None without one), from the bank
    ``load_calibration`` attached (a job folder); a saved file carries no bank: refused."""
    from pairclean.calibrate.contrast import from_json
    from pairclean.errors import InputError

    if frozen is None or "contrast" not in frozen.extra:
        return None
    if frozen.bank is None:
        raise InputError("this calibration uses the corpus contrast, whose bank lives in the job's output folder: "
                         "pass calibration=<that folder> (or load_calibration(<that folder>))")
    try:
        return from_json(frozen.extra["contrast"], frozen.bank)
    except ValueError as exc:
        raise InputError(f"the calibration's contrast bank: {exc}") from exc


def save_calibration(calibration: Any, path: str | os.PathLike[str], *, model: str) -> None:
    """Write ``calibration`` (e.g. ``PairScores.calibration``) with its model id, for
    ``load_calibration``/``score_pairs(calibration=path)`` elsewhere (atomically)."""
    import json

    from pairclean.storage import write_file_atomic

    write_file_atomic(path, json.dumps({"model": model, "calibration": calibration.to_json()}, indent=2).encode())


def _image_bytes(image: Any) -> bytes:
    """Encoded bytes of a path, bytes, PIL image (re-encoded losslessly as PNG) or a decoded
    uint8 array (``H x W``, ``H x W x 3`` or ``x 4``, as Ray Data's readers give; stored as
    uncompressed PPM/PGM, which costs a copy, not a compression)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, np.ndarray):
        return _array_bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as fh:
            return fh.read()
    if hasattr(image, "save"):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be a path, bytes, a PIL image or a uint8 array, not {type(image).__name__}")


def _array_bytes(array: NDArray[Any]) -> bytes:
    from PIL import Image

    if array.dtype == object and array.ndim == 0:
        return _image_bytes(array.item())
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise TypeError(f"an image array must be uint8 H x W or H x W x 1/3/4, not {array.dtype} {array.shape}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 3 and array.shape[2] == 4:
        array = array[:, :, :3]  # alpha dropped, as decoding a PNG with alpha to RGB does
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PPM")
    return buf.getvalue()


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
    calibration: Any = None,
    allow_small_calibration: bool = False,
    judge_checkpoint: str | None = None,
) -> PairScores:
    """Score ``images[i]`` against ``captions[i]`` for every i.

    ``images``: paths, encoded bytes, PIL images or decoded uint8 arrays. ``estimator``: a
    loaded estimator (``load_estimator``), a model name, or None for pairclean-lite.
    ``beta_recipe``: None picks the estimator's measured default. ``calibration``: a frozen
    calibration (``load_calibration``'s sources: a scored job's folder, a saved file); then
    ``beta_recipe``/``weighting``/``beta_k`` are the calibration's and nothing is fitted on
    the batch. Without it, the batch calibrates itself, which needs at least
    ``MIN_SELF_CALIBRATION_PAIRS`` ok pairs for recipes and weightings fitted on the pairs
    (``allow_small_calibration=True`` accepts fewer: hard 0/1 weights). Raises
    ``InputError`` when the lengths differ, no pair can be scored with a corpus recipe, or
    the batch is too small to calibrate itself.

    A job's calibration brings the job's second stage: its corpus contrast, and its judge
    (``judge_score``; the judge's band and priors as frozen), so each pair gets the weight the
    job gave it. The judge is the shipped one, or ``judge_checkpoint`` for a job scored with
    ``--judge-checkpoint`` (its sha256 is checked against the calibration's). A batch that
    calibrates itself is scored by OSA alone (no contrast, no judge: their priors need a
    corpus-sized sample).
    """
    from pairclean import schema
    from pairclean.calibrate.calibration import needs_corpus
    from pairclean.read.decode import DEFAULT_MAX_PIXELS
    from pairclean.errors import InputError
    from pairclean.embed.estimators import default_beta_recipe
    from pairclean.spec import JobSpec
    from pairclean.embed.shard import ScoreOptions
    from pairclean.output.tables import scores_table
    from pairclean.calibrate.contrast import table_columns
    from pairclean.read.shards import PairSample
    from pairclean.job.work import calibrate_on, judged_columns, random_beta_fn

    if len(images) != len(captions):
        raise InputError(f"{len(images)} images but {len(captions)} captions: they must pair up one to one")
    est = load_estimator(estimator) if isinstance(estimator, str) else (estimator or load_estimator())
    frozen = load_calibration(calibration, model=est.info.model_id) if calibration is not None else None
    contrast = _frozen_contrast(frozen)
    recipe = frozen.recipe if frozen is not None else (beta_recipe or default_beta_recipe(est.info.model_id))
    weighting = frozen.weighting if frozen is not None else weighting
    samples = [_pair(i, image, caption, PairSample, schema) for i, (image, caption) in enumerate(zip(images, captions))]
    options = ScoreOptions(batch_size=batch_size, max_pixels=max_pixels or DEFAULT_MAX_PIXELS)
    judge = _frozen_judge(frozen, est, judge_checkpoint)
    result = _score_samples(samples, est, options, judge)
    spec = JobSpec(("in-memory",), est.info.model_id, None, None, est.info.precision, recipe, beta_k, weighting, seed,
                   batch_size, options.max_pixels, None, False, calibration_pairs)
    if frozen is not None:
        calibration = frozen
    else:
        ok = int(result.ok_mask.sum())
        if needs_corpus(recipe, weighting) and not ok:
            raise InputError("no pair could be scored (every image failed to decode or every caption was empty)")
        if needs_corpus(recipe, weighting) and ok < MIN_SELF_CALIBRATION_PAIRS and not allow_small_calibration:
            raise InputError(
                f"{ok} ok pairs are too few to calibrate themselves (at least {MIN_SELF_CALIBRATION_PAIRS}; below that the "
                "weights fall back to a hard 0/1 and depend on the batch): pass calibration= (a scored job's output "
                "folder or a saved calibration), or allow_small_calibration=True"
            )
        calibration = calibrate_on([result], spec, random_beta_fn(est, beta_k, seed), int(est.info.embed_dim))
    adjusted, owner = table_columns(contrast, result.similarity, result.image_emb, result.text_emb, result.ok_mask,
                                    result.caption_words)
    second_stage, extra_scores = judged_columns(result, calibration, adjusted) if judge is not None else (None, None)
    table = scores_table("in-memory", result.keys, result.idx, result.status, result.error, result.similarity, calibration, {},
                         second_stage=second_stage, extra_scores=extra_scores, adjusted=adjusted, owner_margin=owner)
    return PairScores(
        similarity=result.similarity, weight=table.column(schema.COL_WEIGHT).to_numpy(),
        noisy=table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False),
        p_clean=table.column(schema.COL_P_CLEAN).to_numpy(), status=result.status, error=result.error,
        calibration=calibration,
        judge_score=None if judge is None else table.column(schema.COL_JUDGE_SCORE).to_numpy(zero_copy_only=False),
    )


#: Judge runners bound to an estimator, by judge file and sha256: binding one exports its image tower
#: to ONNX Runtime (seconds), which a Ray actor calling ``score_pairs`` per batch pays once.
_JUDGES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _frozen_judge(frozen: Any, estimator: Any, checkpoint: str | None) -> Any:
    """The judge of a frozen calibration, bound to ``estimator`` and judging its frozen band;
    None when the calibration has no judge. ``InputError`` when the judge file found
    (``checkpoint``, else the shipped one) is not the calibration's (sha256)."""
    from pairclean.errors import InputError
    from pairclean.job.work import judge_band
    from pairclean.judge.runner import JudgeRunner, default_judge_path, load_judge

    band = None if frozen is None else judge_band(frozen)
    if band is None:
        return None
    record = frozen.extra["judge"]
    want = str(record.get("sha256", ""))
    bound = _JUDGES.setdefault(estimator, {})
    key = f"{os.path.abspath(checkpoint or default_judge_path())}:{want}"  # the file as checked against this sha256
    runner = bound.get(key)
    if runner is None:
        loaded = load_judge(checkpoint)
        if want and loaded.sha256 != want:
            raise InputError(f"the calibration was made with judge {record.get('id')!r} (sha256 {want[:12]}...), not "
                             f"{loaded.path!r} ({loaded.sha256[:12]}...): pass judge_checkpoint= the job's judge file")
        runner = bound[key] = JudgeRunner(loaded, estimator)
    return runner.with_band(band)


def _pair(i: int, image: Any, caption: str, pair_cls: Any, schema: Any) -> Any:
    from pairclean.read.shards import caption_text

    # as a shard's caption is read: bounded, and one of only invisible characters is empty
    text = caption_text(caption) if isinstance(caption, str) else ""
    status, error = (schema.STATUS_OK, None) if text else (schema.STATUS_EMPTY_TEXT, "empty caption")
    if image is None:  # a row without an image (a failed download in img2dataset's output, say)
        return pair_cls(key=f"{i:09d}", idx=i, image=None, text=text or None, status=schema.STATUS_MISSING_IMAGE, error="no image")
    try:
        data = _image_bytes(image)
    except TypeError as exc:
        if not isinstance(image, np.ndarray):
            raise  # a wrong kind of argument, not a bad sample
        # An array that is no image (wrong dtype or channels) is one bad pair, not a failed batch.
        return pair_cls(key=f"{i:09d}", idx=i, image=None, text=text or None, status=schema.STATUS_DECODE_ERROR, error=str(exc))
    return pair_cls(key=f"{i:09d}", idx=i, image=data, text=text or None, status=status, error=error)


def _score_samples(samples: list[Any], estimator: Any, options: Any, judge: Any = None) -> Any:
    """A ``ShardResult`` for in-memory samples: the scoring path of a shard, without the tar."""
    from pairclean.embed.shard import score_shard

    return score_shard("in-memory", estimator, options, samples=samples, judge=judge)
