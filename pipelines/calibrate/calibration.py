"""Resolving beta and the weighting parameters of a job (its ``Calibration``).

``random-inputs`` needs only the model (and is cached per model, precision, K and seed);
``shuffled`` and ``gmm`` and the ``reference`` and ``p-clean`` weightings need corpus data: the first
``calibration_pairs`` ok pairs of the job in shard order, so that a resumed or repeated
job freezes the same values.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pairclean import osa
from pairclean.calibrate import p_clean as p_clean_model
from pairclean.calibrate.contrast import (MIN_GATE_PAIRS, RANDOM_FIT_QUANTILE, SAME_IMAGE_COSINE, Contrast, copied_caption_share,
                                        random_fit)
from pairclean.errors import InputError
from pairclean.storage import write_file_atomic

__all__ = ["Calibration", "needs_corpus", "calibrate", "cache_dir", "cached_random_beta"]

RandomBeta = Callable[[], float]

log = logging.getLogger(__name__)


def _is_number(value: Any, whole: bool = False) -> bool:
    """A finite number (a whole one where ``whole``), not a bool."""
    return isinstance(value, int if whole else (int, float)) and not isinstance(value, bool) and (whole or math.isfinite(value))


@dataclass(frozen=True)
class Calibration:
    """The resolved beta and weighting parameters of a job, frozen once computed."""

    beta: float
    recipe: str
    k: int
    seed: int
    weighting: str
    d_ref: float | None = None
    weighting_batch_size: int | None = None
    noise_rate: float | None = None
    calibration_pairs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: The corpus contrast's bank ((2, rows, dim) float16) when this calibration has a
    #: contrast and was loaded with it (``pairclean.api.load_calibration`` of a job folder);
    #: not part of the JSON (the job keeps it in ``OUT.pairclean/state/contrast-bank.npy``).
    bank: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Any) -> Calibration:
        """Inverse of ``to_json``; ``TypeError`` naming the first field that is missing or
        not of the type ``calibrate`` writes (``beta: "x"`` or ``extra: []`` in a damaged
        calibration.json got as far as a ValueError or AttributeError traceback in score,
        refine and rescore)."""
        if not isinstance(doc, dict):
            raise TypeError("it is not a JSON object")
        cal = cls(**doc)
        wholes = ("k", "seed", "weighting_batch_size", "calibration_pairs")
        checks = {"beta": _is_number(cal.beta), "recipe": isinstance(cal.recipe, str), "k": _is_number(cal.k, whole=True),
                  "seed": _is_number(cal.seed, whole=True), "weighting": isinstance(cal.weighting, str),
                  "extra": isinstance(cal.extra, dict),
                  **{name: getattr(cal, name) is None or _is_number(getattr(cal, name), whole=name in wholes)
                     for name in ("d_ref", "weighting_batch_size", "noise_rate", "calibration_pairs")}}
        bad = next((name for name, ok in checks.items() if not ok), None)
        if bad is not None:
            raise TypeError(f"its {bad} is {getattr(cal, bad)!r}")
        return cal

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (without ``bank``)."""
        doc = asdict(replace(self, bank=None))
        del doc["bank"]
        return doc

    def mixture(self) -> tuple[tuple[float, float], tuple[float, float], float] | None:
        """The pinned mixture recorded in ``extra`` as ((noise, clean) means, (noise, clean)
        stds, noise weight); None for a job of fewer than 16 ok pairs (or an older calibration)."""
        if "gmm_stds" not in self.extra or "gmm_noise_weight" not in self.extra:
            return None
        means, stds = self.extra["gmm_means"], self.extra["gmm_stds"]
        return (float(means[0]), float(means[1])), (float(stds[0]), float(stds[1])), float(self.extra["gmm_noise_weight"])

    def p_clean_curve(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """The ``p_clean`` curve recorded in ``extra["p_clean"]`` (similarity knots, p_clean
        knots); None for a calibration without one (fewer than 16 pairs, no embeddings, or
        written before the curve existed: those keep the pinned mixture)."""
        doc = self.extra.get("p_clean")
        if not doc:
            return None
        return tuple(map(float, doc["knots_s"])), tuple(map(float, doc["knots_p"]))

    def p_clean_params(self) -> osa.WeightingParams:
        """The ``p-clean`` weighting of this calibration: what every table's ``p_clean`` is."""
        return osa.WeightingParams("p-clean", mixture=self.mixture(), curve=self.p_clean_curve())

    def weighting_params(self) -> osa.WeightingParams:
        """The weighting as frozen here (``p-clean`` takes ``mixture()``; without one it is
        the hard ``s > beta``)."""
        if self.weighting == "p-clean":
            return self.p_clean_params()
        return osa.WeightingParams(self.weighting, self.d_ref, self.weighting_batch_size)


#: Fewer ok pairs than this and no mixture is fitted (no gmm beta, no noise-rate estimate).
MIN_MIXTURE_PAIRS = 16


#: Random mismatched pairs scored for the noise side under a contrast (each costs a bank pass).
MAX_CONTRAST_RANDOM = 2048

PairScores = Callable[[NDArray[np.int64], NDArray[np.int64]], NDArray[np.float32]]


def _contrast_pair_scores(contrast: Contrast, image_emb: NDArray[np.float32], text_emb: NDArray[np.float32]) -> PairScores:
    """Adjusted similarity of (image i, caption of pair j) for index arrays ``i``, ``j``: the
    bank leaves out pair i and the caption's own pair j (real noise's source image is often
    not in the bank: scoring the references without it keeps p_clean conservative)."""

    def score(i: NDArray[np.int64], j: NDArray[np.int64]) -> NDArray[np.float32]:
        img, txt = image_emb[i], text_emb[j]
        source = np.where(j < contrast.bank.shape[1], j, -1).astype(np.int64)
        return contrast.adjust(osa.cosine_rows(img, txt), img, txt, source=source)

    return score


def needs_corpus(beta_recipe: str, weighting: str) -> bool:
    """Whether calibration must see corpus pairs before any shard can be written."""
    return beta_recipe != "random-inputs" or weighting in ("reference", "p-clean")


def cache_dir() -> Path:
    """``$PAIRCLEAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/pairclean``, else ``~/.cache/pairclean``."""
    explicit = os.environ.get("PAIRCLEAN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pairclean"


def cached_random_beta(identity: Mapping[str, object], compute: RandomBeta) -> float:
    """beta of the random-inputs recipe, computed once per ``identity`` and cached on disk.

    ``identity`` must hold everything beta depends on (model id, checkpoint sha256,
    precision, K, seed).
    """
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    path = cache_dir() / "beta" / f"{key}.json"
    if path.exists():
        try:
            return float(json.loads(path.read_text())["beta"])
        except (ValueError, KeyError, json.JSONDecodeError):
            pass  # a damaged cache entry is recomputed
    beta = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, json.dumps({"beta": beta, "identity": identity}, sort_keys=True).encode())
    return beta


def _random_level(similarities: NDArray[np.float32], image_emb: NDArray[np.float32],
                  text_emb: NDArray[np.float32]) -> dict[str, float] | None:
    """How many calibration pairs fit at random level: the share of ``similarities`` (N,)
    below the ``contrast.RANDOM_FIT_QUANTILE`` point of the sample's mismatched pairs
    (``contrast.random_fit``), recorded in the p_clean fit for ``p_clean.unexplained_random``;
    None for fewer than ``contrast.MIN_GATE_PAIRS`` pairs (a share of a few dozen pairs says
    little: the tiny test model's 24 pairs read 25% unexplained)."""
    if len(image_emb) < MIN_GATE_PAIRS:
        return None
    threshold = random_fit(image_emb, text_emb)
    if not np.isfinite(threshold):
        return None
    x = np.asarray(similarities, dtype=np.float64)
    x = x[np.isfinite(x)]
    return {"threshold": threshold, "quantile": RANDOM_FIT_QUANTILE, "share": float((x < threshold).mean()) if x.size else 0.0}


def calibrate(
    *,
    beta_recipe: str,
    k: int,
    seed: int,
    weighting: str,
    batch_size: int,
    similarities: NDArray[np.float32],
    image_emb: NDArray[np.float32] | None,
    text_emb: NDArray[np.float32] | None,
    random_beta: RandomBeta,
    contrast: Contrast | None = None,
    word_check: bool = False,
) -> Calibration:
    """Resolve beta and the weighting parameters from ok-pair arrays.

    ``similarities``: (N,) of ok pairs; ``image_emb``/``text_emb``: (N, D), needed by
    ``shuffled`` only. ``shuffled`` averages ``k * k`` random mismatched pairs so that both
    recipes average the same number of cosines at the same K. The mixture (``gmm`` recipe,
    noise-rate estimate) pins its noise component to those mismatched pairs when embeddings
    are given. The noise-rate estimate is reported whenever there are 16 or more pairs.

    ``contrast`` (with embeddings): everything is fitted on the adjusted similarities
    (``pairclean.calibrate.contrast``), the noise references included; recorded in
    ``extra["contrast"]``.

    ``word_check``: a judge's word check will multiply ``p_clean``, so its near-miss share is
    what copied captions show, not the similarity profile's guess (``fit_p_clean(profile=False)``).
    """
    sims = np.asarray(similarities, dtype=np.float32)
    fallback: dict[str, str] = {}
    noise = None
    pair_scores = None
    if contrast is not None and image_emb is not None and text_emb is not None:
        sims = contrast.adjust(sims, image_emb[: sims.size], text_emb[: sims.size])
        pair_scores = _contrast_pair_scores(contrast, image_emb, text_emb)
        if len(image_emb) >= 2:
            noise = pair_scores(*osa.mismatched_pairs(len(image_emb), min(k * k, MAX_CONTRAST_RANDOM), seed))
    elif image_emb is not None and text_emb is not None and len(image_emb) >= 2:
        # what random mispairing looks like in this corpus: pins the mixture's noise side
        noise = osa.shuffled_similarities(image_emb, text_emb, k * k, seed)
    gmm = osa.fit_gmm(sims, seed, noise_sims=noise) if np.isfinite(sims).sum() >= MIN_MIXTURE_PAIRS else None
    if beta_recipe == "random-inputs":
        beta = random_beta()
    elif beta_recipe == "shuffled":
        if image_emb is None or text_emb is None or len(image_emb) < 2:
            raise InputError("the shuffled recipe needs the embeddings of at least 2 ok pairs; "
                             "this job has fewer (use --beta-recipe gmm or random-inputs)")
        beta = osa.beta_shuffled(image_emb, text_emb, k * k, seed)
    elif beta_recipe == "gmm":
        if gmm is None:
            # Too few pairs for a mixture (a tiny job): fall back to the reference recipe
            # and say so in the calibration, rather than fail the job.
            log.warning("only %d ok pairs: the gmm recipe needs 16; using random-inputs", sims.size)
            beta, fallback = random_beta(), {"requested_recipe": "gmm", "fallback": "fewer than 16 ok pairs"}
            beta_recipe = "random-inputs"
        else:
            beta = gmm.boundary
    else:
        osa.check_method(beta_recipe, weighting)
        raise AssertionError("unreachable: check_method raised")
    params = osa.weighting_params(weighting, sims, beta, batch_size, gmm)
    curve = None
    if noise is not None and image_emb is not None and text_emb is not None and np.isfinite(sims).sum() >= MIN_MIXTURE_PAIRS:
        # p_clean from what the corpus shows (random and near-miss pairs), not a pinned Gaussian
        refs = p_clean_model.noise_references(image_emb, text_emb, noise, seed, pair_scores=pair_scores,
                                              image_copy=SAME_IMAGE_COSINE if contrast is None else contrast.image_copy_cosine)
        # under a contrast, copied captions give a floor on the near-miss share (contrast.py)
        floor = (copied_caption_share(similarities, image_emb, text_emb, min_fit=contrast.owner_min_fit,
                                      image_copy=contrast.image_copy_cosine)
                 if pair_scores is not None and contrast is not None else 0.0)
        curve = p_clean_model.fit_p_clean(sims, refs, seed, min_near_share=floor, profile=not word_check).to_json()
        level = _random_level(similarities, image_emb, text_emb)
        if level is not None:
            curve["fit"]["random_level"] = level
        if (level is not None and contrast is not None and pair_scores is not None and contrast.caption_floor is not None
                and contrast.random_fit is None and p_clean_model.unexplained_random(curve["fit"]) is not None):
            # A junk-heavy corpus (more pairs at random level than the random part explains: the
            # clean part widened over noise the references do not describe): calibrate once more
            # with every rival of a random-level pair gated (contrast.random_fit). Only here: on
            # other corpora that gate cost near-misses (``docs/hard_noise.md``, contrast version 4).
            return calibrate(beta_recipe=beta_recipe, k=k, seed=seed, weighting=weighting, batch_size=batch_size,
                             similarities=similarities, image_emb=image_emb, text_emb=text_emb, random_beta=random_beta,
                             contrast=replace(contrast, random_fit=level["threshold"]), word_check=word_check)
    return Calibration(
        beta=float(beta),
        recipe=beta_recipe,
        k=k,
        seed=seed,
        weighting=weighting,
        d_ref=params.d_ref,
        weighting_batch_size=params.batch_size,
        noise_rate=osa.estimate_noise_rate(sims, seed, noise) if gmm else None,
        calibration_pairs=int(sims.size),
        extra={**fallback, **({"p_clean": curve} if curve else {}),
               **({"contrast": contrast.to_json()} if pair_scores is not None and contrast is not None else {}), **({"gmm_means": list(gmm.means), "gmm_stds": list(gmm.stds), "gmm_noise_weight": gmm.noise_rate,
                                 "gmm_boundary": gmm.boundary} if gmm else {})},
    )
