"""What one worker does: score shards, apply the frozen calibration, write its own outputs.

A worker (a Ray actor, or the driver itself with ``--executor local``) holds one loaded
estimator and an ``OutputDir``. It has two kinds of work:

- ``calibrate(uris)``: the calibration phase. Scores shards *in order* until
  ``spec.calibration_pairs`` ok pairs are seen (or the shards run out), freezes beta and
  the weighting parameters from them, then writes those shards' outputs with it. Only a
  ``Calibration`` and small records go back to the driver.
- ``score(uri, calibration)``: the scoring phase. Scores one shard, applies the frozen
  calibration, writes the score table and the sidecar, and returns a ``ShardRecord``.

Embeddings never leave the worker except into the sidecar files. Data flows
shard -> samples -> embeddings -> similarity -> calibration -> weight -> table -> commit:
``scoring`` does the first four, ``calibration``/``osa`` the next two, this module the
tables, and the driver (``runner``) the commit.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pairclean import __version__, schema
from pairclean.calibrate.calibration import calibrate, cached_random_beta, needs_corpus
from pairclean.calibrate.contrast import Contrast, fit_contrast, image_copy_cosine_for, owner_cosine_for, table_columns
from pairclean.calibrate.contrast import from_json as contrast_from_json
from pairclean.errors import InputError
from pairclean.embed.estimators import Estimator
from pairclean.calibrate.calibration import Calibration
from pairclean.spec import JobSpec, spec_digest
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.embed.shard import ScoreOptions, ShardResult, score_shard
from pairclean.output.tables import embeddings_table, output_metadata, scores_table
from pairclean.read.shards import Deadline, ReadOptions, iter_pairs
from pairclean.uris import shard_size, shard_stem

__all__ = ["ShardOutcome", "CalibrationOutcome", "ShardWork", "random_beta_fn", "calibrate_on", "fit_calibration"]


@dataclass(frozen=True)
class ShardOutcome:
    """What became of one shard: its record, or an error after ``attempts`` tries."""

    uri: str
    record: ShardRecord | None
    error: str | None = None
    attempts: int = 1


@dataclass(frozen=True)
class CalibrationOutcome:
    """The frozen calibration (None when every shard failed) and the shards the calibration
    phase scored, written or failed, in shard order."""

    calibration: Calibration | None
    outcomes: list[ShardOutcome] = field(default_factory=list)


def random_beta_fn(estimator: Estimator, k: int, seed: int) -> Any:
    """A callable giving beta of the random-inputs recipe for ``estimator`` (disk-cached
    per model identity)."""
    from pairclean.osa import beta_from_cross

    info = estimator.info
    identity = {
        "model_id": info.model_id,
        "checkpoint_sha256": info.checkpoint_sha256,
        "precision": info.precision,
        "engine": info.engine,
        "device_type": info.device.split(":")[0],
        "k": k,
        "seed": seed,
    }

    def compute() -> float:
        img, txt = estimator.random_input_embeddings(k, seed)
        return beta_from_cross(img, txt)

    return lambda: cached_random_beta(identity, compute)


def _recipe(spec: JobSpec) -> dict[str, Any]:
    return {
        "batch_size": spec.batch_size,
        "max_pixels": spec.max_pixels,
        "caption_field": spec.caption_field,
        "calibration_pairs": spec.calibration_pairs,
        "decode_device": spec.decode_device,
    }


def calibrate_on(results: Sequence[ShardResult], spec: JobSpec, random_beta: Any, dim: int) -> Calibration:
    """Calibrate on the first ``spec.calibration_pairs`` ok pairs of ``results`` (in order; may be empty)."""
    return fit_calibration(results, spec, random_beta, dim)[0]


def fit_calibration(results: Sequence[ShardResult], spec: JobSpec, random_beta: Any, dim: int,
                    word_check: bool = False) -> tuple[Calibration, Contrast | None]:
    """``calibrate_on`` and the corpus contrast it was fitted with (``spec.contrast``; None
    when off or the sample is too small): the caller stores the contrast's bank.
    ``word_check``: see ``calibration.calibrate``."""
    masks = [r.ok_mask for r in results]
    n = spec.calibration_pairs
    sims = np.concatenate([np.zeros(0, np.float32)] + [r.similarity[m] for r, m in zip(results, masks)])[:n]
    img = np.concatenate([np.zeros((0, dim), np.float32)] + [r.image_emb[m] for r, m in zip(results, masks)])[:n]
    txt = np.concatenate([np.zeros((0, dim), np.float32)] + [r.text_emb[m] for r, m in zip(results, masks)])[:n]
    # Calibrate on float16-rounded embeddings, exactly what the sidecar stores, so that
    # `pairclean rescore` reproduces a fresh score bit for bit.
    img, txt = img.astype(np.float16).astype(np.float32), txt.astype(np.float16).astype(np.float32)
    contrast = fit_contrast(img, txt, owner_cosine_for(spec.model, spec.checkpoint),
                         image_copy_cosine_for(spec.model, spec.checkpoint)) if spec.contrast else None
    try:
        calibration = calibrate(
            beta_recipe=spec.beta_recipe, k=spec.beta_k, seed=spec.seed, weighting=spec.weighting,
            batch_size=spec.batch_size, similarities=sims, image_emb=img, text_emb=txt, random_beta=random_beta,
            contrast=contrast, word_check=word_check,
        )
        return calibration, as_recorded(calibration, contrast)
    except ValueError as exc:
        raise InputError(f"cannot calibrate beta recipe {spec.beta_recipe!r} on this job: {exc}") from exc


def _contrast_key(doc: dict[str, Any]) -> str:
    """A contrast record as a key: the same bank can carry another ``random_fit`` (a refit)."""
    return json.dumps(doc, sort_keys=True)


def as_recorded(calibration: Calibration, contrast: Contrast | None) -> Contrast | None:
    """``contrast`` as ``calibration`` recorded it: ``calibrate`` may have set its
    ``random_fit`` (a junk-heavy corpus), and workers, tables and rescore must adjust with
    exactly the recorded one (None when the calibration has no contrast)."""
    doc = calibration.extra.get("contrast")
    if contrast is None or doc is None:
        return None
    return contrast_from_json(doc, contrast.bank)


def _load_judge_runner(estimator: Estimator, spec: JobSpec) -> Any:
    """The judge of ``spec`` bound to ``estimator`` (None when the judge is off)."""
    if spec.judge == "off":
        return None
    from pairclean.errors import ModelLoadError
    from pairclean.judge.runner import JudgeRunner, load_judge

    loaded = load_judge(spec.judge_checkpoint)
    if spec.judge_sha256 is not None and loaded.sha256 != spec.judge_sha256:
        raise ModelLoadError(
            f"judge {loaded.path!r} has sha256 {loaded.sha256[:12]}..., this job was started with "
            f"{spec.judge_sha256[:12]}...: the weights changed; score into a new folder or use --overwrite"
        )
    return JudgeRunner(loaded, estimator)


def judge_calibration(results: Sequence[ShardResult], spec: JobSpec, calibration: Calibration, identity: dict[str, Any],
                      contrast: Contrast | None = None) -> dict[str, Any]:
    """The judge's frozen part of a calibration, from the calibration phase's judged pairs:
    the corpus prior (``posterior.estimate_prior``), for a judge with a near-miss map its
    near-miss prior (``refit_fine_prior``), and the band (``posterior.choose_band``; every
    pair under ``--judge all``). Uses the first ``spec.calibration_pairs`` ok pairs;
    ``contrast``: the calibration's corpus contrast (OSA's p_clean then reads the adjusted
    similarities; the band stays a window of the similarity)."""
    from pairclean.judge import posterior

    n = spec.calibration_pairs
    sims = calibration_similarities(results, n)
    llr = calibration_ratios(results, n)
    scored = sims if contrast is None else np.concatenate(
        [np.zeros(0, np.float32)] + [contrast.adjust(r.similarity, r.image_emb, r.text_emb)[r.ok_mask] for r in results])[:n]
    osa_p = osa_p_clean(scored, calibration)
    doc = refit_fine_prior({"mode": spec.judge, "budget": spec.judge_budget, "prior_clean": posterior.estimate_prior(llr),
                            "pairs": int(len(llr)), **identity}, llr, osa_p)
    band = posterior.FULL_BAND if spec.judge == "all" else posterior.choose_band(
        sims, judged_p_clean(llr, osa_p, doc), osa_p, float(spec.judge_budget or 0.0))
    return {**doc, "band": [_finite(band[0]), _finite(band[1])]}


def calibration_similarities(results: Sequence[ShardResult], n: int) -> NDArray[np.float32]:
    """The similarities (at most n,) of the first ``n`` ok pairs of the calibration phase's
    shards, in shard order (the pairs ``calibration_ratios`` are of)."""
    out: NDArray[np.float32] = np.concatenate([np.zeros(0, np.float32)] + [r.similarity[r.ok_mask] for r in results])[:n]
    return out


def calibration_ratios(results: Sequence[ShardResult], n: int) -> NDArray[np.float32]:
    """The judge's ratios (at most n,) of the first ``n`` ok pairs of the calibration phase's
    judged shards, in shard order (what ``judge_calibration`` fits on; kept beside the
    calibration, ``OutputDir.write_judge_ratios``, for ``pairclean rescore``)."""
    out: NDArray[np.float32] = np.concatenate(
        [np.zeros(0, np.float32)] + [r.judge_llr[r.ok_mask] for r in results if r.judge_llr is not None])[:n].astype(np.float32)
    return out


def has_word_check(judge: dict[str, Any]) -> bool:
    """Whether a judge (its identity or record) has a near-miss map, i.e. multiplies OSA's
    p_clean by its word check rather than replacing it (``posterior.combined_p_clean``)."""
    return "platt_fine" in judge


def word_check_off(judge: dict[str, Any]) -> bool:
    """Whether a judge record with a word check had it turned off by its guard (``fine_prior``
    None: too few pairs, or a corpus outside what the judge learned)."""
    return has_word_check(judge) and judge.get("fine_prior") is None


def with_judge_record(calibration: Calibration, record: Callable[[Calibration], dict[str, Any]],
                      refit: Callable[[], Calibration]) -> Calibration:
    """``calibration`` (fitted for a word check where the judge has one) with the judge's
    record ``record(calibration)``; where the record's guard turns the word check off
    (``fine_prior`` None), OSA's outputs stand alone, so OSA is refitted as without a judge
    (``refit()``). A fresh score and ``pairclean rescore`` both calibrate through here."""
    frozen = record(calibration)
    if word_check_off(frozen):
        calibration = refit()
    return replace(calibration, extra={**calibration.extra, "judge": frozen})


def osa_p_clean(scored: NDArray[np.float32], calibration: Calibration) -> NDArray[np.float32]:
    """OSA's p_clean (N,) of the scores ``scored`` (N,) (the similarity, or the contrast's
    adjusted one) under ``calibration``, as ``scores_table`` writes it."""
    from pairclean import osa

    return osa.apply_weighting(scored, calibration.beta, calibration.p_clean_params())


def judged_p_clean(llr: NDArray[np.float32], osa_p: NDArray[np.float32], frozen: dict[str, Any]) -> NDArray[np.float32]:
    """The cascade's p_clean (N,) of pairs with judge ratios ``llr`` (N,) (NaN: not judged,
    stays NaN) and OSA's p_clean ``osa_p`` (N,), under the calibration's judge record ``frozen``.

    A judge with a near-miss map (``fine_prior`` in the record) is combined with OSA's
    p_clean (``posterior.combined_p_clean``), or leaves OSA's outputs (all NaN) where its
    factor is off (``fine_prior`` None); an older one replaces it.
    """
    from pairclean.judge import posterior

    if "fine_prior" not in frozen:
        return posterior.p_clean_of(llr, float(frozen["prior_clean"]))
    if frozen["fine_prior"] is None:  # the factor is off (``fine_off`` says why): OSA's outputs stay
        return np.full(len(llr), np.nan, np.float32)
    fine = posterior.fine_llr(llr, _pair(frozen["platt"]), _pair(frozen["platt_fine"]))
    fit = frozen.get("fine_mixture_fit")
    if fit is not None and fit["used"]:  # words the judge never saw changed: the mixture's posterior
        mixture = posterior.FineMixture.from_doc(frozen["fine_mixture"])
        shares = tuple(float(v) for v in fit["shares"])
        return (np.asarray(osa_p, np.float64) * posterior.mixture_p_clean(fine, mixture, (shares[0], shares[1], shares[2]))).astype(np.float32)
    return posterior.combined_p_clean(osa_p, fine, float(frozen["fine_prior"]))


def refit_fine_prior(frozen: dict[str, Any], llr: NDArray[np.float32], osa_p: NDArray[np.float32]) -> dict[str, Any]:
    """The judge record ``frozen`` with its near-miss prior refitted from the calibration
    pairs' ratios ``llr`` and OSA's p_clean ``osa_p`` (N,) (as ``judge_calibration`` reads
    them); unchanged for a judge without a near-miss map."""
    from pairclean.judge import posterior

    if not has_word_check(frozen):
        return dict(frozen)
    fine = posterior.fine_llr(llr, _pair(frozen["platt"]), _pair(frozen["platt_fine"]))
    rates = _pair(frozen["fine_rates"]) if "fine_rates" in frozen else None
    prior, why = posterior.fine_prior_or_reason(fine, osa_p, rates)
    doc = {**{k: v for k, v in frozen.items() if k not in ("fine_off", "fine_mixture_fit")}, "fine_prior": prior,
           **({"fine_off": why} if why else {})}
    if prior is not None and "fine_mixture" in frozen:  # a judge that knows how unseen-word edits score
        fit = posterior.fit_mixture(fine, posterior.FineMixture.from_doc(frozen["fine_mixture"]), osa_p, prior)
        doc["fine_mixture_fit"] = None if fit is None else fit.to_doc()
    return doc


def _pair(values: Any) -> tuple[float, float]:
    """A Platt map (a, b) as read back from JSON."""
    a, b = values
    return float(a), float(b)


def _finite(x: float) -> float | str:
    """JSON has no infinities: an open end of the band is written as a string."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


#: Statuses of a sample whose image or caption is not where the job reads it.
_MISSING = frozenset({schema.STATUS_MISSING_TEXT, schema.STATUS_MISSING_IMAGE})
#: Short side (pixels) the first-shard check decodes JPEGs at: whether it decodes, not how it looks.
_CHECK_DRAFT = 32
#: Shards, and rows, the first-shard check reads at most before it gives its verdict.
_CHECK_SHARDS = 8
_CHECK_ROWS = 4096


def _check_some_pair_readable(held: Sequence[ShardResult], field: str | None) -> None:
    """``InputError`` when no row of the calibration's shards is ``ok`` and more than half of
    the rows lack their caption or their image (``missing_text`` / ``missing_image``; a few
    corrupt images among them do not hide that): the shards name their
    fields otherwise than the job reads them (a mistyped ``--caption-field``, captions in a
    json field without one, images in a member that is no jpg/jpeg/png/webp). The calibration
    reads shards until it has enough ok pairs, so such a job has no ok pair in any shard it
    read; it would otherwise write a corpus of empty rows and report SUCCEEDED. Raised before
    anything is written, so the corrected command may claim the folder. Corrupt images and
    the like stay rows with a status: that is the data, not how it is read (a shard of
    corrupt images with a few missing fields among them scores as rows)."""
    _refuse_unreadable([st for r in held for st in r.status], [e for r in held for e in r.error], len(held), field)


def _check_first_shard_readable(uris: Sequence[str], options: ReadOptions, field: str | None, max_pixels: int,
                                time_limit_s: float | None = None) -> None:
    """``_check_some_pair_readable`` for jobs whose calibration reads no shard (no corpus
    needed, no judge): the samples of the first shards (at most ``_CHECK_SHARDS``), read and
    their images decoded (at a small draft size) without the model, until one pair is
    readable, as the corpus calibration reads on (a first shard of captionless samples
    before good ones is data, not a misnamed field). A shard that cannot be read says
    nothing here (the scoring reports it); nor does one that runs past ``time_limit_s``."""
    from pairclean.read.decode import DecodeFailure, decode_image

    statuses: list[str] = []
    errors: list[str | None] = []
    read = 0
    for uri in uris[:_CHECK_SHARDS]:
        if len(statuses) >= _CHECK_ROWS:
            break
        try:
            deadline = Deadline.after(time_limit_s) if time_limit_s is not None else None
            for pair in iter_pairs(uri, options, deadline=deadline):  # streamed: stops at the first readable pair
                if len(statuses) >= _CHECK_ROWS:
                    break
                status, error = pair.status, pair.error
                if status == schema.STATUS_OK and pair.image is not None:
                    image = decode_image(pair.image, max_pixels, draft_size=_CHECK_DRAFT)
                    if not isinstance(image, DecodeFailure):
                        return
                    status, error = image.status, image.error
                statuses.append(status)
                errors.append(error)
        except InputError:
            continue
        read += 1
    _refuse_unreadable(statuses, errors, read, field)


def _refuse_unreadable(statuses: Sequence[str], errors: Sequence[str | None], shards: int, field: str | None) -> None:
    counts: Counter[str] = Counter(statuses)
    rows = sum(counts.values())
    missing = sum(counts[status] for status in _MISSING)
    if not rows or counts[schema.STATUS_OK] or 2 * missing <= rows:
        return
    first = next((e for st, e in zip(statuses, errors) if st in _MISSING and e), "")
    told = ", ".join(f"{status}={n}" for status, n in sorted(counts.items()))
    hints = []
    if counts[schema.STATUS_MISSING_TEXT]:
        hints.append("check --caption-field" if field else
                     "captions are read from a txt member; name another member (--caption-field .caption) or a json field (--caption-field NAME)")
    if counts[schema.STATUS_MISSING_IMAGE]:
        hints.append("images are read from jpg/jpeg/png/webp members")
    raise InputError(f"no pair could be read from the first {shards} shard(s) ({rows} rows: {told}; "
                     f"e.g. {first}): {'; '.join(hints)}")


def judged_columns(result: ShardResult, calibration: Calibration, adjusted: NDArray[np.float32] | None) -> tuple[Any, dict[str, Any]]:
    """(the cascade's p_clean (N,), NaN where not judged; {judge_score column: llr (N,)}) of a
    judged ``result`` under ``calibration`` (with a judge record); ``adjusted``: the contrast's
    adjusted similarities (N,), None without a contrast. A job's workers and the notebook API
    (``pairclean.api.score_pairs`` with a job's calibration) both write through here.

    Calibration-phase shards were judged everywhere: pairs outside the frozen band are
    dropped here, so they read exactly as if scored after the calibration."""
    from pairclean.judge.posterior import in_band

    assert result.judge_llr is not None
    band = judge_band(calibration)
    assert band is not None
    llr = np.where(in_band(result.similarity, band) & result.ok_mask, result.judge_llr, np.nan).astype(np.float32)
    osa_p = osa_p_clean(result.similarity if adjusted is None else adjusted, calibration)
    return judged_p_clean(llr, osa_p, calibration.extra["judge"]), {schema.COL_JUDGE_SCORE: llr}


def judge_band(calibration: Calibration) -> tuple[float, float] | None:
    """The band frozen in ``calibration`` (None: the job has no judge)."""
    judge = calibration.extra.get("judge")
    if judge is None:
        return None
    lo, hi = judge["band"]
    return float(lo), float(hi)


class ShardWork:
    """One worker's state: a loaded estimator (and judge), the job spec and the output folder."""

    def __init__(self, estimator: Estimator, spec: JobSpec, out: OutputDir, options: ScoreOptions) -> None:
        self.estimator = estimator
        self.spec = spec
        self.out = out
        self.options = options
        self.model_info = estimator.info.as_dict()
        self.digest = spec_digest(spec)
        self.judge = _load_judge_runner(estimator, spec)
        self._contrast: tuple[str, Contrast] | None = None  # (its record as JSON, contrast), loaded once

    def random_beta(self) -> float:
        """beta of the random-inputs recipe for this estimator (cached on disk)."""
        return float(random_beta_fn(self.estimator, self.spec.beta_k, self.spec.seed)())

    def calibrate(self, uris: Sequence[str], time_limit_s: float | None = None) -> CalibrationOutcome:
        """The calibration phase over ``uris`` (in shard order); see the module docstring.

        Shards that cannot be read (or take longer than ``time_limit_s``, else the options'
        limit) are reported as failed outcomes (attempts 1); any other exception propagates
        (the caller retries the whole phase, which is deterministic).
        """
        options = self.options if time_limit_s is None else replace(self.options, time_limit_s=time_limit_s)
        dim = int(self.model_info["embed_dim"])
        if not needs_corpus(self.spec.beta_recipe, self.spec.weighting) and self.judge is None:
            _check_first_shard_readable(uris, options.read, self.spec.caption_field, self.spec.max_pixels,
                                        options.time_limit_s)
            return CalibrationOutcome(calibrate_on([], self.spec, self.random_beta, dim))
        held: list[ShardResult] = []
        outcomes: list[tuple[str, ShardResult | None, str | None]] = []
        ok = 0
        for uri in uris:
            if ok >= self.spec.calibration_pairs:
                break
            try:
                result = score_shard(uri, self.estimator, options, judge=self.judge)
            except InputError as exc:
                outcomes.append((uri, None, str(exc)))
                continue
            held.append(result)
            outcomes.append((uri, result, None))
            ok += int(result.ok_mask.sum())
        if not held:
            return CalibrationOutcome(None, [ShardOutcome(u, None, e) for u, _, e in outcomes])
        _check_some_pair_readable(held, self.spec.caption_field)
        identity = None if self.judge is None else self.judge.judge.identity()
        word_check = identity is not None and has_word_check(identity)
        calibration, contrast = fit_calibration(held, self.spec, self.random_beta, dim, word_check)
        if contrast is not None and "contrast" in calibration.extra:
            # the bank first: a worker that sees the calibration can always read its bank
            self.out.write_contrast_bank(contrast.bank)
            self._contrast = (_contrast_key(calibration.extra["contrast"]), contrast)
        if identity is not None:
            calibration = with_judge_record(
                calibration,
                lambda cal: judge_calibration(held, self.spec, cal, identity, self.contrast_of(cal)),
                lambda: fit_calibration(held, self.spec, self.random_beta, dim)[0])
            # before the calibration is frozen: a rescore refits the near-miss prior on these
            n = self.spec.calibration_pairs
            sims, ratios = calibration_similarities(held, n), calibration_ratios(held, n)
            if len(ratios) == len(sims):  # else a shard judged nothing: rescore reads the tables, as before
                self.out.write_judge_ratios(sims, ratios)
        written = [self._written(u, r, e, calibration) for u, r, e in outcomes]
        return CalibrationOutcome(calibration, written)

    def _written(self, uri: str, result: ShardResult | None, error: str | None, calibration: Calibration) -> ShardOutcome:
        """A calibration shard's outcome once its outputs are written: a shard whose table
        cannot be written (its name taken by someone else's file since the run began) fails
        alone, as it would in the scoring phase; it failed the job, every rerun again."""
        if result is None:
            return ShardOutcome(uri, None, error)
        try:
            return ShardOutcome(uri, self.write(result, calibration), None)
        except InputError as exc:
            return ShardOutcome(uri, None, str(exc))

    def score(self, uri: str, calibration: Calibration) -> ShardRecord:
        """Score one shard with the frozen ``calibration``, write its outputs, return its record.

        Raises ``InputError`` for a shard that cannot be read (the caller quarantines it).
        """
        band = judge_band(calibration)
        if (self.judge is None) != (band is None):
            raise InputError("the calibration and this worker disagree on whether the job has a judge")
        judge = self.judge.with_band(band) if self.judge is not None and band is not None else None
        return self.write(score_shard(uri, self.estimator, self.options, judge=judge), calibration)

    def write(self, result: ShardResult, calibration: Calibration) -> ShardRecord:
        """Build the score table (and sidecar) of ``result`` and write them into the folder."""
        started = time.perf_counter()
        stem = shard_stem(result.uri)
        extra_meta: dict[str, Any] = {"shard": result.uri, "recipe": _recipe(self.spec), "job": self.digest}
        second_stage = extra_scores = None
        adjusted, owner = table_columns(self.contrast_of(calibration), result.similarity, result.image_emb, result.text_emb,
                                        result.ok_mask, result.caption_words)
        if result.judge_llr is not None and "judge" in calibration.extra:
            second_stage, extra_scores = judged_columns(result, calibration, adjusted)
            extra_meta["judge"] = calibration.extra["judge"]
        meta = output_metadata(self.model_info, calibration, extra_meta)
        scores = scores_table(
            result.uri, result.keys, result.idx, result.status, result.error,
            result.similarity, calibration, meta, result.uid, result.url, result.members,
            second_stage=second_stage, extra_scores=extra_scores,
            # One schema per job (issue 23); folders of the older layout keep their rule so a
            # redone shard rewrites the same bytes.
            uid_url=not self.out.legacy,
            adjusted=adjusted, owner_margin=owner,
        )
        emb_name = emb_bytes = None
        if self.spec.embeddings:
            # The sidecar holds no beta: it stays valid when the job is rescored.
            emb_meta = {schema.META_KEY: json.dumps(
                {"pairclean_version": __version__, "model": self.model_info, "job": self.digest}, sort_keys=True
            ).encode()}
            table = embeddings_table(result.keys, result.image_emb, result.text_emb, result.ok_mask, emb_meta,
                                     result.caption_words)
            emb_name = self.out.emb_name(stem)
            emb_bytes = self.out.write_table(emb_name, table, job=self.digest).bytes
        # The score table last: once it exists, its sidecar does too.
        info = self.out.write_table(self.out.score_name(stem), scores, job=self.digest)
        timings = dict(result.timings)
        timings["write"] = round(time.perf_counter() - started, 4)
        return ShardRecord(
            # the size of what was read (a file replaced meanwhile is then seen as changed on resume)
            shard=result.uri, stem=stem,
            size=result.read_bytes if result.read_bytes is not None else shard_size(result.uri, self.options.read.storage_options),
            rows=len(result), output=self.out.score_name(stem), sha256=info.sha256, bytes=info.bytes,
            statuses=result.status_counts(), emb_output=emb_name, emb_bytes=emb_bytes, timings=timings,
            mtime_ns=result.read_mtime_ns,
        )

    def contrast_of(self, calibration: Calibration) -> Contrast | None:
        """The contrast frozen in ``calibration`` (its bank read from the folder once)."""
        doc = calibration.extra.get("contrast")
        if doc is None:
            return None
        if self._contrast is None or self._contrast[0] != _contrast_key(doc):
            loaded = self.out.read_contrast(calibration)
            assert loaded is not None
            self._contrast = (_contrast_key(doc), loaded)
        return self._contrast[1]

