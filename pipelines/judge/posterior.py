"""The judge's p_clean and the cascade's band: pure functions over arrays.

The judge's weights file carries a Platt map fitted on Flickr8k dev (clean pairs against
every noise kind, classes weighted equally): ``llr = a * logit + b`` is the judge's log
likelihood ratio of clean against noisy at even odds. A corpus has its own prior (how much
of it is noise); ``estimate_prior`` finds it from the judge's ratios on the calibration
sample (the EM of Saerens et al., 2002: the prior that the posteriors average back to), so
the noise model is fitted on what the corpus shows, near-misses included. Then
``p_clean = sigmoid(llr + logit(prior))``: where the judge cannot tell (llr near 0), p_clean
is the corpus prior, never a confident answer.

A judge whose weights carry a second Platt map, ``platt_fine`` (clean pairs against
one-word edits only: see ``pairclean.lite.judge_train.fit_platts``), is combined with OSA instead
of replacing it (``combined_p_clean``): a pair is clean when it passes both tests, OSA's
(is this caption about this photo at all: random and near-image mismatches, calibrated on
the corpus) and the judge's (given that, is every word right). The judge's near-miss prior
is estimated on the calibration pairs, each weighted by OSA's p_clean (the pairs OSA
already calls mismatched say nothing about near-misses): by an adjusted count where the
judge carries its dev pass rates (``adjusted_count``), else by the same EM. So on a corpus of random swaps,
the judge barely moves OSA's calibrated p_clean; on a corpus of one-word edits, which OSA
cannot see, p_clean drops by the judge's posterior.

The judge knows Flickr8k-like photos and words; ``fine_prior_or_reason`` keeps its factor
off where its prior cannot be trusted: fewer than ``MIN_FINE_PAIRS`` calibration pairs (the
bundled 10-pair demo), or an estimate below ``MIN_FINE_PRIOR`` (the judge would call most
of the pairs OSA accepts wrong in a word, which says more about the corpus being outside
what it learned, e.g. rockets and coins, than about the corpus). OSA's outputs then stay.

The band: the judge runs on pairs whose OSA similarity lies in ``[lo, hi]``;
``choose_band`` puts a window holding ``budget`` of the calibration pairs where the judge's
p_clean differs most from OSA's (where judging can change the answer).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

__all__ = ["FULL_BAND", "MIN_FINE_PAIRS", "MIN_FINE_PRIOR", "MIN_RATE_GAP", "FINE_PRIOR_MAX", "platt_fit", "llr_of", "fine_llr", "estimate_prior",
           "adjusted_count", "fine_prior_or_reason",
           "p_clean_of", "combined_p_clean", "choose_band", "in_band"]

#: The band of ``--judge all``: every ok pair.
FULL_BAND: tuple[float, float] = (-math.inf, math.inf)

_PRIOR_RANGE = (0.02, 0.98)
#: The adjusted count's upper bound (``adjusted_count``): a corpus without one-word errors
#: counts at about 1, and a sample of 1,000 pairs sizes it to about +-0.03, so 0.98 (EM's
#: bound) held a clean corpus's word check a hedge below what its own count said. Measured
#: on the hard-noise benchmark (``--rescore-from``, Flickr8k dev): random swaps' ECE 0.037 ->
#: 0.031 (20%) and 0.054 -> 0.048 (50%), near-image 0.072 -> 0.067, every other set
#: unchanged (their counts are below 0.98); 0.999 moved nothing further by more than 0.001.
FINE_PRIOR_MAX = 0.995

#: The adjusted count (``adjusted_count``) needs the word check's two rates at least this far apart.
MIN_RATE_GAP = 0.2
#: Fewer calibration pairs than this and the judge's near-miss prior is not estimated.
MIN_FINE_PAIRS = 100
#: A near-miss prior below this (most OSA-clean pairs wrong in a word) turns the factor off.
#: On the hard-noise benchmark (Flickr8k dev) it is 0.82-0.98 except at 50% one-word edits
#: (0.56, the adjusted count); on the bundled demo's ten off-domain photos 0.47 (EM).
MIN_FINE_PRIOR = 0.5


def platt_fit(logits: NDArray[np.floating], labels: NDArray[np.bool_], iters: int = 100) -> tuple[float, float]:
    """(a, b) of the logistic map ``sigmoid(a * logit + b)`` fitted to ``labels`` (N,) (True =
    clean) with both classes weighted equally: Newton's method on the weighted log-loss with
    step halving (a plain Newton step can overshoot into a huge slope when the classes
    barely overlap).

    Hand-written (a few lines) rather than scikit-learn so that the library's judge needs no
    scikit-learn at scoring time, and the weighting is exactly "equal class totals".
    """
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    w = np.where(y > 0, 0.5 / max(1.0, y.sum()), 0.5 / max(1.0, (1 - y).sum()))
    x = np.stack([z, np.ones_like(z)], axis=1)

    def loss(theta: NDArray[np.float64]) -> float:
        t = x @ theta
        # log(1 + exp(-t)) for clean, log(1 + exp(t)) for noisy, computed stably
        return float(np.sum(w * np.logaddexp(0.0, np.where(y > 0, -t, t))))

    theta = np.array([1.0, 0.0])
    current = loss(theta)
    for _ in range(iters):
        p = _sigmoid(x @ theta)
        grad = x.T @ (w * (p - y))
        hess = (x * (w * p * (1 - p))[:, None]).T @ x + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        scale = 1.0
        while scale > 1e-6 and loss(theta - scale * step) > current:
            scale *= 0.5
        theta = theta - scale * step
        new = loss(theta)
        if current - new < 1e-12:
            break
        current = new
    return float(theta[0]), float(theta[1])


def llr_of(logits: NDArray[np.floating], platt: tuple[float, float]) -> NDArray[np.float32]:
    """Log likelihood ratios (N,) clean : noisy of the judge's raw ``logits`` (N,)."""
    a, b = platt
    return (a * np.asarray(logits, np.float64) + b).astype(np.float32)


def _sigmoid(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return 0.5 * (1 + np.tanh(0.5 * x))


def fine_llr(llr: NDArray[np.floating], platt: tuple[float, float], platt_fine: tuple[float, float]) -> NDArray[np.float32]:
    """The ratios ``llr`` (N,) of the judge's general Platt map ``platt``, re-mapped by its
    near-miss map ``platt_fine`` (both act on the same raw logit)."""
    a, b = platt
    logits = (np.asarray(llr, np.float64) - b) / a
    return llr_of(logits, platt_fine)


def _weighted(llr: NDArray[np.floating], weights: NDArray[np.floating] | None) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(ratios, weights) as float64, the pairs where either is not finite left out (weights 1 when None)."""
    x = np.asarray(llr, np.float64)
    w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64)
    keep = np.isfinite(x) & np.isfinite(w)
    return x[keep], w[keep]


def estimate_prior(llr: NDArray[np.floating], iters: int = 200, weights: NDArray[np.floating] | None = None) -> float:
    """The clean fraction of a corpus from the judge's ratios ``llr`` (N,) of a sample of it.

    Fixed point of ``prior = mean(sigmoid(llr + logit(prior)))`` (a ``weights``-weighted
    mean when given, (N,) >= 0), clipped to [0.02, 0.98] (a sample of a few thousand pairs
    cannot support a more extreme prior). 0.5 when empty or weightless.
    """
    x, w = _weighted(llr, weights)
    if x.size == 0 or w.sum() <= 0:
        return 0.5
    prior = 0.5
    for _ in range(iters):
        new = float(np.clip(np.average(_sigmoid(x + math.log(prior / (1 - prior))), weights=w), *_PRIOR_RANGE))
        if abs(new - prior) < 1e-7:
            break
        prior = new
    return prior


def adjusted_count(llr: NDArray[np.floating], rates: tuple[float, float], weights: NDArray[np.floating] | None = None) -> float | None:
    """The clean fraction of a corpus by adjusted classify-and-count (Forman 2008): the
    (``weights``-weighted) share of ratios ``llr`` (N,) above 0, corrected by the rates at
    which clean pairs (``rates[0]``) and noisy ones (``rates[1]``) pass that test on dev:
    ``(share - rates[1]) / (rates[0] - rates[1])``, clipped to [0.02, ``FINE_PRIOR_MAX``].
    None when the rates are closer than ``MIN_RATE_GAP`` or no pair counts.

    Why, for the word check: EM (``estimate_prior``) trusts the ratios' every value, and the
    near-miss map's shape is only roughly right across its range; on the hard-noise
    benchmark's one-word-edit corpora EM put the share of pairs with every word right
    0.04-0.05 too high (0.579 for 0.533 at 50%), while the count needs the map to be right
    at one point only (0.555; through `pairclean score`, ECE 0.061 -> 0.051 at 50% and
    0.038 -> 0.024 at 20%).
    """
    tpr, fpr = rates
    x, w = _weighted(llr, weights)
    if tpr - fpr < MIN_RATE_GAP or x.size == 0 or w.sum() <= 0:
        return None
    share = float(np.average(x > 0, weights=w))
    return float(np.clip((share - fpr) / (tpr - fpr), _PRIOR_RANGE[0], FINE_PRIOR_MAX))


def p_clean_of(llr: NDArray[np.floating], prior: float) -> NDArray[np.float32]:
    """Posterior probability clean (N,) of ratios ``llr`` (N,) under the corpus ``prior``; NaN stays NaN."""
    x = np.asarray(llr, np.float64)
    return _sigmoid(x + math.log(prior / (1 - prior))).astype(np.float32)


def fine_prior_or_reason(llr_fine: NDArray[np.floating], osa_p: NDArray[np.floating],
                         rates: tuple[float, float] | None = None) -> tuple[float | None, str | None]:
    """(the corpus's near-miss prior, None) from the calibration pairs' near-miss ratios and
    OSA's p_clean (N,), each pair weighted by ``osa_p``: the adjusted count where the judge
    carries its dev ``rates`` (``adjusted_count``), else ``estimate_prior``; or (None, why the
    judge's factor stays off: too few pairs, or a prior below ``MIN_FINE_PRIOR``)."""
    n = int(np.isfinite(np.asarray(llr_fine, np.float64)).sum())
    if n < MIN_FINE_PAIRS:
        return None, f"{n} judged calibration pairs, fewer than {MIN_FINE_PAIRS}: too few to size the near-misses"
    counted = None if rates is None else adjusted_count(llr_fine, rates, weights=osa_p)
    prior = estimate_prior(llr_fine, weights=osa_p) if counted is None else counted
    if prior < MIN_FINE_PRIOR:
        return None, (f"near-miss prior {prior:.2f} < {MIN_FINE_PRIOR}: the judge would call most pairs OSA accepts "
                      "wrong in a word; the corpus is likely outside what it learned")
    return prior, None


def combined_p_clean(osa_p: NDArray[np.floating], llr_fine: NDArray[np.floating], fine_prior: float) -> NDArray[np.float32]:
    """P(clean) (N,) = OSA's p_clean ``osa_p`` (N,) times the judge's posterior that no word is
    wrong, from its near-miss ratios ``llr_fine`` (N,) under the corpus's near-miss
    ``fine_prior`` (``estimate_prior`` weighted by OSA's p_clean). NaN ratios stay NaN."""
    return (np.asarray(osa_p, np.float64) * p_clean_of(llr_fine, fine_prior)).astype(np.float32)


def choose_band(similarity: NDArray[np.floating], judge_p: NDArray[np.floating], osa_p: NDArray[np.floating],
                budget: float) -> tuple[float, float]:
    """The similarity window ``(lo, hi)`` to judge, from a calibration sample.

    ``similarity``, ``judge_p`` (the judge's p_clean), ``osa_p`` (OSA's p_clean): (N,) of
    the same pairs. The window holds ``ceil(budget * N)`` consecutive pairs by similarity and
    maximises the summed ``|judge_p - osa_p|`` inside it; its ends are the midpoints to the
    pairs just outside (open-ended at the extremes). ``budget >= 1`` or an empty sample
    gives ``FULL_BAND``; ``budget <= 0`` an empty band (lo > hi).
    """
    s = np.asarray(similarity, np.float64)
    n = len(s)
    if budget >= 1 or n == 0:
        return FULL_BAND
    if budget <= 0:
        return (math.inf, -math.inf)
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    gain = np.abs(np.asarray(judge_p, np.float64) - np.asarray(osa_p, np.float64))[order]
    gain = np.nan_to_num(gain)
    width = max(1, min(n, math.ceil(budget * n)))
    cum = np.r_[0.0, np.cumsum(gain)]
    sums = cum[width:] - cum[:-width]
    start = int(np.argmax(sums))
    end = start + width - 1
    lo = -math.inf if start == 0 else float(0.5 * (s_sorted[start - 1] + s_sorted[start]))
    hi = math.inf if end == n - 1 else float(0.5 * (s_sorted[end] + s_sorted[end + 1]))
    return lo, hi


def in_band(similarity: NDArray[np.floating], band: tuple[float, float]) -> NDArray[np.bool_]:
    """(N,) True where ``lo <= similarity <= hi`` (NaN similarities are outside)."""
    s = np.asarray(similarity, np.float64)
    lo, hi = band
    with np.errstate(invalid="ignore"):
        return (s >= lo) & (s <= hi)
