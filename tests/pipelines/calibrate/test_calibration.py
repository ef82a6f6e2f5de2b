"""``pairclean.calibrate.calibration``: beta recipes, weightings, the mixture, the beta cache.

Synthetic corpora with a known noise rate: a clean pair's caption embedding is its image's
plus a little noise (cosine near 0.96); a noisy pair's is an unrelated random vector
(cosine near 0, spread 1/sqrt(D)), which is also what a random mismatched pair looks like.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from pairclean import osa
from pairclean.calibrate.calibration import (
    MIN_MIXTURE_PAIRS,
    Calibration,
    cache_dir,
    cached_random_beta,
    calibrate,
    needs_corpus,
)
from pairclean.errors import InputError

DIM = 32
RANDOM_BETA = 0.123  # what the (counted) random-inputs callable returns


class Corpus:
    """(N, D) L2-normalised image and text embeddings, their similarities, the noisy mask."""

    def __init__(self, n: int, noise_rate: float, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        img = rng.standard_normal((n, DIM))
        txt = img + 0.3 * rng.standard_normal((n, DIM))
        self.noisy = np.zeros(n, dtype=bool)
        self.noisy[rng.choice(n, size=round(noise_rate * n), replace=False)] = True
        txt[self.noisy] = rng.standard_normal((int(self.noisy.sum()), DIM))
        self.img = _unit(img)
        self.txt = _unit(txt)
        self.sims = osa.cosine_rows(self.img, self.txt).astype(np.float32)


def _unit(x: NDArray[np.float64]) -> NDArray[np.float32]:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


class CountingBeta:
    """A random-inputs beta that counts how often it is asked."""

    def __init__(self, value: float = RANDOM_BETA) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


def _calibrate(corpus: Corpus, recipe: str, weighting: str, random_beta: CountingBeta | None = None,
               with_emb: bool = True, n: int | None = None, seed: int = 7) -> Calibration:
    sl = slice(None) if n is None else slice(0, n)
    return calibrate(
        beta_recipe=recipe, k=16, seed=seed, weighting=weighting, batch_size=64,
        similarities=corpus.sims[sl],
        image_emb=corpus.img[sl] if with_emb else None,
        text_emb=corpus.txt[sl] if with_emb else None,
        random_beta=random_beta or CountingBeta(),
    )


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(1000, noise_rate=0.3)


@pytest.mark.parametrize(
    ("recipe", "weighting", "expected"),
    [
        ("random-inputs", "paper", False),
        ("random-inputs", "reference-batch", False),
        ("random-inputs", "reference", True),
        ("random-inputs", "p-clean", True),
        ("shuffled", "paper", True),
        ("gmm", "paper", True),
        ("gmm", "reference-batch", True),
    ],
)
def test_needs_corpus_exactly_when_a_recipe_or_weighting_reads_pairs(recipe: str, weighting: str, expected: bool) -> None:
    assert needs_corpus(recipe, weighting) is expected


@pytest.mark.parametrize("weighting", osa.WEIGHTINGS)
@pytest.mark.parametrize("recipe", osa.BETA_RECIPES)
def test_every_recipe_and_weighting_resolves_on_a_noisy_mixture(corpus: Corpus, recipe: str, weighting: str) -> None:
    random_beta = CountingBeta()
    cal = _calibrate(corpus, recipe, weighting, random_beta)
    assert (cal.recipe, cal.weighting, cal.k, cal.seed) == (recipe, weighting, 16, 7)
    assert cal.calibration_pairs == corpus.sims.size
    # the noise-rate estimate (median of mismatched pairs) is near the true 30%
    assert cal.noise_rate is not None and abs(cal.noise_rate - 0.3) < 0.06
    # random-inputs asks the model; the corpus recipes never do when they have enough pairs
    assert random_beta.calls == (1 if recipe == "random-inputs" else 0)
    clean, noisy = corpus.sims[~corpus.noisy], corpus.sims[corpus.noisy]
    if recipe == "random-inputs":
        assert cal.beta == pytest.approx(RANDOM_BETA)
    elif recipe == "shuffled":
        # the mean of random mismatched cosines: the noisy group's centre, far below the clean one
        assert abs(cal.beta - float(noisy.mean())) < 0.05
        assert cal.beta < float(clean.min())
    else:  # gmm: the boundary of the two components lies between the groups
        assert float(np.percentile(noisy, 95)) < cal.beta < float(np.percentile(clean, 1))
        assert cal.extra["gmm_boundary"] == pytest.approx(cal.beta)
    if weighting == "reference":
        d = corpus.sims.astype(np.float64) - cal.beta
        assert cal.d_ref == pytest.approx(float(np.percentile(d, osa.REFERENCE_PERCENTILE)), rel=1e-6)
        assert cal.weighting_batch_size is None
    elif weighting == "reference-batch":
        assert (cal.d_ref, cal.weighting_batch_size) == (None, 64)
    else:
        assert (cal.d_ref, cal.weighting_batch_size) == (None, None)
    params = cal.weighting_params()
    assert params.name == weighting
    if weighting == "p-clean":
        assert params.mixture == cal.mixture() and params.mixture is not None


def test_the_mixture_describes_the_two_groups(corpus: Corpus) -> None:
    cal = _calibrate(corpus, "gmm", "p-clean")
    mixture = cal.mixture()
    assert mixture is not None
    (noise_mean, clean_mean), (noise_std, clean_std), noise_weight = mixture
    clean, noisy = corpus.sims[~corpus.noisy], corpus.sims[corpus.noisy]
    assert abs(noise_mean - float(noisy.mean())) < 0.05
    assert abs(clean_mean - float(clean.mean())) < 0.05
    assert abs(noise_weight - 0.3) < 0.05
    assert 0 < clean_std < noise_std  # random pairs spread more than the matched ones here
    # the frozen p_clean separates the groups
    w = osa.apply_weighting(corpus.sims, cal.beta, cal.p_clean_params())
    assert w[~corpus.noisy].mean() > 0.95 and w[corpus.noisy].mean() < 0.1


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_noise_rate_estimate_follows_the_true_rate(rate: float) -> None:
    cal = _calibrate(Corpus(800, noise_rate=rate, seed=3), "gmm", "paper")
    assert cal.noise_rate is not None and abs(cal.noise_rate - rate) < 0.07


def test_gmm_with_fewer_than_16_pairs_falls_back_to_random_inputs_and_says_so(corpus: Corpus) -> None:
    random_beta = CountingBeta()
    cal = _calibrate(corpus, "gmm", "p-clean", random_beta, n=MIN_MIXTURE_PAIRS - 1)
    assert cal.recipe == "random-inputs"
    assert cal.beta == pytest.approx(RANDOM_BETA) and random_beta.calls == 1
    assert cal.extra["requested_recipe"] == "gmm" and "fewer than 16" in cal.extra["fallback"]
    assert cal.noise_rate is None
    assert cal.calibration_pairs == MIN_MIXTURE_PAIRS - 1
    assert cal.mixture() is None
    # p-clean without a mixture is the hard rule s > beta
    assert cal.weighting_params().mixture is None
    s = np.array([RANDOM_BETA - 0.01, RANDOM_BETA + 0.01], dtype=np.float32)
    assert osa.apply_weighting(s, cal.beta, cal.weighting_params()).tolist() == [0.0, 1.0]


def test_sixteen_pairs_are_enough_for_a_mixture(corpus: Corpus) -> None:
    cal = _calibrate(corpus, "gmm", "paper", n=MIN_MIXTURE_PAIRS)
    assert cal.recipe == "gmm" and "fallback" not in cal.extra
    assert cal.mixture() is not None and cal.noise_rate is not None


def test_random_inputs_on_an_empty_job_needs_no_pairs() -> None:
    # what the worker does when no corpus is needed: calibrate on nothing
    cal = calibrate(beta_recipe="random-inputs", k=4, seed=0, weighting="paper", batch_size=8,
                    similarities=np.zeros(0, np.float32), image_emb=None, text_emb=None, random_beta=CountingBeta(0.2))
    assert cal.beta == pytest.approx(0.2) and cal.calibration_pairs == 0
    assert cal.noise_rate is None and cal.mixture() is None and cal.extra == {}


def test_shuffled_needs_embeddings_of_two_pairs(corpus: Corpus) -> None:
    with pytest.raises(InputError, match="at least 2"):
        _calibrate(corpus, "shuffled", "paper", with_emb=False)
    with pytest.raises(InputError, match="at least 2"):
        _calibrate(corpus, "shuffled", "paper", n=1)


def test_unknown_recipe_or_weighting_is_a_clear_error(corpus: Corpus) -> None:
    with pytest.raises(InputError, match="unknown beta recipe 'median'.*random-inputs"):
        _calibrate(corpus, "median", "paper")
    with pytest.raises(ValueError, match="unknown weighting 'soft'"):
        _calibrate(corpus, "gmm", "soft")


def test_calibration_is_deterministic_for_a_seed(corpus: Corpus) -> None:
    assert _calibrate(corpus, "shuffled", "p-clean") == _calibrate(corpus, "shuffled", "p-clean")
    assert _calibrate(corpus, "shuffled", "paper", seed=1).beta != _calibrate(corpus, "shuffled", "paper", seed=2).beta


@pytest.mark.parametrize(("recipe", "n"), [("gmm", None), ("gmm", 8), ("random-inputs", None)])
def test_to_json_round_trips_through_json_text(corpus: Corpus, recipe: str, n: int | None) -> None:
    cal = _calibrate(corpus, recipe, "reference", n=n)
    back = Calibration(**json.loads(json.dumps(cal.to_json())))
    assert back == cal
    assert back.mixture() == cal.mixture()


def test_mixture_is_none_without_a_recorded_mixture() -> None:
    bare = Calibration(beta=0.2, recipe="random-inputs", k=4, seed=0, weighting="p-clean")
    assert bare.mixture() is None
    assert bare.p_clean_params() == osa.WeightingParams("p-clean", mixture=None)
    # an older calibration with means but no stds/weight has no usable mixture either
    assert Calibration(beta=0.2, recipe="gmm", k=4, seed=0, weighting="paper", extra={"gmm_means": [0.0, 0.5]}).mixture() is None


# -- the random-inputs beta cache ------------------------------------------------------------

@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PAIRCLEAN_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "pairclean"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "pairclean"


def test_cached_random_beta_computes_once_per_identity(cache: Path) -> None:
    compute = CountingBeta(0.31)
    identity = {"model_id": "m", "checkpoint_sha256": "abc", "precision": "fp32", "k": 8, "seed": 0}
    assert cached_random_beta(identity, compute) == pytest.approx(0.31)
    assert compute.calls == 1
    files = list((cache / "beta").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["identity"] == identity
    # second time: read from disk (a fresh callable would give another value if asked)
    again = CountingBeta(0.99)
    assert cached_random_beta(dict(reversed(identity.items())), again) == pytest.approx(0.31)
    assert again.calls == 0
    # another identity (K changed) is computed and cached separately
    other = CountingBeta(0.5)
    assert cached_random_beta({**identity, "k": 16}, other) == pytest.approx(0.5)
    assert other.calls == 1 and len(list((cache / "beta").glob("*.json"))) == 2
    assert not [p for p in (cache / "beta").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_a_damaged_cache_entry_is_recomputed(cache: Path) -> None:
    identity = {"model_id": "m", "k": 4}
    cached_random_beta(identity, CountingBeta(0.2))
    (entry,) = (cache / "beta").glob("*.json")
    entry.write_text("{not json")
    fresh = CountingBeta(0.25)
    assert cached_random_beta(identity, fresh) == pytest.approx(0.25) and fresh.calls == 1
    assert json.loads(entry.read_text())["beta"] == pytest.approx(0.25)
