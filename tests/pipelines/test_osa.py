"""OSA's pure functions against their formulas and the behaviours the docs pin down."""

from __future__ import annotations

import numpy as np
import pytest

from pairclean import osa


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_paper_weight_peaks_at_two_thirds_and_is_zero_below_beta() -> None:
    beta = 0.25  # exactly representable in float32, like the similarities
    s = np.array([beta - 0.125, beta, beta + 2 / 3, beta + 0.1, beta + 0.75], dtype=np.float32)
    w = osa.weight_paper(s, beta)
    assert w[0] == 0 and w[1] == 0
    assert w[2] == pytest.approx(1.0, abs=1e-5)
    d = float(np.float32(beta + 0.1)) - beta
    assert w[3] == pytest.approx(6.75 * d * d * (1 - d), rel=1e-5)
    assert 0 <= w.min() and w.max() <= 1


def test_paper_weight_nan_and_negative_beta_stay_in_range() -> None:
    w = osa.weight_paper(np.array([np.nan, 0.9], dtype=np.float32), -0.5)
    assert w[0] == 0 and 0 <= w[1] <= 1


def test_reference_weight_is_batch_independent() -> None:
    rng = np.random.default_rng(0)
    s = rng.uniform(-0.2, 0.8, size=100).astype(np.float32)
    params = osa.weighting_params("reference", s, 0.1, batch_size=10)
    whole = osa.apply_weighting(s, 0.1, params)
    parts = np.concatenate([osa.apply_weighting(s[i : i + 7], 0.1, params) for i in range(0, 100, 7)])
    np.testing.assert_array_equal(whole, parts)
    x = np.clip((s.astype(np.float64) - 0.1) / params.d_ref, 0, 1)
    np.testing.assert_allclose(whole, 4 * x**2 * (1 - x**2), rtol=1e-5, atol=1e-6)


def test_reference_batch_reproduces_released_code_semantics() -> None:
    s = np.array([0.3, 0.5, 0.1, 0.05, 0.02, 0.01], dtype=np.float32)
    w = osa.weight_reference_batch(s, beta=0.1, batch_size=3)
    # batch 1: d+ = [0.2, 0.4, 0] -> x = [0.5, 1, 0] -> x^2 (1 - x^2)
    np.testing.assert_allclose(w[:3], [0.25 * 0.75, 0.0, 0.0], atol=1e-6)
    # batch 2: nobody above beta: the code's NaN becomes 0
    assert np.all(w[3:] == 0) and not np.isnan(w).any()
    # the same pair gets another weight in another batch: batch dependence is real
    assert osa.weight_reference_batch(s[:1], 0.1, 3)[0] != w[0]


def test_beta_from_cross_equals_mean_of_the_cross_matrix() -> None:
    rng = np.random.default_rng(1)
    a, b = _unit(rng, 50, 16), _unit(rng, 40, 16)
    assert osa.beta_from_cross(a, b) == pytest.approx(float((a @ b.T).mean()), abs=1e-6)


def test_beta_shuffled_never_uses_a_matched_pair() -> None:
    # matched pairs have cosine 1, every mismatched pair cosine 0: any matched draw shows up
    eye = np.eye(8, dtype=np.float32)
    assert osa.beta_shuffled(eye, eye, k=10_000, seed=3) == 0.0
    assert osa.beta_shuffled(eye, eye, k=100, seed=3) == osa.beta_shuffled(eye, eye, k=100, seed=3)


def test_gmm_recovers_noise_rate_and_puts_the_boundary_between_modes() -> None:
    rng = np.random.default_rng(2)
    clean = rng.normal(0.45, 0.05, size=8000)
    noisy = rng.normal(0.10, 0.05, size=2000)
    fit = osa.fit_gmm(np.concatenate([clean, noisy]).astype(np.float32), seed=0)
    assert fit.noise_rate == pytest.approx(0.2, abs=0.02)
    assert 0.15 < fit.boundary < 0.40
    assert fit.means[0] < fit.boundary < fit.means[1]


def test_noisy_flag_is_similarity_at_or_below_beta() -> None:
    flags = osa.noisy_flags(np.array([0.125, 0.25, 0.375, np.nan], dtype=np.float32), 0.25)
    assert flags.tolist() == [True, True, False, True]


def test_unknown_weighting_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown weighting"):
        osa.weighting_params("nope", np.zeros(3, np.float32), 0.0, 4)


def test_pinned_mixture_finds_no_noise_in_clean_data_and_the_true_rate_in_noisy_data() -> None:
    rng = np.random.default_rng(4)
    mismatched = rng.normal(0.0, 0.08, size=20_000)  # what random pairing looks like
    clean = rng.normal(0.35, 0.08, size=5000)
    free = osa.fit_gmm(clean.astype(np.float32), seed=0)
    assert free.noise_rate > 0.2  # a free mixture always splits unimodal data
    pinned = osa.fit_gmm(clean.astype(np.float32), seed=0, noise_sims=mismatched.astype(np.float32))
    assert pinned.noise_rate < 0.01
    noisy = np.concatenate([clean[:4000], rng.normal(0.0, 0.08, size=1000)])
    fit = osa.fit_gmm(noisy.astype(np.float32), seed=0, noise_sims=mismatched.astype(np.float32))
    assert fit.noise_rate == pytest.approx(0.2, abs=0.015)
    assert 0.0 < fit.boundary < 0.35


def test_shuffled_similarities_are_mismatched_pairs_only() -> None:
    eye = np.eye(6, dtype=np.float32)
    assert np.all(osa.shuffled_similarities(eye, eye, 1000, seed=0) == 0)


def test_noise_rate_estimate_from_mismatched_pairs() -> None:
    rng = np.random.default_rng(5)
    mismatched = rng.normal(0.0, 0.08, size=20_000).astype(np.float32)
    for rate in (0.0, 0.2, 0.5):
        n_noisy = int(rate * 10_000)
        sims = np.concatenate([rng.normal(0.35, 0.08, 10_000 - n_noisy), rng.normal(0.0, 0.08, n_noisy)]).astype(np.float32)
        assert osa.estimate_noise_rate(sims, 0, mismatched) == pytest.approx(rate, abs=0.02)


def test_p_clean_weighting_is_the_mixture_posterior_and_gives_clean_pairs_about_one() -> None:
    rng = np.random.default_rng(7)
    noise = rng.normal(0.0, 0.05, size=4000).astype(np.float32)
    clean = rng.normal(0.4, 0.06, size=4000).astype(np.float32)
    s = np.concatenate([noise[:1000], clean])
    gmm = osa.fit_gmm(s, 0, noise_sims=noise[1000:])
    params = osa.weighting_params("p-clean", s, gmm.boundary, 64, gmm)
    w = osa.apply_weighting(s, gmm.boundary, params)
    np.testing.assert_array_equal(w, osa.mixture_posterior_clean(s, gmm.means, gmm.stds, gmm.noise_rate))
    assert np.median(w[1000:]) > 0.99 and np.median(w[:1000]) < 0.01  # unlike eq. 5, whose maximum here is ~0.3
    order = np.argsort(s)
    assert np.all(np.diff(w[order]) >= -1e-6)  # monotone in similarity
    # without a mixture (a tiny job) it is the hard rule s > beta
    hard = osa.apply_weighting(s, 0.2, osa.weighting_params("p-clean", s, 0.2, 64, None))
    np.testing.assert_array_equal(hard, (s > 0.2).astype(np.float32))
