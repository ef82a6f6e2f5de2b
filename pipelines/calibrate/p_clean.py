"""An honest ``p_clean``: the clean posterior of a mixture whose noise side is what the corpus shows.

The earlier ``p_clean`` was the posterior of a 2-component Gaussian mixture whose noise
component was pinned to random mismatched pairs of the corpus. Real noise is mostly not
random: a caption written for a similar image, or one word wrong, scores far above a
random pair, so that mixture called such pairs confidently clean (ECE about 0.5 when
half the pairs carry the caption of the most alike other image).

Recipe ``corpus-mixture`` (version ``VERSION``), pure functions over arrays:

1. *Noise references, from the calibration sample itself* (``noise_references``): the
   similarities of random mismatched pairs (what a random swap looks like), and of
   near-misses: each image with the caption of its most alike other image (image
   embeddings) and with the caption most alike its own caption (text embeddings).
   Neighbours that are near-duplicates (cosine >= ``DUPLICATE_COSINE``) are skipped: a
   copy of the same image or caption is not a wrong caption.
2. *A three-part mixture on the similarities*: ``pi_c * clean + pi_r * random +
   pi_h * near-miss``. Both noise parts are the references' own shapes (smoothed
   histograms, not Gaussians: a corpus's mismatched pairs are often skewed); the clean
   part is a Gaussian with free mean and spread. EM fits ``pi_r`` and the clean Gaussian.
3. *The near-miss share*: ``pi_h = share * (1 - pi_r)``. Where near-misses score well
   apart from the clean pairs, the likelihood says how many there are; where they overlap
   it cannot. Measured on Flickr8k dev with pairclean-lite (one pair per image): the
   profile log-likelihood of the share is flat within 10-20 nats per 1,000 pairs over
   0-0.7 and peaks at 0.4-0.5 whatever the true share, 0% near-misses included (the
   clean side's left tail looks like near-misses; nearest-image captions score AUC 0.63
   against the own caption). A free share called 63% of a corpus with 20% random swaps
   near-misses (clean pairs' mean p_clean 0.39). So the share is the grid value that
   maximises the log-likelihood minus ``SHARE_PENALTY`` nats per pair per unit share:
   a near-miss hump that stands apart gains far more than that and is taken; the
   overlap's flat profile is not. A judge that scored the calibration sample can supply
   its own estimate instead (``near_share``). Version 2: under the corpus contrast the
   share is at least the share of calibration pairs whose caption a better-fitting other
   image carries word for word (``contrast.copied_caption_share``; near-image noise at 20 /
   50% on Flickr8k dev: ECE 0.193 -> 0.072 / 0.496 -> 0.17, random swaps unchanged). Where a
   judge's word check multiplies ``p_clean`` the profile is left out (``profile=False``): the
   check measures the word-level near-misses the profile can only guess at. A fixed prior share was measured and not
   taken: 0.03 / 0.05 raised random-swap ECE at 20% from 0.031 to 0.051 / 0.060 and
   lowered the half-near-miss shard's ECE only from 0.50 to 0.47 / 0.45.
4. *A monotone curve*: the posterior is averaged over ``BOOTSTRAPS`` refits on
   resampled calibration pairs, made non-decreasing in the similarity by a weighted
   isotonic fit (weights: the fitted density, so the empty far tails cannot pull it),
   and given a strictly rising 1e-3 share of a logistic ramp, so ``p_clean`` ranks the
   pairs exactly as the similarity does: no plateaus (the pinned Gaussian mixture held
   p_clean constant outside its two means, tying up to 41% of the pairs).

The result is a table of knots (similarity -> p_clean) recorded in the job's
calibration, applied by linear interpolation (``PCleanCurve``), so ``pairclean rescore``
and resume reproduce it without the embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from pairclean.osa import isotonic

__all__ = [
    "RECIPE",
    "VERSION",
    "PCleanCurve",
    "NoiseReferences",
    "noise_references",
    "fit_p_clean",
    "fit_mixture_3",
    "unexplained_random",
]

RECIPE: Final = "corpus-mixture"
VERSION: Final = 2
#: Neighbours at least this alike (same modality) are copies, not near-misses.
DUPLICATE_COSINE: Final = 0.98
#: Calibration pairs whose neighbours are searched (an N x N product per modality).
MAX_NEIGHBOUR_PAIRS: Final = 4096
#: Refits on resampled pairs whose posteriors are averaged.
BOOTSTRAPS: Final = 16
#: Knots of the recorded curve.
KNOTS: Final = 257
#: Near-miss shares (of the pairs that are not random noise) the profile of step 3 tries.
SHARE_GRID: Final = tuple(round(0.05 * i, 2) for i in range(17))
#: Nats per pair per unit of near-miss share that a larger share must gain (step 3).
SHARE_PENALTY: Final = 0.1
#: Share of the strictly rising logistic ramp mixed into the curve (breaks ties only).
RAMP: Final = 1e-3
#: More of the calibration pairs at random level than the fitted random share explains by
#: this much, and the corpus holds noise of another shape (``unexplained_random``).
UNEXPLAINED_RANDOM: Final = 0.1

FloatArray = NDArray[np.float64]


@dataclass(frozen=True)
class PCleanCurve:
    """``p_clean`` as a monotone curve of the similarity, by linear interpolation of knots.

    Below the first knot it is the first knot's value, above the last the last's (both
    ends are far in the tails). NaN similarities get 0.
    """

    knots_s: tuple[float, ...]
    knots_p: tuple[float, ...]
    recipe: str = RECIPE
    version: int = VERSION
    fit: dict[str, Any] = field(default_factory=dict)

    def __call__(self, s: NDArray[Any]) -> NDArray[np.float32]:
        x = np.asarray(s, dtype=np.float64)
        p = np.interp(np.nan_to_num(x, nan=-np.inf), np.asarray(self.knots_s), np.asarray(self.knots_p))
        return np.where(np.isfinite(x), p, 0.0).astype(np.float32)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``from_json`` inverts it)."""
        return {"recipe": self.recipe, "version": self.version, "knots_s": list(self.knots_s), "knots_p": list(self.knots_p), "fit": self.fit}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PCleanCurve:
        """Inverse of ``to_json``; refuses a recipe or version this release cannot apply."""
        if doc.get("recipe") != RECIPE or int(doc.get("version", -1)) > VERSION:
            raise ValueError(f"p_clean recipe {doc.get('recipe')!r} version {doc.get('version')!r} is not known to this release")
        return cls(tuple(map(float, doc["knots_s"])), tuple(map(float, doc["knots_p"])), doc["recipe"], int(doc["version"]), dict(doc.get("fit", {})))


@dataclass(frozen=True)
class NoiseReferences:
    """Similarities of what noise looks like in this corpus: random and near-miss pairs."""

    random: FloatArray
    near_miss: FloatArray


def _nearest_other(emb: NDArray[Any], block: int = 1024, copy: float = DUPLICATE_COSINE) -> tuple[NDArray[np.int64], FloatArray]:
    """For each row of (N, D) normalised rows: the most alike other row below ``copy``
    (index, cosine); index -1 where there is none."""
    emb = np.asarray(emb, dtype=np.float32)
    n = emb.shape[0]
    idx = np.full(n, -1, dtype=np.int64)
    best = np.full(n, -np.inf)
    for start in range(0, n, block):
        sims = emb[start : start + block] @ emb.T
        rows = np.arange(sims.shape[0])
        sims[rows, rows + start] = -np.inf  # not itself
        sims[sims >= copy] = -np.inf  # nor a copy of itself
        j = sims.argmax(1)
        idx[start : start + block] = j
        best[start : start + block] = sims[rows, j]
    idx[~np.isfinite(best)] = -1
    return idx, best


def noise_references(image_emb: NDArray[Any], text_emb: NDArray[Any], random_sims: NDArray[Any], seed: int,
                     pair_scores: Callable[[NDArray[np.int64], NDArray[np.int64]], NDArray[Any]] | None = None,
                     image_copy: float = DUPLICATE_COSINE) -> NoiseReferences:
    """The noise references of step 1 from (N, D) ok-pair embeddings (first
    ``MAX_NEIGHBOUR_PAIRS`` searched) and the (M,) random mismatched similarities.

    ``pair_scores(i, j)``: the score of image i with the caption of pair j, when the
    calibration is fitted on another score than the cosine (``contrast``). ``image_copy``:
    images at least this alike are copies (the estimator's, ``contrast.image_copy_cosine_for``)."""
    img = np.asarray(image_emb, dtype=np.float32)[:MAX_NEIGHBOUR_PAIRS]
    txt = np.asarray(text_emb, dtype=np.float32)[:MAX_NEIGHBOUR_PAIRS]
    parts = []
    for j, _ in (_nearest_other(img, copy=image_copy), _nearest_other(txt)):
        has = j >= 0
        if pair_scores is not None:
            parts.append(np.asarray(pair_scores(np.nonzero(has)[0], j[has]), dtype=np.float64))
            continue
        parts.append((img[has] * txt[j[has]]).sum(1))
    near = np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)
    rnd = np.asarray(random_sims, dtype=np.float64)
    return NoiseReferences(rnd[np.isfinite(rnd)], near[np.isfinite(near)])


def _density(ref: FloatArray, grid: FloatArray) -> FloatArray:
    """A smoothed histogram of ``ref`` on the evenly spaced ``grid`` (a density, Silverman bandwidth)."""
    step = grid[1] - grid[0]
    bw = max(1.06 * float(np.std(ref)) * ref.size ** (-0.2), 2 * step, 1e-4)
    hist, _ = np.histogram(ref, bins=grid.size, range=(grid[0] - step / 2, grid[-1] + step / 2))
    # At most the grid's width: np.convolve(mode="same") returns the longer of its inputs, so a
    # kernel wider than the grid (a few wide references, tiny jobs) would not line up with it.
    half = min(int(np.ceil(4 * bw / step)), (grid.size - 1) // 2)
    kernel = np.exp(-0.5 * (np.arange(-half, half + 1) * step / bw) ** 2)
    dens = np.convolve(hist.astype(np.float64), kernel / kernel.sum(), mode="same")
    out: FloatArray = np.maximum(dens / max(dens.sum() * step, 1e-300), 1e-12)
    return out


def _normal(x: FloatArray, mean: float, std: float) -> FloatArray:
    out: FloatArray = np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * np.sqrt(2 * np.pi))
    return out


def unexplained_random(fit: dict[str, Any]) -> float | None:
    """The share of calibration pairs at random level that the fitted random part does not
    explain, where it exceeds ``UNEXPLAINED_RANDOM``; else None (also for fits recorded
    without ``random_level``). ``fit``: a curve's recorded fit, whose ``random_level`` (written
    by ``calibration.calibrate``) holds the share of pairs whose similarity is below the
    ``quantile`` point of the sample's mismatched pairs; random mismatches fall below it with
    that probability, so ``share - quantile * pi_random`` is what the random part leaves out.

    Why: where much of a corpus is noise of another shape than the random references
    (placeholder images served for failed downloads, boilerplate captions), the mixture widens
    its clean part over it and calls many such pairs clean. On the hard-noise benchmark
    (Flickr8k dev, contrast version 4) the gap is -0.03 to +0.05 on every set but those
    corpora at 50% (+0.28 placeholders, where 24% of them got p_clean above 0.9, and +0.40
    boilerplate); a clean sample whose similarities are skewed has few pairs at random level
    and is not read as junk (a spread-based check was, ``docs/hard_noise.md``)."""
    level = fit.get("random_level")
    if not isinstance(level, dict):
        return None
    values = (level.get("share"), level.get("quantile"), fit.get("pi_random"))
    try:  # a huge integer in damaged metadata raised OverflowError (a 500 in the REST job)
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    except OverflowError:
        return None
    if len(numbers) != 3 or not all(np.isfinite(numbers)):
        return None
    share, quantile, pi_random = numbers
    gap = share - quantile * pi_random
    return gap if gap > UNEXPLAINED_RANDOM else None


def fit_mixture_3(x: FloatArray, f_random: FloatArray, f_near: FloatArray, near_share: float, iters: int = 300) -> dict[str, float]:
    """EM of step 2 on (N,) similarities ``x`` given the two noise densities evaluated at ``x``.

    The near-miss weight is held at ``near_share`` of the pairs that are not random noise
    (``pi_near = near_share * (1 - pi_random)``); EM fits ``pi_random`` and the clean
    Gaussian's ``mean`` and ``std``, starting on the upper half of ``x``. Returns the three
    weights and the Gaussian.
    """
    upper = x[x > np.median(x)]
    upper = upper if upper.size else x
    mu, sd = float(upper.mean()), max(float(upper.std()), 1e-3)
    q = float(np.clip(near_share, 0.0, 0.99))
    pi_r = 0.25
    for _ in range(iters):
        pi_h = q * (1 - pi_r)
        lik = np.stack([(1 - pi_r - pi_h) * _normal(x, mu, sd), pi_r * f_random, pi_h * f_near])
        r = lik / np.maximum(lik.sum(0), 1e-300)
        new = float(r[1].mean())
        w = r[0]
        mu = float((w * x).sum() / max(w.sum(), 1e-12))
        sd = max(float(np.sqrt((w * (x - mu) ** 2).sum() / max(w.sum(), 1e-12))), 1e-3)
        done = abs(new - pi_r) < 1e-7
        pi_r = new
        if done:
            break
    pi_h = q * (1 - pi_r)
    return {"pi_clean": 1 - pi_r - pi_h, "pi_random": pi_r, "pi_near": pi_h, "mean": mu, "std": sd}


def _log_likelihood(x: FloatArray, f_random: FloatArray, f_near: FloatArray, fit: dict[str, float]) -> float:
    lik = fit["pi_clean"] * _normal(x, fit["mean"], fit["std"]) + fit["pi_random"] * f_random + fit["pi_near"] * f_near
    return float(np.log(np.maximum(lik, 1e-300)).sum())


def choose_near_share(x: FloatArray, f_random: FloatArray, f_near: FloatArray, penalty: float = SHARE_PENALTY) -> tuple[float, list[float]]:
    """The near-miss share of step 3: the grid value maximising the log-likelihood minus
    ``penalty * N * share`` (nats). Returns it and the profile (log-likelihood per grid value)."""
    profile = [_log_likelihood(x, f_random, f_near, fit_mixture_3(x, f_random, f_near, q)) for q in SHARE_GRID]
    gains = [ll - penalty * x.size * q for ll, q in zip(profile, SHARE_GRID)]
    return float(SHARE_GRID[int(np.argmax(gains))]), profile


def fit_p_clean(
    similarities: NDArray[Any], refs: NoiseReferences, seed: int, near_share: float | None = None, bootstraps: int = BOOTSTRAPS,
    min_near_share: float = 0.0, profile: bool = True,
) -> PCleanCurve:
    """Steps 2-4 on (N,) calibration similarities (N >= 16) and the corpus's noise references.

    ``near_share``: the share of near-misses among the pairs that are not random noise;
    when None, the penalised profile of step 3; a judge that has scored the calibration
    sample can supply its own estimate.
    ``min_near_share``: a floor under the profile's choice, from evidence the similarity
    cannot see (``contrast.copied_caption_share``: captions that a better-fitting other image
    of the corpus carries word for word).
    ``profile``: False leaves the profile's guess out (the share is ``min_near_share``), for a
    ``p_clean`` that a judge's word check multiplies: that check measures the word-level
    near-misses the profile can only guess at, and counting them in both factors made clean
    pairs too unsure (hard-noise benchmark, one-word edits at 20%: ECE 0.060 -> 0.038,
    clean pairs' mean p_clean 0.818 -> 0.887).
    """
    x = np.asarray(similarities, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 16 or refs.random.size < 4:
        raise ValueError("the corpus-mixture p_clean needs at least 16 similarities and 4 random pairs")
    near = refs.near_miss if refs.near_miss.size >= 4 else refs.random
    lo = float(min(x.min(), refs.random.min(), near.min()))
    hi = float(max(x.max(), refs.random.max(), near.max()))
    pad = 0.05 * (hi - lo) + 1e-3
    grid = np.linspace(lo - pad, hi + pad, 2048)
    d_random, d_near = _density(refs.random, grid), _density(near, grid)
    profile_ll: list[float] = []
    source = "given"
    if near_share is None and not profile:
        q, source = float(min_near_share), "copies only (a word check counts the rest)"
    elif near_share is None:
        q, profile_ll = choose_near_share(x, np.interp(x, grid, d_random), np.interp(x, grid, d_near))
        source = "profile"
        if min_near_share > q:  # the corpus shows at least this many near-misses (e.g. copied captions)
            q, source = float(min_near_share), "copies"
    else:
        q = float(near_share)
    rng = np.random.default_rng(seed)
    curves, fits, mass = [], [], []
    for b in range(max(1, bootstraps)):
        sample = x if b == 0 else rng.choice(x, size=x.size, replace=True)
        fit = fit_mixture_3(sample, np.interp(sample, grid, d_random), np.interp(sample, grid, d_near), q)
        clean = fit["pi_clean"] * _normal(grid, fit["mean"], fit["std"])
        total = clean + fit["pi_random"] * d_random + fit["pi_near"] * d_near
        curves.append(clean / np.maximum(total, 1e-300))
        mass.append(total)
        fits.append(fit)
    # Monotone where the corpus has pairs: weighted by the fitted density, so the far tails
    # (where every part's density is ~0 and the ratio is noise) cannot pull the curve.
    post = isotonic(np.mean(curves, axis=0), np.mean(mass, axis=0) + 1e-9)
    centre, scale = float(np.median(x)), max(float(np.std(x)), 1e-3)
    ramp = 1.0 / (1.0 + np.exp(-(grid - centre) / scale))
    post = (1 - RAMP) * post + RAMP * ramp  # strictly rising: p_clean ranks exactly as the similarity
    knots = np.linspace(0, grid.size - 1, KNOTS).round().astype(int)
    summary: dict[str, Any] = {k: float(np.mean([f[k] for f in fits])) for k in fits[0]}
    summary.update({"near_share": q, "near_share_source": source, "min_near_share": float(min_near_share),
                    "share_profile": [round(v - profile_ll[0], 2) for v in profile_ll] if profile_ll else [],
                    "pi_random_spread": float(np.std([f["pi_random"] for f in fits])), "bootstraps": len(fits),
                    "calibration_pairs": int(x.size), "random_pairs": int(refs.random.size), "near_miss_pairs": int(near.size),
                    "near_miss_mean": float(near.mean()), "random_mean": float(refs.random.mean())})
    return PCleanCurve(tuple(float(v) for v in grid[knots]), tuple(float(v) for v in post[knots]), fit=summary)
