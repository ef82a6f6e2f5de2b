"""Shared parts of the learned estimators: fitted heads, their file format, mixtures, adapters.

Every method fits small torch modules on a sample of frozen, L2-normalised estimator
embeddings and reduces a pair to one raw score (higher = cleaner) and one clean
probability ``p_clean``. Both depend only on the pair itself and the fitted heads, never
on the other pairs of a shard or batch, so applying heads is reproducible shard by shard.

``Heads`` holds everything ``apply`` needs as named float32 arrays plus a JSON document
(method, settings, fitted scalars). It is stored as one safetensors file whose bytes are
deterministic, so its sha256 identifies the fit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "Heads",
    "Mixture1D",
    "fit_mixture",
    "fit_mixture_fixed_weight",
    "separation",
    "Platt",
    "fit_platt",
    "heads_bytes",
    "heads_from_bytes",
    "torch_generator",
    "batches",
    "state_arrays",
    "load_state",
    "guard_finite",
]

FloatArray = NDArray[np.float32]
_META = "pairclean_refine"
#: Format version of the heads file; bump when a method's arrays change meaning.
HEADS_FORMAT = 2  # 2: doc['p_clean'] holds the p_clean curve (pairclean.refine.p_clean_curve)


@dataclass
class Heads:
    """A fitted method: ``arrays`` (name -> float32 array) and a JSON-able ``doc``.

    ``doc`` always has ``method``, ``settings``, ``seed`` and ``sample_pairs``; methods add
    their fitted scalars (mixture parameters, normalisers).
    """

    method: str
    arrays: dict[str, np.ndarray]
    doc: dict[str, Any] = field(default_factory=dict)
    #: Seconds per fitting epoch (not saved: timings would make the file's bytes vary).
    epoch_seconds: list[float] = field(default_factory=list)

    def sha256(self) -> str:
        """sha256 of the heads file's bytes (identifies the fit)."""
        return hashlib.sha256(heads_bytes(self)).hexdigest()


def heads_bytes(heads: Heads) -> bytes:
    """The heads as safetensors bytes: arrays sorted by name, the doc as sorted JSON metadata."""
    from safetensors.numpy import save

    arrays = {k: np.ascontiguousarray(heads.arrays[k], dtype=np.float32) for k in sorted(heads.arrays)}
    doc = {"format": HEADS_FORMAT, "method": heads.method, **heads.doc}
    return save(arrays, metadata={_META: json.dumps(doc, sort_keys=True)})


def heads_from_bytes(data: bytes) -> Heads:
    """Inverse of ``heads_bytes``; raises ``ValueError`` for a file that is not refine heads."""
    import struct

    from safetensors.numpy import load

    # The header (8-byte little-endian length, then JSON) carries the metadata.
    (size,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    try:
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise ValueError("not a safetensors file") from exc
    if _META not in meta:
        raise ValueError("not a pairclean refine heads file (no pairclean_refine metadata)")
    doc = json.loads(meta[_META])
    if doc.get("format") != HEADS_FORMAT:
        raise ValueError(f"heads format {doc.get('format')!r} is not supported (expected {HEADS_FORMAT})")
    method = doc.pop("method")
    doc.pop("format")
    return Heads(method, dict(load(data)), doc)


@dataclass(frozen=True)
class Mixture1D:
    """A 2-component Gaussian mixture on a 1-D score; ``clean`` says which end is clean.

    ``clean="high"``: the higher-mean component is the clean one (similarities);
    ``clean="low"``: the lower-mean one (losses, as NCR's co-divide).
    """

    means: tuple[float, float]
    variances: tuple[float, float]
    weights: tuple[float, float]
    clean: str = "high"

    def to_json(self) -> dict[str, Any]:
        return {"means": list(self.means), "variances": list(self.variances), "weights": list(self.weights), "clean": self.clean}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Mixture1D:
        return cls(tuple(doc["means"]), tuple(doc["variances"]), tuple(doc["weights"]), doc["clean"])

    def posterior_clean(self, x: FloatArray) -> FloatArray:
        """P(clean | x) for (N,) scores -> (N,) float32 in [0, 1], monotone in x.

        A mixture of unequal variances is not monotone in the far tails (the wider
        component wins on both sides); beyond each component's mean the posterior is held
        at its value there, so a pair cleaner than the clean mean is never called noisier.
        NaN -> 0.
        """
        x = np.asarray(x, dtype=np.float64)
        lo, hi = (0, 1) if self.means[0] <= self.means[1] else (1, 0)
        clean_idx = hi if self.clean == "high" else lo
        m_lo, m_hi = self.means[lo], self.means[hi]
        xc = np.clip(x, m_lo, m_hi) if m_hi > m_lo else np.full_like(x, m_lo)
        logp = []
        for k in range(2):
            var = max(self.variances[k], 1e-12)
            logp.append(np.log(max(self.weights[k], 1e-12)) - 0.5 * np.log(2 * np.pi * var) - 0.5 * (xc - self.means[k]) ** 2 / var)
        a, b = logp[clean_idx], logp[1 - clean_idx]
        post = 1.0 / (1.0 + np.exp(np.clip(b - a, -700, 700)))
        post = np.where(np.isfinite(x), post, 0.0)
        return post.astype(np.float32)


def fit_mixture(
    x: FloatArray, seed: int, clean: str = "high", max_iter: int = 100, tol: float = 1e-3, reg_covar: float = 1e-6, max_points: int = 200_000
) -> Mixture1D:
    """Fit a seeded 2-component mixture on (N,) finite scores (sklearn); see ``Mixture1D``.

    At most ``max_points`` values (a seeded subsample) are used. With fewer than 4 finite
    values or no spread, a degenerate mixture (both components at the mean) is returned,
    whose posterior is its mixing weight everywhere: no NaN.
    """
    from sklearn.mixture import GaussianMixture

    v = np.asarray(x, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size > max_points:
        v = np.random.default_rng(seed).choice(v, size=max_points, replace=False)
    if v.size < 4 or float(v.max() - v.min()) < 1e-9:
        m = float(v.mean()) if v.size else 0.0
        return Mixture1D((m, m), (1.0, 1.0), (0.5, 0.5), clean)
    gmm = GaussianMixture(n_components=2, max_iter=max_iter, tol=tol, reg_covar=reg_covar, random_state=seed)
    gmm.fit(v.reshape(-1, 1))
    return Mixture1D(
        tuple(float(m) for m in gmm.means_.ravel()),  # type: ignore[arg-type]
        tuple(float(c) for c in gmm.covariances_.ravel()),  # type: ignore[arg-type]
        tuple(float(w) for w in gmm.weights_.ravel()),  # type: ignore[arg-type]
        clean,
    )


def fit_mixture_fixed_weight(x: FloatArray, noise_weight: float, iters: int = 300, max_points: int = 200_000, seed: int = 0) -> Mixture1D:
    """A 2-component mixture on (N,) scores (higher = cleaner) whose low component's weight
    is fixed to ``noise_weight`` (clipped to [0.01, 0.99]); EM fits the means and variances.

    Started from a split at the ``noise_weight`` quantile (the low part as the noise side).
    At most ``max_points`` values (a seeded subsample); fewer than 4 finite values or no
    spread give a degenerate mixture (both components at the mean).
    """
    # Hand-written EM: sklearn's GaussianMixture always re-estimates the weights.
    v = np.asarray(x, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size > max_points:
        v = np.random.default_rng(seed).choice(v, size=max_points, replace=False)
    pi = float(np.clip(noise_weight, 0.01, 0.99))
    if v.size < 4 or float(v.max() - v.min()) < 1e-9:
        m = float(v.mean()) if v.size else 0.0
        return Mixture1D((m, m), (1.0, 1.0), (pi, 1 - pi), "high")
    cut = float(np.quantile(v, pi))
    low, high = v[v <= cut], v[v > cut]
    high = high if high.size else v
    floor = max(1e-12, 1e-6 * float(v.var()))
    mu = [float(low.mean()), float(high.mean())]
    var = [max(float(low.var()), floor), max(float(high.var()), floor)]
    weights = (pi, 1 - pi)
    for _ in range(iters):
        logp = [np.log(weights[k]) - 0.5 * np.log(2 * np.pi * var[k]) - 0.5 * (v - mu[k]) ** 2 / var[k] for k in range(2)]
        r_low = 1.0 / (1.0 + np.exp(np.clip(logp[1] - logp[0], -700, 700)))
        resp = (r_low, 1.0 - r_low)
        new_mu = [float((resp[k] * v).sum() / max(resp[k].sum(), 1e-12)) for k in range(2)]
        var = [max(float((resp[k] * (v - new_mu[k]) ** 2).sum() / max(resp[k].sum(), 1e-12)), floor) for k in range(2)]
        moved = max(abs(new_mu[k] - mu[k]) for k in range(2))
        mu = new_mu
        if moved < 1e-9 * (1.0 + abs(mu[1])):
            break
    return Mixture1D((mu[0], mu[1]), (var[0], var[1]), weights, "high")


def separation(mix: Mixture1D) -> float:
    """d' of a 2-component mixture: the distance of its means over their mean spread."""
    return float(abs(mix.means[1] - mix.means[0]) / np.sqrt(max((mix.variances[0] + mix.variances[1]) / 2, 1e-24)))


@dataclass(frozen=True)
class Platt:
    """``p = sigmoid(a (x - mean) / std + b)``: a monotone map from a raw score to a probability."""

    mean: float
    std: float
    a: float
    b: float

    def to_json(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "a": self.a, "b": self.b}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Platt:
        return cls(float(doc["mean"]), float(doc["std"]), float(doc["a"]), float(doc["b"]))

    def __call__(self, x: FloatArray) -> FloatArray:
        """(N,) raw scores -> (N,) float32 in [0, 1]; NaN -> 0."""
        z = self.a * (np.asarray(x, dtype=np.float64) - self.mean) / self.std + self.b
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -700, 700)))
        return np.where(np.isfinite(z), p, 0.0).astype(np.float32)


def fit_platt(x: FloatArray, target: FloatArray, ridge: float = 1e-4, iters: int = 100) -> Platt:
    """Fit ``Platt`` to soft targets in [0, 1] by Newton's method on the mean cross-entropy
    (plus ``ridge * a^2``, which keeps ``a`` finite when the targets are 0/1 and ``x``
    separates them). (N,) scores and targets, finite pairs only; fewer than 2 or no spread
    gives ``a = 0`` and ``b`` the targets' mean log-odds."""
    # Two parameters by Newton's method: sklearn's LogisticRegression takes hard labels
    # only (soft ones would need every row twice, weighted t and 1 - t).
    v = np.asarray(x, dtype=np.float64)
    t = np.asarray(target, dtype=np.float64)
    keep = np.isfinite(v) & np.isfinite(t)
    v, t = v[keep], np.clip(t[keep], 0.0, 1.0)
    mean_t = float(np.clip(t.mean() if t.size else 0.5, 1e-6, 1 - 1e-6))
    prior = float(np.log(mean_t / (1 - mean_t)))
    if v.size < 2 or float(v.std()) < 1e-12:
        return Platt(float(v.mean()) if v.size else 0.0, 1.0, 0.0, prior)
    mean, std = float(v.mean()), float(v.std())
    z = (v - mean) / std
    a, b = 1.0, prior
    for _ in range(iters):
        q = 1.0 / (1.0 + np.exp(-np.clip(a * z + b, -700, 700)))
        r = q - t
        w = np.maximum(q * (1 - q), 1e-12)
        g = np.array([(r * z).mean() + 2 * ridge * a, r.mean()])
        h = np.array([[(w * z * z).mean() + 2 * ridge, (w * z).mean()], [(w * z).mean(), w.mean() + 1e-12]])
        step = np.linalg.solve(h, g)
        a, b = a - float(step[0]), b - float(step[1])
        if float(np.abs(step).max()) < 1e-10:
            break
    return Platt(mean, std, a, b)


def torch_generator(seed: int, salt: int = 0) -> Any:
    """A CPU ``torch.Generator`` seeded from ``seed`` and a per-use ``salt``."""
    import torch

    return torch.Generator().manual_seed(int(seed) * 1_000_003 + salt)


def batches(n: int, batch_size: int, gen: Any) -> Iterator[Any]:
    """Index tensors of one shuffled epoch over ``n`` items; the last short batch is kept
    when it has at least 2 items (a contrastive loss needs a negative)."""
    import torch

    order = torch.randperm(n, generator=gen)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        if idx.numel() >= 2:
            yield idx


def state_arrays(prefix: str, module: Any) -> dict[str, np.ndarray]:
    """A module's parameters and buffers as float32 numpy arrays named ``prefix.name``."""
    return {f"{prefix}.{k}": v.detach().cpu().numpy().astype(np.float32) for k, v in module.state_dict().items()}


def load_state(prefix: str, module: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Load ``state_arrays(prefix, ...)`` back into ``module``; returns it in eval mode."""
    import torch

    state = {k[len(prefix) + 1 :]: torch.from_numpy(np.array(v)) for k, v in arrays.items() if k.startswith(prefix + ".")}
    module.load_state_dict(state)
    return module.eval()


def guard_finite(x: FloatArray, fill: float) -> FloatArray:
    """Replace NaN/inf (a degenerate embedding, a diverged head) by ``fill``."""
    return np.where(np.isfinite(x), x, fill).astype(np.float32)


def residual_adapter(dim: int, hidden: int, gen: Any) -> Any:
    """``x -> normalize(x + W2 relu(W1 x + b1) + b2)``, W2 and b2 zero at init.

    Starting at the identity means a head starts at the estimator's own cosine and only
    learns a correction from the corpus.
    """
    import torch
    from torch import nn

    class Adapter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)
            with torch.no_grad():
                bound = 1.0 / dim**0.5
                self.fc1.weight.uniform_(-bound, bound, generator=gen)
                self.fc1.bias.zero_()
                self.fc2.weight.zero_()
                self.fc2.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.normalize(x + self.fc2(torch.relu(self.fc1(x))), dim=-1, eps=1e-8)

    return Adapter()


def mlp(sizes: list[int], gen: Any, negative_slope: float = 0.2) -> Any:
    """A plain MLP with LeakyReLU between layers, initialised from ``gen`` (reproducible)."""
    import torch
    from torch import nn

    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        lin = nn.Linear(sizes[i], sizes[i + 1])
        with torch.no_grad():
            bound = 1.0 / sizes[i] ** 0.5
            lin.weight.uniform_(-bound, bound, generator=gen)
            lin.bias.uniform_(-bound, bound, generator=gen)
        layers.append(lin)
        if i < len(sizes) - 2:
            layers.append(nn.LeakyReLU(negative_slope))
    return nn.Sequential(*layers)


def apply_chunks(n: int, chunk: int = 8192) -> Iterator[slice]:
    """Fixed-size row chunks for applying heads (same chunking on every executor)."""
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))
