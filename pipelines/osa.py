"""OSA, one-step anti-noise scoring (seed 004), as pure functions over arrays.

Notation: ``s`` is the cosine of an L2-normalised image embedding and text embedding;
``beta`` the space shift; ``d = s - beta``. See ``docs/methods.md``.

Beta recipes (how ``beta`` is measured):

- ``random-inputs`` (reference): mean cosine over the K x K cross matrix of embeddings of
  random images (uniform [0, 1), no normalisation) and random token sequences. The
  estimator adapter makes the embeddings; ``beta_from_cross`` reduces them.
- ``shuffled``: mean cosine of K random mismatched pairs of the corpus itself.
- ``gmm``: the decision boundary of a 2-component Gaussian mixture fitted on the corpus
  similarities; its low-mean component's weight is the estimated noise rate.

Weighting functions (``s``, ``beta`` -> weight in [0, 1]):

- ``p-clean`` (default): the pair's clean probability under the calibration's
  ``p_clean`` curve (``pairclean.calibrate.p_clean``; jobs calibrated before it: the pinned
  mixture, ``mixture_posterior_clean``), so confidently clean pairs weigh about 1. Chosen because
  it trains best in ``benchmarks/downstream.py`` (docs/methods.md, "Default weighting");
  without a mixture (fewer than 16 calibration pairs) it is the hard ``s > beta``.
- ``paper``: eq. 5, ``d^2 (1 - d)`` for ``d > 0``, rescaled by 27/4. Its maximum on a real
  estimator is far below 1 (about 0.3 on pairclean-lite), which shrinks a weighted loss's
  effective learning rate.
- ``reference``: ``x^2 (1 - x^2)`` with ``x = clamp(d / d_ref, 0, 1)`` and a dataset-level
  ``d_ref`` (99.9th percentile of d), rescaled by 4. Batch-independent.
- ``reference-batch``: the released code's semantics, batch maximum as normaliser
  (a weight depends on its batch-mates), epsilon-guarded, not rescaled.

A pair is noisy iff ``s <= beta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "isotonic",
    "BETA_RECIPES",
    "check_method",
    "WEIGHTINGS",
    "DEFAULT_BETA_RECIPE",
    "DEFAULT_WEIGHTING",
    "DEFAULT_K",
    "GmmFit",
    "WeightingParams",
    "cosine_rows",
    "beta_from_cross",
    "beta_shuffled",
    "fit_gmm",
    "shuffled_similarities",
    "mismatched_pairs",
    "estimate_noise_rate",
    "weight_paper",
    "weight_reference",
    "weight_reference_batch",
    "weighting_params",
    "apply_weighting",
    "noisy_flags",
    "mixture_posterior_clean",
]

BETA_RECIPES: Final = ("random-inputs", "shuffled", "gmm")
WEIGHTINGS: Final = ("p-clean", "paper", "reference", "reference-batch")


def check_method(beta_recipe: str, weighting: str) -> None:
    """The one check of a beta recipe and weighting name: ``InputError`` (one line, naming
    the choices) for an unknown one. Every entry point (score, rescore, the API) calls this."""
    from pairclean.errors import InputError

    if beta_recipe not in BETA_RECIPES:
        raise InputError(f"unknown beta recipe {beta_recipe!r}; choose one of {', '.join(BETA_RECIPES)}")
    if weighting not in WEIGHTINGS:
        raise InputError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
DEFAULT_BETA_RECIPE: Final = "random-inputs"
DEFAULT_WEIGHTING: Final = "p-clean"
#: K of the reference recipe: 256 random images x 256 random texts = 65,536 pairs.
DEFAULT_K: Final = 256
#: Percentile of d used as the dataset-level normaliser of the ``reference`` weighting.
REFERENCE_PERCENTILE: Final = 99.9
_EPS: Final = 1e-8

FloatArray = NDArray[np.float32]


def cosine_rows(image_emb: FloatArray, text_emb: FloatArray) -> FloatArray:
    """Row-wise cosine of matched pairs: (N, D), (N, D) L2-normalised -> (N,) float32."""
    if image_emb.shape != text_emb.shape:
        raise ValueError(f"shape mismatch {image_emb.shape} vs {text_emb.shape}")
    prod = image_emb.astype(np.float32) * text_emb.astype(np.float32)
    return np.asarray(prod.sum(axis=1), dtype=np.float32)


def beta_from_cross(image_emb: FloatArray, text_emb: FloatArray) -> float:
    """Mean cosine over the full cross matrix: (K, D), (M, D) L2-normalised -> scalar.

    Equal to the mean of ``image_emb @ text_emb.T`` but computed as a dot product of the
    mean vectors (O((K + M) D) instead of O(K M D)).
    """
    mean_i = image_emb.astype(np.float64).mean(axis=0)
    mean_t = text_emb.astype(np.float64).mean(axis=0)
    return float(mean_i @ mean_t)


def beta_shuffled(image_emb: FloatArray, text_emb: FloatArray, k: int, seed: int) -> float:
    """Mean cosine of ``k`` random mismatched pairs (i, j), i != j, of a corpus sample.

    (N, D), (N, D) L2-normalised, N >= 2 -> scalar. Deterministic for a given seed.
    """
    if image_emb.shape[0] < 2:
        raise ValueError("the shuffled recipe needs at least 2 pairs")
    return float(shuffled_similarities(image_emb, text_emb, k, seed).astype(np.float64).mean())


@dataclass(frozen=True)
class GmmFit:
    """A 2-component Gaussian mixture on similarities.

    ``boundary``: the similarity where both components are equally likely (between the
    means); ``noise_rate``: the mixing weight of the low-mean (noisy) component.
    """

    boundary: float
    noise_rate: float
    means: tuple[float, float]
    stds: tuple[float, float]


def fit_gmm(
    similarities: FloatArray,
    seed: int,
    max_points: int = 1_000_000,
    noise_sims: FloatArray | None = None,
) -> GmmFit:
    """Fit a 2-component Gaussian mixture on (N,) similarities (N >= 4); locate its boundary.

    Without ``noise_sims``: a free mixture (sklearn). A free mixture always splits the data
    in two, so on clean data it still reports a large "noise" component. With
    ``noise_sims`` (similarities of random mismatched pairs of the same corpus, e.g. from
    ``shuffled_similarities``) the noise component is pinned to their mean and spread, and
    EM fits only the mixing weight and the clean component: noise is what random pairing
    looks like. At most ``max_points`` values (a seeded subsample) are used.
    """
    sims = np.asarray(similarities, dtype=np.float64)
    sims = sims[np.isfinite(sims)]
    if sims.size < 4:
        raise ValueError("the gmm recipe needs at least 4 finite similarities")
    rng = np.random.default_rng(seed)
    if sims.size > max_points:
        sims = rng.choice(sims, size=max_points, replace=False)
    if noise_sims is not None and np.isfinite(noise_sims).sum() >= 4:
        return _pinned_mixture(sims, np.asarray(noise_sims, dtype=np.float64))
    return _free_mixture(sims, seed)


def _free_mixture(sims: NDArray[np.float64], seed: int) -> GmmFit:
    from sklearn.mixture import GaussianMixture

    gmm = GaussianMixture(n_components=2, max_iter=200, tol=1e-4, reg_covar=1e-6, random_state=seed)
    gmm.fit(sims.reshape(-1, 1))
    means = gmm.means_.ravel()
    stds = np.sqrt(gmm.covariances_.ravel())
    weights = gmm.weights_.ravel()
    lo, hi = int(np.argmin(means)), int(np.argmax(means))
    return _with_boundary(float(weights[lo]), (means[lo], stds[lo]), (means[hi], stds[hi]))


def _normal_pdf(x: NDArray[np.float64], mean: float, std: float) -> NDArray[np.float64]:
    density: NDArray[np.float64] = np.exp(-0.5 * ((x - mean) / std) ** 2) / (std * np.sqrt(2 * np.pi))
    return density


def _pinned_mixture(sims: NDArray[np.float64], noise: NDArray[np.float64], iters: int = 300) -> GmmFit:
    noise = noise[np.isfinite(noise)]
    mu_n, sd_n = float(noise.mean()), max(float(noise.std()), 1e-4)
    upper = sims[sims > np.median(sims)]
    upper = upper if upper.size else sims  # all equal: start the clean side there too
    pi, mu_c, sd_c = 0.5, float(upper.mean()), max(float(upper.std()), 1e-3)
    for _ in range(iters):
        pn = pi * _normal_pdf(sims, mu_n, sd_n)
        pc = (1 - pi) * _normal_pdf(sims, mu_c, sd_c)
        r = pn / np.maximum(pn + pc, 1e-300)
        new_pi = float(r.mean())
        wc = 1 - r
        mu_c = float((wc * sims).sum() / max(wc.sum(), 1e-12))
        sd_c = max(float(np.sqrt((wc * (sims - mu_c) ** 2).sum() / max(wc.sum(), 1e-12))), 1e-3)
        if abs(new_pi - pi) < 1e-7:
            pi = new_pi
            break
        pi = new_pi
    return _with_boundary(pi, (mu_n, sd_n), (mu_c, sd_c))


def _with_boundary(noise_rate: float, low: tuple[float, float], high: tuple[float, float]) -> GmmFit:
    """The first point between the means where the high (clean) component takes over."""
    grid = np.linspace(low[0], high[0], 4001)
    p_low = noise_rate * _normal_pdf(grid, *low)
    p_high = (1 - noise_rate) * _normal_pdf(grid, *high)
    over = p_high >= p_low
    boundary = float(grid[int(np.argmax(over))]) if over.any() else float(grid[-1])
    return GmmFit(
        boundary=boundary,
        noise_rate=float(noise_rate),
        means=(float(low[0]), float(high[0])),
        stds=(float(low[1]), float(high[1])),
    )


def estimate_noise_rate(similarities: FloatArray, seed: int, noise_sims: FloatArray | None = None) -> float:
    """Estimated fraction of noisy pairs among (N,) similarities.

    With ``noise_sims`` (random mismatched pairs of the corpus): ``P(s < m) / 0.5`` where
    ``m`` is the median of ``noise_sims``. A mismatched caption scores like a random pair,
    so half of the noisy pairs fall below ``m``, while clean pairs almost never do. On
    Flickr8k dev with pairclean-lite it was within 2 points at 0, 20 and 50% noise, where
    the pinned Gaussian mixture was off by up to 3.2 (its clean side is not Gaussian).
    Without ``noise_sims``: the low component's weight of a free 2-component mixture.
    """
    sims = np.asarray(similarities, dtype=np.float64)
    sims = sims[np.isfinite(sims)]
    if noise_sims is not None and np.isfinite(noise_sims).sum() >= 4 and sims.size:
        median = float(np.median(np.asarray(noise_sims, dtype=np.float64)[np.isfinite(noise_sims)]))
        return float(min(1.0, (sims < median).mean() / 0.5))
    return fit_gmm(sims.astype(np.float32), seed).noise_rate


def mismatched_pairs(n: int, k: int, seed: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``k`` random mismatched index pairs (i, j), i != j, of ``n`` pairs (n >= 2), seeded."""
    if n < 2:
        raise ValueError("mismatched pairs need at least 2 pairs")
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, size=k)
    # An offset in [1, n) guarantees j != i while keeping j uniform over the others.
    j = (i + rng.integers(1, n, size=k)) % n
    return i, j


def shuffled_similarities(image_emb: FloatArray, text_emb: FloatArray, k: int, seed: int) -> FloatArray:
    """Cosines of ``k`` random mismatched pairs (i, j), i != j: (N, D), (N, D) -> (k,) float32."""
    i, j = mismatched_pairs(image_emb.shape[0], k, seed)
    # In blocks of rows (same per-row sums): gathered at once, K = 256 (k = 65,536) copied
    # 3 x 134 MB and took 2.3 s of every job's calibration; in blocks, 0.1 s.
    out = np.empty(k, dtype=np.float32)
    for start in range(0, k, _GATHER_BLOCK):
        rows = slice(start, start + _GATHER_BLOCK)
        out[rows] = cosine_rows(image_emb[i[rows]], text_emb[j[rows]])
    return out


#: Rows gathered at a time by ``shuffled_similarities`` (4,096 x 512 floats = 8 MB).
_GATHER_BLOCK = 4096


def weight_paper(s: FloatArray, beta: float) -> FloatArray:
    """Eq. 5 of seed 004 rescaled to [0, 1]: (N,) -> (N,) float32.

    ``w = 27/4 d^2 (1 - d)`` for ``d > 0``, else 0; clipped to [0, 1] (d > 1 is only
    possible for a negative beta, where the cubic would turn negative). NaN -> 0.
    """
    d = np.asarray(s, dtype=np.float64) - beta
    w = np.where(d > 0, 6.75 * d * d * (1.0 - d), 0.0)
    weights: NDArray[np.float32] = np.nan_to_num(np.clip(w, 0.0, 1.0), nan=0.0).astype(np.float32)
    return weights


def weight_reference(s: FloatArray, beta: float, d_ref: float) -> FloatArray:
    """``4 x^2 (1 - x^2)``, ``x = clamp(d / d_ref, 0, 1)``: (N,) -> (N,) float32 in [0, 1].

    ``d_ref`` is dataset-level (see ``weighting_params``), so a pair's weight does not
    depend on its batch-mates. Like the released code, the most similar pairs (x = 1)
    get weight 0: this reproduces it, it is not an endorsement.
    """
    x = np.clip((np.asarray(s, dtype=np.float64) - beta) / max(d_ref, _EPS), 0.0, 1.0)
    w = 4.0 * x * x * (1.0 - x * x)
    return np.nan_to_num(w, nan=0.0).astype(np.float32)


def weight_reference_batch(s: FloatArray, beta: float, batch_size: int) -> FloatArray:
    """The released code: per consecutive batch, ``x = d+ / max(d+)``, ``w = x^2 (1 - x^2)``.

    (N,) -> (N,) float32 in [0, 0.25]. Logit scaling (100 x cosine) cancels in the
    division and is omitted. The epsilon guard turns the code's NaN (no pair above beta)
    into weight 0 for the whole batch.
    """
    d = np.clip(np.nan_to_num(np.asarray(s, dtype=np.float64) - beta, nan=0.0), 0.0, None)
    out = np.zeros_like(d)
    for start in range(0, d.size, max(1, batch_size)):
        chunk = d[start : start + batch_size]
        x = chunk / max(float(chunk.max(initial=0.0)), _EPS)
        out[start : start + batch_size] = x * x * (1.0 - x * x)
    return out.astype(np.float32)


@dataclass(frozen=True)
class WeightingParams:
    """Everything a weighting needs besides s and beta; recorded in the Parquet metadata."""

    name: str
    d_ref: float | None = None
    batch_size: int | None = None
    #: ``p-clean``'s mixture: ((noise mean, clean mean), (noise std, clean std), noise weight).
    mixture: tuple[tuple[float, float], tuple[float, float], float] | None = None
    #: ``p-clean``'s curve (similarity knots, p_clean knots), interpolated linearly; when
    #: given it wins over ``mixture`` (``pairclean.calibrate.p_clean``).
    curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None


def weighting_params(
    name: str, similarities: FloatArray, beta: float, batch_size: int, mixture: GmmFit | None = None
) -> WeightingParams:
    """Resolve the dataset-level parameters of weighting ``name`` from (N,) similarities
    (and, for ``p-clean``, the calibration's mixture; None gives the hard ``s > beta``)."""
    if name == "paper":
        return WeightingParams(name)
    if name == "p-clean":
        pinned = None if mixture is None else (tuple(mixture.means), tuple(mixture.stds), float(mixture.noise_rate))
        return WeightingParams(name, mixture=pinned)  # type: ignore[arg-type]
    if name == "reference":
        d = np.asarray(similarities, dtype=np.float64) - beta
        d = d[np.isfinite(d)]
        d_ref = float(np.percentile(d, REFERENCE_PERCENTILE)) if d.size else 1.0
        return WeightingParams(name, d_ref=max(d_ref, _EPS))
    if name == "reference-batch":
        return WeightingParams(name, batch_size=batch_size)
    raise ValueError(f"unknown weighting {name!r}; choose one of {', '.join(WEIGHTINGS)}")


def apply_weighting(s: FloatArray, beta: float, params: WeightingParams) -> FloatArray:
    """Weights for (N,) similarities under ``params``: (N,) -> (N,) float32."""
    if params.name == "p-clean":
        if params.curve is not None:
            x = np.asarray(s, dtype=np.float64)
            p = np.interp(np.nan_to_num(x, nan=-np.inf), np.asarray(params.curve[0]), np.asarray(params.curve[1]))
            return np.where(np.isfinite(x), p, 0.0).astype(np.float32)
        if params.mixture is None:
            return (~noisy_flags(s, beta)).astype(np.float32)
        means, stds, noise_weight = params.mixture
        return mixture_posterior_clean(s, means, stds, noise_weight)
    if params.name == "paper":
        return weight_paper(s, beta)
    if params.name == "reference":
        assert params.d_ref is not None
        return weight_reference(s, beta, params.d_ref)
    if params.name == "reference-batch":
        assert params.batch_size is not None
        return weight_reference_batch(s, beta, params.batch_size)
    raise ValueError(f"unknown weighting {params.name!r}; choose one of {', '.join(WEIGHTINGS)}")


def noisy_flags(s: FloatArray, beta: float) -> NDArray[np.bool_]:
    """The paper's noisy rule ``s <= beta`` (NaN similarities count as noisy): (N,) -> (N,) bool."""
    sims = np.asarray(s, dtype=np.float64)
    return np.asarray(~(sims > beta), dtype=np.bool_)


def mixture_posterior_clean(s: FloatArray, means: tuple[float, float], stds: tuple[float, float], noise_weight: float) -> FloatArray:
    """P(clean | s) under a 2-component mixture on similarities: (N,) -> (N,) float32 in [0, 1].

    ``means``/``stds``: (noise, clean) components, ``noise_weight`` the noise component's
    mixing weight (``GmmFit.means``, ``.stds``, ``.noise_rate``). Outside the two means the
    posterior is held at its value at the nearer mean (a mixture of unequal spreads is not
    monotone in its tails; a pair more similar than the clean mean is never called less
    clean). NaN -> 0.
    """
    x = np.asarray(s, dtype=np.float64)
    lo, hi = float(means[0]), float(means[1])
    xc = np.clip(x, min(lo, hi), max(lo, hi))
    pi = float(np.clip(noise_weight, 1e-9, 1 - 1e-9))
    sd_n, sd_c = max(float(stds[0]), 1e-6), max(float(stds[1]), 1e-6)
    log_n = np.log(pi) - np.log(sd_n) - 0.5 * ((xc - lo) / sd_n) ** 2
    log_c = np.log(1 - pi) - np.log(sd_c) - 0.5 * ((xc - hi) / sd_c) ** 2
    post = 1.0 / (1.0 + np.exp(np.clip(log_n - log_c, -700, 700)))
    return np.where(np.isfinite(x), post, 0.0).astype(np.float32)


def isotonic(y: NDArray[np.float64], w: NDArray[np.float64]) -> NDArray[np.float64]:
    """Weighted least-squares non-decreasing fit of ``y`` (N,) with weights ``w`` (N,) (pool
    adjacent violators). Shared by OSA's p_clean curve and the judge's near-miss mixture."""
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            wv = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / wv
            n = lens[-2] + lens[-1]
            del vals[-1], wts[-1], lens[-1]
            vals[-1], wts[-1], lens[-1] = v, wv, n
    return np.repeat(np.asarray(vals), lens)
