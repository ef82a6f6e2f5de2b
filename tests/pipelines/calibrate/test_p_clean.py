"""The corpus-mixture p_clean (pairclean.calibrate.p_clean) on synthetic similarity mixtures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pairclean import osa
from pairclean.calibrate import p_clean as pc
from pairclean.calibrate.calibration import calibrate


def _ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    idx = np.clip(np.digitize(p, np.linspace(0, 1, bins + 1)[1:-1]), 0, bins - 1)
    return float(sum((idx == b).mean() * abs(p[idx == b].mean() - y[idx == b].mean()) for b in range(bins) if (idx == b).any()))


def _corpus(rng: np.random.Generator, n: int, parts: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """Similarities and noisy labels: clean N(0.5, 0.1), random N(0, 0.1), near-miss N(0.2, 0.05)."""
    shapes = {"clean": (0.5, 0.1), "random": (0.0, 0.1), "near": (0.2, 0.05)}
    s, y = [], []
    for name, share in parts.items():
        k = int(round(share * n))
        s.append(rng.normal(*shapes[name], size=k))
        y.append(np.full(k, name != "clean"))
    return np.concatenate(s), np.concatenate(y)


def _refs(rng: np.random.Generator, near_mean: float = 0.2, near_sd: float = 0.05) -> pc.NoiseReferences:
    return pc.NoiseReferences(rng.normal(0.0, 0.1, 20_000), rng.normal(near_mean, near_sd, 4_000))


def test_random_noise_is_calibrated_and_ranked_like_the_similarity() -> None:
    rng = np.random.default_rng(0)
    s, noisy = _corpus(rng, 4000, {"clean": 0.8, "random": 0.2})
    curve = pc.fit_p_clean(s, _refs(rng), seed=0)
    p = curve(s).astype(np.float64)
    assert p[~noisy].mean() >= 0.85 and p[noisy].mean() <= 0.15
    assert _ece(p, (~noisy).astype(float)) <= 0.05
    # rising in the similarity: same order, no plateaus (float32 may merge a few neighbours)
    order = np.argsort(s)
    assert np.all(np.diff(p[order]) >= 0)
    _, counts = np.unique(p, return_counts=True)
    assert counts.max() <= 0.005 * len(p) and len(counts) >= 0.85 * len(p)  # the pinned mixture tied 27-41%
    assert curve.fit["near_share"] == 0.0  # no near-miss hump: none invented


def test_a_separate_near_miss_hump_is_found_and_never_called_clean() -> None:
    rng = np.random.default_rng(1)
    s, noisy = _corpus(rng, 4000, {"clean": 0.5, "near": 0.4, "random": 0.1})
    curve = pc.fit_p_clean(s, _refs(rng), seed=0)
    p = curve(s).astype(np.float64)
    near = (s > 0.1) & noisy
    assert curve.fit["near_share"] >= 0.3
    assert p[near].mean() <= 0.2, "near-misses that stand apart must not look clean"
    assert p[~noisy].mean() >= 0.85
    # the pinned Gaussian mixture (random pairs only) calls many of them clean
    gmm = osa.fit_gmm(s.astype(np.float32), 0, noise_sims=rng.normal(0.0, 0.1, 20_000).astype(np.float32))
    old = osa.mixture_posterior_clean(s.astype(np.float32), gmm.means, gmm.stds, gmm.noise_rate)
    assert old[near].mean() > p[near].mean() + 0.2


def test_overlapping_near_misses_get_the_middle_not_a_confident_answer() -> None:
    """Near-misses that score like clean pairs: told how many there are (a judge's
    estimate), p_clean sits near the prior for them, never confidently clean."""
    rng = np.random.default_rng(2)
    clean = rng.normal(0.5, 0.1, 2000)
    near = rng.normal(0.47, 0.1, 2000)  # cannot be told apart by similarity
    s = np.concatenate([clean, near])
    noisy = np.r_[np.zeros(2000, bool), np.ones(2000, bool)]
    refs = pc.NoiseReferences(rng.normal(0.0, 0.1, 20_000), rng.normal(0.47, 0.1, 4000))
    curve = pc.fit_p_clean(s, refs, seed=0, near_share=0.5)
    p = curve(s).astype(np.float64)
    assert 0.3 <= p[noisy].mean() <= 0.7
    assert (p[noisy] > 0.9).mean() < 0.05
    assert _ece(p, (~noisy).astype(float)) <= 0.1


def test_the_curve_round_trips_and_refuses_an_unknown_recipe() -> None:
    rng = np.random.default_rng(3)
    s, _ = _corpus(rng, 500, {"clean": 0.8, "random": 0.2})
    curve = pc.fit_p_clean(s, _refs(rng), seed=0)
    doc = json.loads(json.dumps(curve.to_json()))
    again = pc.PCleanCurve.from_json(doc)
    assert np.array_equal(again(s), curve(s))
    assert again(np.array([np.nan]))[0] == 0.0
    with pytest.raises(ValueError, match="not known"):
        pc.PCleanCurve.from_json({**doc, "version": pc.VERSION + 1})
    with pytest.raises(ValueError, match="at least 16"):
        pc.fit_p_clean(s[:5], _refs(rng), seed=0)


def test_noise_references_skip_copies_and_take_near_misses() -> None:
    rng = np.random.default_rng(4)
    base = rng.normal(size=(60, 16)).astype(np.float32)
    img = base / np.linalg.norm(base, axis=1, keepdims=True)
    img = np.concatenate([img, img[:10]])  # ten exact copies: not near-misses of each other
    txt = img + 0.3 * rng.normal(size=img.shape).astype(np.float32)
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    j, best = pc._nearest_other(img)
    assert np.all(best < pc.DUPLICATE_COSINE)
    assert np.all(j[:10] != np.arange(60, 70))
    refs = pc.noise_references(img, txt, osa.shuffled_similarities(img, txt, 1000, 0), 0)
    assert refs.near_miss.size == 2 * len(img)
    assert refs.near_miss.mean() > refs.random.mean()


def test_calibrate_records_the_curve_and_every_table_applies_it() -> None:
    rng = np.random.default_rng(5)
    n, d = 400, 32
    img = rng.normal(size=(n, d)).astype(np.float32)
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    txt = img + 0.15 * rng.normal(size=(n, d)).astype(np.float32)
    swap = rng.choice(n, 80, replace=False)
    txt[swap] = txt[np.roll(swap, 1)]
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    sims = osa.cosine_rows(img, txt)
    cal = calibrate(beta_recipe="gmm", k=64, seed=0, weighting="p-clean", batch_size=64, similarities=sims,
                    image_emb=img, text_emb=txt, random_beta=lambda: 0.0)
    doc = cal.extra["p_clean"]
    assert doc["recipe"] == pc.RECIPE and doc["version"] == pc.VERSION
    params = cal.p_clean_params()
    assert params.curve is not None
    p = osa.apply_weighting(sims, cal.beta, params)
    assert np.array_equal(p, pc.PCleanCurve.from_json(doc)(sims))
    assert np.array_equal(osa.apply_weighting(sims, cal.beta, cal.weighting_params()), p)
    clean = np.ones(n, bool)
    clean[swap] = False
    assert p[clean].mean() > 0.8 and p[~clean].mean() < 0.3


def test_a_few_wide_references_on_a_tiny_sample_still_fit() -> None:
    # regression: a kernel wider than the grid made the densities longer than the grid
    from pairclean.calibrate.p_clean import NoiseReferences, fit_p_clean

    rng = np.random.default_rng(0)
    sims = rng.normal(0.3, 0.01, 20)
    refs = NoiseReferences(random=np.r_[rng.normal(0.0, 0.3, 6), -2.0, 2.0], near_miss=np.r_[rng.normal(0.2, 0.4, 6), 3.0])
    curve = fit_p_clean(sims, refs, seed=0, bootstraps=2)
    assert len(curve.knots_s) == len(curve.knots_p) and all(0.0 <= p <= 1.0 for p in curve.knots_p)


def test_random_level_pairs_the_random_part_leaves_out_are_reported() -> None:
    """``random_level`` (written by ``calibrate``) says how many pairs fit at random level; where
    that is well above what the fitted random share explains, the corpus holds noise of
    another shape and ``unexplained_random`` says how much; the score's closing note and
    ``pairclean inspect`` carry the warning."""
    junk = {"pi_random": 0.126, "random_level": {"threshold": 0.1, "quantile": 0.75, "share": 0.37}}
    assert pc.unexplained_random(junk) == pytest.approx(0.37 - 0.75 * 0.126)
    swaps = {"pi_random": 0.217, "random_level": {"threshold": 0.1, "quantile": 0.75, "share": 0.156}}
    assert pc.unexplained_random(swaps) is None  # random swaps: the random part explains them
    assert pc.unexplained_random({"pi_random": 0.1}) is None  # a fit recorded before random_level existed
    assert pc.unexplained_random({"pi_random": 0.1, "random_level": {"share": "x"}}) is None
    from types import SimpleNamespace

    from pairclean.output.report import junk_warning
    from pairclean_workers.cli import _p_clean_note

    fit = {"pi_random": 0.126, "pi_near": 0.0, **{k: v for k, v in junk.items() if k != "pi_random"}}
    note = _p_clean_note(SimpleNamespace(extra={"p_clean": {"fit": fit}}), "OUT")
    gap = pc.unexplained_random(fit)
    assert note is not None and gap is not None and note.endswith(junk_warning(gap)) and "WARNING: 28% of the calibration" in note
    assert "WARNING" not in (_p_clean_note(SimpleNamespace(extra={"p_clean": {"fit": {**fit, "pi_random": 0.45}}}), "OUT") or "")


def test_warnings_of_a_table_name_unexplained_random_pairs_until_an_audit() -> None:
    from pairclean.output.report import junk_gap, junk_warning, warnings_of

    fit = {"pi_random": 0.1, "random_level": {"threshold": 0.1, "quantile": 0.75, "share": 0.5}}
    meta = {"p_clean": {"fit": fit}}
    assert junk_gap(meta) == pytest.approx(0.425) and warnings_of(meta) == [junk_warning(0.425)]
    assert warnings_of({**meta, "audit": {"labels": 200}}) == []  # the remedy was applied
    assert warnings_of({"p_clean": {"fit": {**fit, "random_level": {**fit["random_level"], "share": 0.15}}}}) == []  # explained
    assert warnings_of({}) == [] and warnings_of({"p_clean": "damaged"}) == [] and warnings_of({"p_clean": {"fit": 3}}) == []
