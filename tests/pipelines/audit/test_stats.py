"""The audit's statistics against closed-form cases (``pairclean.audit``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pairclean.audit import stats
from pairclean.audit.design import EDGES, allocate, draw_design, stratum_of


def test_wilson_matches_the_closed_form() -> None:
    lo, hi = stats.wilson(0.5, 100)
    assert lo == pytest.approx(0.40383, abs=1e-5) and hi == pytest.approx(0.59617, abs=1e-5)
    lo, hi = stats.wilson(0.0, 10)  # 0 of 10: the rule of three's cousin, z^2 / (n + z^2)
    assert lo == 0.0 and hi == pytest.approx(stats.Z95**2 / (10 + stats.Z95**2), abs=1e-9)
    assert stats.wilson(0.3, math.inf) == (0.3, 0.3)
    assert stats.wilson(0.3, 0) == (0.0, 1.0)


def test_one_stratum_is_wilson_on_the_labelled_count_with_the_finite_population_correction() -> None:
    n_pop, m, x = 1000, 50, 12
    y = np.r_[np.ones(x), np.zeros(m - x)]
    iv = stats.noise_rate(np.array([n_pop]), np.zeros(m, np.int64), y)
    assert iv.estimate == pytest.approx(x / m)
    # smoothed p cancels: n_eff = m / (1 - m / N)
    assert iv.n_eff == pytest.approx(m / (1 - m / n_pop))
    # at Student's t quantile for m - 1 degrees of freedom (49: 2.0096 against 1.96)
    assert stats.t_quantile(stats.Z95, m - 1) == pytest.approx(2.0096, abs=2e-4)
    lo, hi = stats.wilson(x / m, m / (1 - m / n_pop), stats.t_quantile(stats.Z95, m - 1))
    assert (iv.lower, iv.upper) == pytest.approx((lo, hi))
    assert stats.t_quantile(stats.Z95, 19) == pytest.approx(2.0930, abs=2e-4)


def test_a_census_is_exact() -> None:
    iv = stats.noise_rate(np.array([4, 6]), np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1]), np.array([1, 0, 0, 0, 1, 1, 0, 0, 0, 0.0]))
    assert iv.estimate == pytest.approx(0.4 * 0.25 + 0.6 * (2 / 6))
    assert iv.lower == iv.upper == pytest.approx(iv.estimate)


def test_the_stratified_point_estimate_weights_strata_by_their_size() -> None:
    sizes = np.array([900, 100])
    strata = np.array([0] * 10 + [1] * 10)
    y = np.array([0] * 9 + [1] + [1] * 8 + [0] * 2, dtype=float)
    iv = stats.noise_rate(sizes, strata, y)
    assert iv.estimate == pytest.approx(0.9 * 0.1 + 0.1 * 0.8)
    assert iv.lower < iv.estimate < iv.upper


def test_labels_that_all_agree_still_give_an_interval() -> None:
    iv = stats.noise_rate(np.array([10_000]), np.zeros(30, np.int64), np.zeros(30))
    assert iv.estimate == 0.0 and iv.lower == 0.0
    assert 0.05 < iv.upper < 0.2  # never "0 +- 0" from 30 clean labels


def test_an_unlabelled_stratum_contributes_its_whole_range() -> None:
    iv = stats.noise_rate(np.array([800, 200]), np.zeros(40, np.int64), np.zeros(40))
    assert iv.upper >= 0.2 and iv.lower == 0.0


def test_conflicting_labels_widen_the_interval_never_shrink_it() -> None:
    sizes = np.array([5000, 5000])
    strata = np.array([0] * 40 + [1] * 40)
    y = np.r_[np.zeros(36), np.ones(4), np.ones(30), np.zeros(10)]
    base = stats.noise_rate(sizes, strata, y)
    for i in (0, 37, 45, 75):
        conflict = np.zeros(80, bool)
        conflict[i] = True
        wide = stats.noise_rate(sizes, strata, y, conflict)
        assert wide.lower <= base.lower and wide.upper >= base.upper
        assert wide.upper - wide.lower > base.upper - base.lower


def test_recall_with_conflicts_spans_every_resolution_that_fits_the_labels() -> None:
    """Round 6: conflicts were tried only as all clean and all noisy, which bound precision
    but not recall (a caught conflict raises it as noisy, a missed one lowers it)."""
    sizes = np.array([10_000])
    strata = np.zeros(40, dtype=np.int64)
    flagged = np.r_[np.ones(20), np.zeros(20)].astype(bool)
    y = np.r_[np.ones(10), np.zeros(10), np.ones(10), np.zeros(10)]  # 10 caught, 10 missed
    conflict = np.zeros(40, bool)
    conflict[[0, 1, 2, 3, 20, 21, 22, 23]] = True  # 4 caught, 4 missed are in doubt
    got = stats.flag_quality(sizes, strata, y, flagged, conflict)["recall"]
    assert got is not None
    worst = stats.flag_quality(sizes, strata, np.where(conflict, 1.0 - flagged, y), flagged)["recall"]
    best = stats.flag_quality(sizes, strata, np.where(conflict, flagged.astype(float), y), flagged)["recall"]
    assert worst is not None and best is not None
    assert got.lower <= worst.lower and got.upper >= best.upper
    assert worst.estimate < 0.45 and best.estimate > 0.55  # 6/16 and 10/16: beyond the two ends' 0.5


def test_precision_and_recall_in_one_stratum_are_the_plain_proportions() -> None:
    y = np.array([1, 1, 1, 0, 0, 0, 0, 1], dtype=float)
    flag = np.array([1, 1, 0, 1, 0, 0, 0, 0], dtype=bool)
    q = stats.flag_quality(np.array([10**6]), np.zeros(8, np.int64), y, flag)
    assert q["precision"].estimate == pytest.approx(2 / 3)
    assert q["recall"].estimate == pytest.approx(2 / 4)
    assert q["f1"].estimate == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    # effective size never above the units in the denominator: at least as wide as Wilson on them
    lo, hi = stats.wilson(2 / 3, 3)
    assert q["precision"].lower <= lo + 1e-9 and q["precision"].upper >= hi - 1e-9


def test_precision_is_design_weighted_across_strata() -> None:
    # stratum 0 (N=900): 10 labelled, 5 flagged of which 1 noisy; stratum 1 (N=100): 10 labelled, all flagged and noisy
    strata = np.array([0] * 10 + [1] * 10)
    flag = np.r_[np.ones(5, bool), np.zeros(5, bool), np.ones(10, bool)]
    y = np.r_[[1, 0, 0, 0, 0], np.zeros(5), np.ones(10)]
    q = stats.flag_quality(np.array([900, 100]), strata, y, flag)
    tp, flagged = 90 * 1 + 10 * 10, 90 * 5 + 10 * 10
    assert q["precision"].estimate == pytest.approx(tp / flagged)


def test_threshold_for_a_precision_target() -> None:
    p = np.array([0.05, 0.1, 0.2, 0.3, 0.6, 0.7, 0.8, 0.9])
    y = np.array([1, 1, 1, 0, 1, 0, 0, 0], dtype=float)
    found = stats.threshold_for(np.array([10**6]), np.zeros(8, np.int64), y, p, "precision", 0.99)
    # flagging p < 0.3 catches the three lowest, all noisy: precision 1, recall 3/4
    assert found["threshold"] == pytest.approx(0.3)
    assert found["recall"]["estimate"] == pytest.approx(0.75)
    assert stats.threshold_for(np.array([10**6]), np.zeros(8, np.int64), y, p, "recall", 1.0)["threshold"] == pytest.approx(0.7)
    assert stats.threshold_for(np.array([10]), np.zeros(8, np.int64), np.zeros(8), p, "precision", 0.5) is None


def test_the_isotonic_part_pools_adjacent_violators_centred() -> None:
    x, y = stats._centred_isotonic(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 1, 0, 1.0]), np.ones(4))
    # PAVA pools (0.2, 0.3) to 0.5; centred, that block is one knot at 0.25, interpolated between
    assert x.tolist() == pytest.approx([0.1, 0.25, 0.4]) and y.tolist() == pytest.approx([0, 0.5, 1])
    # design weights: a heavier unit pulls its pool
    x, y = stats._centred_isotonic(np.array([0.2, 0.3]), np.array([1, 0.0]), np.array([3.0, 1.0]))
    assert x.tolist() == pytest.approx([0.225]) and y.tolist() == pytest.approx([0.75])


def test_recalibration_is_the_mean_of_the_isotonic_and_the_platt_map() -> None:
    rng = np.random.default_rng(0)
    p = rng.random(400)
    y = (rng.random(400) < p ** 2).astype(float)  # the model is over-confident about clean pairs
    w = np.ones(400)
    knots = stats.fit_recalibration(p, y, w)
    q = np.sort(rng.random(200))
    out = stats.apply_recalibration(knots, q)
    assert np.all(np.diff(out) >= 0) and np.all((out >= 0) & (out <= 1))
    order = np.argsort(p)
    ix, iy = stats._centred_isotonic(p[order], y[order], w)
    a, b = stats._platt(p[order], y[order], w)
    platt = 1 / (1 + np.exp(-(a * stats._logit(q) + b)))
    iso = np.interp(q, ix, iy)
    assert out == pytest.approx(0.5 * (iso + platt), abs=0.01)  # the knots' grid interpolates the sigmoid
    assert float(np.mean(np.abs(out - q ** 2))) < 0.06  # it finds the truth, p squared
    # labels that agree with a calibrated model leave it nearly as it was
    y_cal = (rng.random(400) < p).astype(float)
    near = stats.apply_recalibration(stats.fit_recalibration(p, y_cal, w), q)
    assert float(np.mean(np.abs(near - q))) < 0.06
    # perfectly separated labels keep a finite, monotone map
    sep = stats.apply_recalibration(stats.fit_recalibration(p, (p > 0.5).astype(float), w), q)
    assert np.all(np.diff(sep) >= 0) and sep[0] < 0.1 and sep[-1] > 0.9
    # a design weight counts: a heavier unit pulls the map its way
    light = stats.fit_recalibration(np.array([0.2, 0.3]), np.array([1, 0.0]), np.array([1.0, 1.0]))
    heavy = stats.fit_recalibration(np.array([0.2, 0.3]), np.array([1, 0.0]), np.array([3.0, 1.0]))
    assert stats.apply_recalibration(heavy, np.array([0.25]))[0] > stats.apply_recalibration(light, np.array([0.25]))[0]


def test_ece_closed_form() -> None:
    # two bins: predicted 0.2 observed 0 (weight 1), predicted 0.9 observed 1 (weight 3)
    assert stats.ece(np.array([0.2, 0.9]), np.array([0, 1.0]), np.array([1.0, 3.0])) == pytest.approx(0.25 * 0.2 + 0.75 * 0.1)


def test_self_agreement_and_kappa() -> None:
    got = stats.self_agreement(["clean", "clean", "noisy", "noisy"], ["clean", "noisy", "noisy", "noisy"])
    assert got["agreement"] == 0.75 and got["disagreements"] == 1
    chance = 0.5 * 0.25 + 0.5 * 0.75
    assert got["kappa"] == pytest.approx((0.75 - chance) / (1 - chance), abs=1e-6)
    assert stats.self_agreement([], [])["agreement"] is None


def test_labels_needed() -> None:
    drawn = np.array([10, 10, 0, 5])
    assert stats.labels_needed(drawn, np.array([0, 0, 1])) == 17  # 20 in all
    assert stats.labels_needed(drawn, np.array([0] * 25)) == 4  # strata 1 and 3 need two each
    assert stats.labels_needed(drawn, np.array([0] * 20 + [1, 1, 3, 3])) == 0
    assert stats.labels_needed(np.array([3, 2]), np.array([0, 0, 0, 1, 1])) == 0  # a queue of 5: all of it is enough
    # ... when it is the whole population; a queue of 5 drawn from 300 pairs is not
    assert stats.labels_needed(np.array([3, 2]), np.array([0, 0, 0, 1, 1]), population=300) == 15
    assert stats.labels_needed(np.array([3, 2]), np.array([0, 0, 0, 1, 1]), population=5) == 0


# -- the design -------------------------------------------------------------------------------

def test_design_draws_distinct_pairs_reproducibly_with_known_inclusion_probabilities() -> None:
    p = np.random.default_rng(1).beta(0.3, 0.3, size=20_000)
    a, b = draw_design(p, 300, seed=7), draw_design(p, 300, seed=7)
    assert np.array_equal(a.rows, b.rows)
    assert not np.array_equal(a.rows, draw_design(p, 300, seed=8).rows)
    assert len(a.rows) == 300 and len(np.unique(a.rows)) == 300
    strata = stratum_of(p)
    assert np.array_equal(a.strata, strata[a.rows])
    assert np.allclose(a.inclusion, a.drawn[a.strata] / a.sizes[a.strata])
    # Horvitz-Thompson: the inverse inclusion probabilities of the sample add up to the population
    assert (1 / a.inclusion).sum() == pytest.approx(len(p))
    # more labels per pair where the decision is uncertain
    rate = a.drawn / np.maximum(a.sizes, 1)
    mid, end = EDGES.index(0.3), 0
    assert rate[mid] > 2 * rate[end]


def test_the_queue_interleaves_strata_so_a_prefix_is_still_stratified() -> None:
    p = np.random.default_rng(2).random(10_000)
    d = draw_design(p, 400, seed=0)
    first = np.bincount(d.strata[:100], minlength=len(d.sizes))
    assert np.all(np.abs(first - d.drawn / 4) <= 2)


def test_labelling_the_queue_in_order_gives_an_estimate_early() -> None:
    """The estimate needs two labels in every band drawn from; a band of two draws spread
    evenly had its second half-way down the queue, so a 400-pair queue gave its first
    estimate after a median 129-202 labels (worst seeds 373-399). The first two draws of
    every band come first now."""
    p = np.clip(np.concatenate([np.random.default_rng(3).beta(8, 1, 9_000), np.random.default_rng(4).beta(1, 6, 1_000)]), 0, 1)
    firsts = []
    for seed in range(20):
        d = draw_design(p, 400, seed=seed)
        firsts.append(next(n for n in range(1, 401) if stats.labels_needed(d.drawn, d.strata[:n], population=p.size) == 0))
    assert max(firsts) <= 2 * len(d.sizes) + 20, firsts  # 20 labels in all, two per band


def test_allocation_respects_sizes_and_minimum() -> None:
    alloc = allocate(np.array([1000, 3, 0, 500]), np.array([0.2, 0.5, 0.5, 0.5]), 50)
    assert alloc.sum() == 50 and alloc[1] <= 3 and alloc[2] == 0 and alloc[1] >= 2
    assert allocate(np.array([4, 5]), np.array([0.5, 0.5]), 100).tolist() == [4, 5]


def test_the_stratified_estimator_is_unbiased_and_its_interval_covers() -> None:
    rng = np.random.default_rng(3)
    p = rng.beta(0.4, 0.4, size=5000)
    truth = (rng.random(5000) > p).astype(float)  # p_clean calibrated on this population
    estimates, covered = [], 0
    for seed in range(200):
        d = draw_design(p, 150, seed)
        iv = stats.noise_rate(d.sizes, d.strata, truth[d.rows])
        estimates.append(iv.estimate)
        covered += iv.lower <= truth.mean() <= iv.upper
    assert np.mean(estimates) == pytest.approx(truth.mean(), abs=0.01)
    assert covered >= 186  # 93%
