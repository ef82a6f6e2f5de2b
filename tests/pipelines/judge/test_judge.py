"""The judge's pure parts (p_clean, band, metrics), its weights file and its runner on the
tiny real estimator with a tiny random judge."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pairclean import schema
from pairclean.errors import ModelLoadError
from pairclean.embed.estimators import EstimatorSpec, load_estimator
from pairclean.judge.metrics import brier, ece, roc_auc
from pairclean.judge.model import Judge, JudgeConfig
from pairclean.judge.posterior import (
    FULL_BAND,
    adjusted_count,
    choose_band,
    combined_p_clean,
    estimate_prior,
    fine_llr,
    fine_prior_or_reason,
    in_band,
    llr_of,
    p_clean_of,
    platt_fit,
)
from pairclean.judge.features import COLOUR_BINS, region_colours
from pairclean.judge.runner import JudgeRunner, load_judge, save_judge

@pytest.fixture(scope="module")
def tiny_estimator():
    return load_estimator(EstimatorSpec(model="pairclean-tiny-test", engine="torch"))


def test_platt_fit_recovers_a_logistic_map() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, 20000)
    y = rng.random(20000) < 1 / (1 + np.exp(-(0.7 * z - 0.4)))
    a, b = platt_fit(z, y)
    # classes weighted equally: the slope is the true one, the bias absorbs the class balance
    assert a == pytest.approx(0.7, abs=0.05)
    balance = math.log(y.mean() / (1 - y.mean()))
    assert b == pytest.approx(-0.4 - balance, abs=0.08)


def test_prior_and_p_clean_are_honest() -> None:
    rng = np.random.default_rng(1)
    for clean_rate in (0.5, 0.8):
        y = rng.random(20000) < clean_rate
        # exact likelihood ratio of N(+1, 1) (clean) against N(-1, 1) (noisy): llr = 2x
        x = np.where(y, rng.normal(1, 1, y.size), rng.normal(-1, 1, y.size))
        llr = 2 * x
        prior = estimate_prior(llr)
        assert prior == pytest.approx(clean_rate, abs=0.02)
        p = p_clean_of(llr, prior)
        assert ece(p, y) < 0.02 and brier(p, y) < 0.2
    # where the judge cannot tell (llr 0), p_clean is the prior: never confident
    assert p_clean_of(np.zeros(3), 0.7) == pytest.approx(0.7, abs=1e-6)
    assert np.isnan(p_clean_of(np.array([np.nan]), 0.7)[0])
    assert estimate_prior(np.array([])) == 0.5
    assert estimate_prior(np.full(100, 50.0)) == 0.98  # clipped: a sample cannot say "no noise at all"


def test_the_near_miss_prior_reads_only_the_pairs_osa_calls_clean() -> None:
    rng = np.random.default_rng(2)
    n = 20000
    # a corpus: 30% random swaps (OSA sees them), then 20% of the rest one-word edits (it does not)
    swapped = rng.random(n) < 0.3
    edited = ~swapped & (rng.random(n) < 0.2)
    osa_p = np.where(swapped, 0.02, 0.97)
    # the judge's near-miss ratio: N(+1, 1) for clean pairs, N(-1, 1) for edits (llr = 2x);
    # on swaps it says "noisy" too, which must not count as near-misses
    x = np.where(edited | swapped, rng.normal(-1, 1, n), rng.normal(1, 1, n))
    fine = 2 * x
    prior = estimate_prior(fine, weights=osa_p)
    assert prior == pytest.approx(0.8, abs=0.03)  # unweighted it would read 0.56
    assert estimate_prior(fine) < 0.6
    p = combined_p_clean(osa_p, fine, prior)
    clean = ~swapped & ~edited
    assert ece(p, clean) < 0.03
    assert p[swapped].mean() < 0.05 and p[edited].mean() < 0.5 < p[clean].mean()
    # where the judge cannot tell, OSA's answer scaled by the prior: never more confident than OSA
    assert combined_p_clean(np.array([0.9]), np.zeros(1), 0.8)[0] == pytest.approx(0.72, abs=1e-6)
    assert np.isnan(combined_p_clean(np.array([0.9]), np.array([np.nan]), 0.8)[0])
    assert estimate_prior(fine, weights=np.zeros(n)) == 0.5
    # the factor's guard: enough pairs and a plausible prior, else a reason
    assert fine_prior_or_reason(fine, osa_p) == (pytest.approx(prior), None)
    few, why = fine_prior_or_reason(fine[:50], osa_p[:50])
    assert few is None and why is not None and "fewer than 100" in why
    low, why = fine_prior_or_reason(fine - 6, osa_p)
    assert low is None and why is not None and "near-miss prior" in why


def test_the_adjusted_count_sizes_a_corpus_where_em_trusts_a_misshapen_map() -> None:
    from scipy.stats import norm

    rng = np.random.default_rng(0)
    # true ratios: clean ~ N(+1, 1), a word wrong ~ N(-1, 1); the map handed over is half as
    # steep (a shape error), which biases EM but not the count at 0
    n_clean, n_noisy = 7000, 3000
    raw = np.r_[rng.normal(1, 1, n_clean), rng.normal(-1, 1, n_noisy)]
    misshapen = 0.5 * raw
    rates = (float(norm.sf(0, 1, 1)), float(norm.sf(0, -1, 1)))  # pass rates measured on dev
    counted = adjusted_count(misshapen, rates)
    assert counted is not None and abs(counted - 0.7) < 0.02
    assert abs(estimate_prior(misshapen) - 0.7) > abs(counted - 0.7)
    # weights: pairs OSA calls mismatched count for nothing
    junk = rng.normal(3, 1, 4000)
    assert adjusted_count(np.r_[misshapen, junk], rates, weights=np.r_[np.ones(10000), np.zeros(4000)]) == pytest.approx(counted)
    assert adjusted_count(misshapen, (0.6, 0.5)) is None  # rates too close to divide by
    prior, why = fine_prior_or_reason(np.r_[misshapen][:500], np.ones(500), rates)
    assert why is None and prior == pytest.approx(adjusted_count(misshapen[:500], rates))
    # a corpus without wrong words counts at about 1: bounded at FINE_PRIOR_MAX (0.995), not EM's 0.98
    from pairclean.judge.posterior import FINE_PRIOR_MAX

    all_clean = 0.5 * rng.normal(1, 1, 5000)
    assert FINE_PRIOR_MAX == 0.995 and adjusted_count(all_clean, rates) == FINE_PRIOR_MAX
    assert estimate_prior(all_clean) <= 0.98


def test_fine_llr_remaps_the_same_raw_logit() -> None:
    raw = np.array([-3.0, 0.0, 2.5])
    general, fine = (0.5, 0.2), (0.8, -0.6)
    assert fine_llr(llr_of(raw, general), general, fine) == pytest.approx(llr_of(raw, fine), abs=1e-5)


def test_band_holds_the_budget_where_judge_and_osa_disagree() -> None:
    sims = np.linspace(0, 1, 100)
    osa = np.where(sims > 0.3, 0.95, 0.05)
    judge = osa.copy()
    judge[60:80] = 0.1  # near-misses: OSA says clean, the judge does not
    lo, hi = choose_band(sims, judge, osa, budget=0.2)
    inside = in_band(sims, (lo, hi))
    assert inside.sum() == 20 and inside[60:80].all()
    assert choose_band(sims, judge, osa, budget=1.0) == FULL_BAND
    lo, hi = choose_band(sims, judge, osa, budget=0.0)
    assert not in_band(sims, (lo, hi)).any()
    assert not in_band(np.array([np.nan]), FULL_BAND)[0]


def test_metrics_match_their_definitions() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(2)
    s = np.round(rng.normal(size=500), 1)  # ties
    y = rng.random(500) < 0.4
    assert roc_auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert math.isnan(roc_auc(s, np.ones(500, bool)))
    assert ece(np.full(10, 0.5), np.r_[np.ones(5, bool), np.zeros(5, bool)]) == pytest.approx(0.0)
    assert ece(np.ones(4), np.zeros(4, bool)) == pytest.approx(1.0)


def test_weights_round_trip_and_bad_files(tmp_path: Path, tiny_judge) -> None:
    path = tiny_judge(tmp_path / "judge.safetensors")
    loaded = load_judge(str(path))
    assert loaded.platt == (1.0, 0.0) and loaded.estimator == "pairclean-tiny-test"
    assert loaded.identity()["sha256"] == loaded.sha256 and len(loaded.sha256) == 64
    assert loaded.meta["note"] == "random weights, for tests"
    with pytest.raises(ModelLoadError, match="not found"):
        load_judge(str(tmp_path / "missing.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(ModelLoadError, match="not a pairclean judge"):
        load_judge(str(bad))


def _batch(estimator, n: int) -> tuple[torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand((n, 3, estimator.image_size, estimator.image_size), generator=gen)
    texts = [f"a photo of {'a dog ' * (i + 1)}on grass" for i in range(n)]
    return pixels, texts


def test_runner_embeds_like_the_estimator_and_judges_only_the_band(tmp_path: Path, tiny_estimator, tiny_judge) -> None:
    runner = JudgeRunner(load_judge(str(tiny_judge(tmp_path / "j.safetensors"))), tiny_estimator)
    pixels, texts = _batch(tiny_estimator, 6)
    out = runner.encode_batch(pixels, texts)
    np.testing.assert_allclose(out.image_emb, tiny_estimator.encode_images(pixels), atol=1e-5)
    np.testing.assert_allclose(out.text_emb, tiny_estimator.encode_texts(texts), atol=1e-5)
    assert np.isfinite(out.llr).all() and out.errors == [None] * 6
    sims = np.einsum("nd,nd->n", out.image_emb, out.text_emb)
    band = (float(np.sort(sims)[2]) - 1e-6, math.inf)
    banded = runner.with_band(band).encode_batch(pixels, texts)
    judged = np.isfinite(banded.llr)
    assert judged.sum() == 4 and (judged == (sims >= band[0])).all()
    np.testing.assert_allclose(banded.llr[judged], out.llr[judged], atol=1e-5)


def _flat(rgb: tuple[float, float, float], size: int = 56) -> torch.Tensor:
    """One (1, 3, size, size) image of one colour, normalised with mean = std = 0.5."""
    return (torch.tensor(rgb).view(1, 3, 1, 1).expand(1, 3, size, size) - 0.5) / 0.5


def test_region_colours_name_the_colours_captions_use() -> None:
    def bins(rgb: tuple[float, float, float]) -> np.ndarray:
        out = region_colours(_flat(rgb), (0.5,) * 3, (0.5,) * 3, 7)
        assert out.shape == (1, 49, COLOUR_BINS)
        np.testing.assert_allclose(out.sum(-1).numpy(), 1.0, atol=1e-5)  # shares of one region's pixels
        return out[0, 0].numpy()

    black, white, grey = bins((0, 0, 0)), bins((1, 1, 1)), bins((0.5, 0.5, 0.5))
    assert black[-3] == pytest.approx(1) and grey[-2] == pytest.approx(1) and white[-1] == pytest.approx(1)
    red, dark_red, blue = bins((0.9, 0.1, 0.1)), bins((0.45, 0.05, 0.05)), bins((0.1, 0.2, 0.9))
    hues = COLOUR_BINS - 3
    assert red[:hues].argmax() == hues // 2  # a bright red: the bright half's red sector
    assert dark_red[:hues].argmax() == 0 and blue[:hues].argmax() != red[:hues].argmax()
    # left half red, right half blue: each region reports its own side
    split = torch.cat([_flat((0.9, 0.1, 0.1))[..., :28], _flat((0.1, 0.2, 0.9))[..., 28:]], dim=3)
    grid = region_colours(split, (0.5,) * 3, (0.5,) * 3, 7)[0].reshape(7, 7, COLOUR_BINS)
    assert torch.allclose(grid[3, 0], torch.from_numpy(red)) and torch.allclose(grid[3, 6], torch.from_numpy(blue))


def test_a_judge_reads_the_colours_of_its_regions(tmp_path: Path, tiny_estimator, tiny_judge) -> None:
    runner = JudgeRunner(load_judge(str(tiny_judge(tmp_path / "c.safetensors", colour_bins=COLOUR_BINS))), tiny_estimator)
    pixels, texts = _batch(tiny_estimator, 4)
    out = runner.encode_batch(pixels, texts)
    assert np.isfinite(out.llr).all()
    # the same judge with its colour projection zeroed ignores colours, and scores otherwise
    loaded = load_judge(str(tmp_path / "c.safetensors"))
    with torch.no_grad():
        loaded.model.colour_in.weight.zero_()
    blind = JudgeRunner(loaded, tiny_estimator).encode_batch(pixels, texts)
    assert np.abs(out.llr - blind.llr).max() > 1e-4
    path = tmp_path / "odd.safetensors"
    save_judge(str(path), Judge(JudgeConfig(text_dim=64, image_dim=64, regions=16, width=16, layers=1, heads=2, colour_bins=5)),
               (1.0, 0.0), "pairclean-tiny-test", {})
    with pytest.raises(ModelLoadError, match="5 colour channels"):
        JudgeRunner(load_judge(str(path)), tiny_estimator)


def test_a_judge_for_another_estimator_is_refused(tmp_path: Path, tiny_estimator) -> None:
    torch.manual_seed(0)
    path = tmp_path / "lite-shaped.safetensors"
    save_judge(str(path), Judge(JudgeConfig(width=16, layers=1, heads=2)), (1.0, 0.0), "pairclean-lite", {})
    with pytest.raises(ModelLoadError, match="trained for pairclean-lite"):
        JudgeRunner(load_judge(str(path)), tiny_estimator)


class _FailsOnLongCaptions(Judge):
    """A real judge that gives a non-finite score for captions of more than ``limit`` tokens
    (a stand-in for any per-pair numerical failure)."""

    limit = 10

    def forward(self, tokens, mask, regions, cosine):  # type: ignore[override]
        out = super().forward(tokens, mask, regions, cosine)
        return torch.where(mask.sum(1) > self.limit, torch.full_like(out, float("nan")), out)


def _failing_runner(path: Path, estimator, limit: int, tiny_judge) -> JudgeRunner:
    loaded = load_judge(str(tiny_judge(path)))
    failing = _FailsOnLongCaptions(loaded.model.config)
    failing.limit = limit
    failing.load_state_dict(loaded.model.state_dict())
    loaded.model = failing.eval()
    return JudgeRunner(loaded, estimator)


def test_a_judge_failure_is_that_pairs_error_only(tmp_path: Path, tiny_estimator, tiny_judge) -> None:
    runner = _failing_runner(tmp_path / "j.safetensors", tiny_estimator, 10, tiny_judge)
    pixels, texts = _batch(tiny_estimator, 5)  # captions of 7, 8, 9, 10, 11 tokens with start/end
    lengths = [int((tiny_estimator.tokenizer([t]) != 0).sum()) for t in texts]
    out = runner.encode_batch(pixels, texts)
    for length, llr, err in zip(lengths, out.llr, out.errors):
        if length > 10:
            assert np.isnan(llr) and err == "judge failed: non-finite score"
        else:
            assert np.isfinite(llr) and err is None
    assert any(length > 10 for length in lengths) and any(length <= 10 for length in lengths)


def test_score_shard_turns_a_judge_failure_into_a_row_status(tmp_path: Path, tiny_estimator, make_shards, tiny_judge) -> None:
    from pairclean.embed.shard import score_shard

    import tarfile

    shard = make_shards(n_shards=1, per_shard=8)[0]
    with tarfile.open(shard) as tar:
        captions = [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith(".txt")]
    lengths = [int((tiny_estimator.tokenizer([c]) != 0).sum()) for c in captions]
    limit = int(np.median(lengths))
    assert any(n > limit for n in lengths) and any(n <= limit for n in lengths)
    result = score_shard(str(shard), tiny_estimator, judge=_failing_runner(tmp_path / "j.safetensors", tiny_estimator, limit, tiny_judge))
    plain = score_shard(str(shard), tiny_estimator)
    assert result.judge_llr is not None and len(result) == 8
    for n, status, error, sim, ref, llr in zip(lengths, result.status, result.error, result.similarity, plain.similarity, result.judge_llr):
        if n > limit:
            assert status == schema.STATUS_JUDGE_ERROR and error.startswith("judge failed") and np.isnan(sim)
        else:
            assert status == schema.STATUS_OK and np.isfinite(llr) and sim == pytest.approx(ref, abs=1e-5)


def test_platt_fit_stays_finite_when_classes_barely_overlap() -> None:
    rng = np.random.default_rng(3)
    z = np.r_[rng.normal(5, 1, 500), rng.normal(-5, 1, 500), [0.1, -0.1]]
    y = np.r_[np.ones(500, bool), np.zeros(500, bool), [False, True]]
    a, b = platt_fit(z, y)
    assert 0 < a < 100 and abs(b) < 100
