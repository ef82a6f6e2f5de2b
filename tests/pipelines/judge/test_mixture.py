"""The near-miss mixture (``posterior.FineMixture``): a corpus whose wrong words the judge
never saw changed gets p_clean near the middle, not a confident "clean"; a corpus of the
judge's own kind of edits, or a clean one, keeps the adjusted count (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest

from pairclean.judge.metrics import ece
from pairclean.judge.posterior import (
    FineMixture,
    adjusted_count,
    combined_p_clean,
    fit_mixture,
    mixture_p_clean,
)

# A judge's near-miss ratios on dev: clean N(1.5, 1), its own lists' edits N(-1.5, 1), edits
# with words it never trained on N(0.3, 1) (they mostly pass its check, as on Flickr8k dev).
MEANS = {"clean": 1.5, "edits": -1.5, "other": 0.3}
RATES = (float(np.mean(np.random.default_rng(9).normal(1.5, 1, 100000) > 0)),
         float(np.mean(np.random.default_rng(9).normal(-1.5, 1, 100000) > 0)))


def _mixture(min_gain: float = 2.0) -> FineMixture:
    rng = np.random.default_rng(1)
    return FineMixture.of({k: rng.normal(m, 1, 2000) for k, m in MEANS.items()}, "extra", min_gain)


def _corpus(n: int, shares: dict[str, float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ratios, clean flags) of ``n`` pairs drawn with ``shares`` of each component."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(list(shares), n, p=list(shares.values()))
    return np.array([rng.normal(MEANS[k], 1) for k in kinds]), kinds == "clean"


def test_unseen_word_edits_get_doubt_where_the_adjusted_count_was_sure() -> None:
    mixture = _mixture()
    x, clean = _corpus(1500, {"clean": 0.7, "other": 0.3}, seed=2)
    fit = fit_mixture(x, mixture)
    assert fit is not None and fit.used and fit.gain > mixture.min_gain
    assert fit.shares[2] == pytest.approx(0.3, abs=0.1) and fit.shares[0] == pytest.approx(0.7, abs=0.1)
    mixed = mixture_p_clean(x, mixture, fit.shares)
    counted = adjusted_count(x, RATES)
    assert counted is not None and counted > 0.85  # the count takes the unseen edits for clean pairs
    before = combined_p_clean(np.ones(len(x)), x, counted)
    # fewer wrong captions called clean with confidence, and better calibrated
    assert (mixed[~clean] > 0.9).mean() < 0.5 * (before[~clean] > 0.9).mean()
    assert ece(mixed, clean) < ece(before, clean) - 0.05


@pytest.mark.parametrize("shares", [{"clean": 1.0}, {"clean": 0.8, "edits": 0.2}, {"clean": 0.5, "edits": 0.5}])
def test_a_corpus_of_the_judges_own_edits_or_none_keeps_the_adjusted_count(shares: dict[str, float]) -> None:
    mixture = _mixture()
    fits = [fit_mixture(_corpus(1500, shares, seed=seed)[0], mixture) for seed in range(10)]
    assert all(f is not None for f in fits)
    used = [f for f in fits if f is not None and f.used]
    # a deviance of 2 lets chance through now and then (a chi-square tail), with a small share only
    assert len(used) <= 3 and all(f.shares[2] < 0.1 for f in used)
    assert all(f.used == (f.gain > mixture.min_gain) for f in fits if f is not None)


def test_pairs_osa_calls_mismatched_do_not_count() -> None:
    mixture = _mixture()
    x, _ = _corpus(1000, {"clean": 0.8, "edits": 0.2}, seed=4)
    junk = np.random.default_rng(5).normal(0.3, 0.2, 3000)  # like unseen edits, but OSA's p_clean is 0
    weights = np.r_[np.ones(len(x)), np.zeros(len(junk))]
    alone, weighted = fit_mixture(x, mixture), fit_mixture(np.r_[x, junk], mixture, weights)
    assert alone is not None and weighted is not None
    assert weighted.shares == pytest.approx(alone.shares, abs=1e-6) and not weighted.used
    unweighted = fit_mixture(np.r_[x, junk], mixture)
    assert unweighted is not None and unweighted.used  # the junk alone would have made it doubt
    assert fit_mixture(np.array([np.nan]), mixture) is None


@pytest.mark.parametrize("widest", ["clean", "edits", "other"])
def test_the_posterior_never_reads_a_higher_ratio_as_less_clean(widest: str) -> None:
    # kernel estimates of different widths cross in the far tails, where the widest wins: the
    # raw ratio called a pair scoring above every dev clean pair wrong when "other" was widest
    rng = np.random.default_rng(1)
    spread = {k: (2.0 if k == widest else 1.0) for k in MEANS}
    mixture = FineMixture.of({k: rng.normal(m, spread[k], 2000) for k, m in MEANS.items()}, "extra", 2.0)
    x = np.r_[-1e3, np.linspace(-40, 40, 801), 1e3, np.nan]
    p = mixture_p_clean(x, mixture, (0.6, 0.2, 0.2))
    assert np.isnan(p[-1]) and np.all((p[:-1] >= 0) & (p[:-1] <= 1))
    assert np.all(np.diff(p[:-1]) >= 0)
    # in the bulk the curve stays the mixture's own posterior (the monotone fit moves the tails)
    bulk = np.array([-1.5, 0.3, 1.5])
    joint = mixture.log_densities(bulk) + np.log([0.6, 0.2, 0.2])
    raw = np.exp(joint[:, 0]) / np.exp(joint).sum(axis=1)
    assert np.abs(mixture_p_clean(bulk, mixture, (0.6, 0.2, 0.2)) - raw).max() < 0.1
    assert np.isfinite(mixture.log_densities(x[:-1])).all()


def test_a_mixture_reads_back_as_written_and_a_bad_record_is_refused() -> None:
    mixture = _mixture()
    doc = mixture.to_doc()
    again = FineMixture.from_doc(doc)
    assert again.to_doc() == doc and again.other_words == "extra"
    assert len(doc["components"]["clean"]) == 128  # quantiles, not the dev ratios themselves
    for bad in (None, {"components": "x"}, {**doc, "components": {**doc["components"], "edits": [float("inf")]}},
                {**doc, "bandwidths": [0.0, 1.0, 1.0]}):
        with pytest.raises(ValueError):
            FineMixture.from_doc(bad)
    for bad in ({**doc, "min_gain": 10**400}, {**doc, "bandwidths": [10**400, 1, 1]}, {**doc, "bandwidths": {"a": 1, "b": 1, "c": 1}},
                {**doc, "components": {**doc["components"], "clean": [10**400]}}, {k: v for k, v in doc.items() if k != "bandwidths"}):
        with pytest.raises(ValueError):  # never an OverflowError or KeyError: a judge file is input
            FineMixture.from_doc(bad)
    with pytest.raises(ValueError, match="fewer than 10"):
        FineMixture.of({"clean": np.ones(50), "edits": np.ones(50), "other": np.ones(3)}, "extra", 2.0)
