"""NCR (seed 001) on frozen estimator embeddings, as ``docs/methods.md`` pins it.

Two heads A and B, each a pair of residual MLP adapters (image, text) over the frozen,
L2-normalised embeddings; a head's similarity is the cosine of the adapted embeddings.

- Warm-up (``warmup_epochs``): hinge with margin 0.2 averaged over all in-batch negatives
  (no hardest negative), both directions; Adam lr 2e-4, batch 128.
- Co-divide, every epoch after the warm-up: the per-sample loss ``l_k`` of every sample
  pair is the same mean hinge, but against a *fixed reference set* of ``reference``
  negatives (images and texts of a seeded random subset of the sample), so a pair's loss
  does not depend on batch-mates. Min-max normalised per head; a 2-component mixture
  (``max_iter=10, tol=1e-2, reg_covar=5e-4``, seeded); clean probability = posterior of
  the lower-mean component; clean iff > 0.5. A trains on B's division and vice versa.
- Co-rectify: in a batch, ``p = clamp(0.2 - h, 0, 0.2)`` with ``h`` the pair's mean
  in-batch hinge (the mean of its two directions, so it is on the margin's scale),
  ``tau`` = mean of the top 10% of ``p``, ``P = clamp(p / tau, 0, 1)``. Clean subset
  ``y = w + (1 - w) P`` (``w`` the other head's clean probability), noisy subset
  ``y = (P_A + P_B) / 2``. Soft margin ``alpha = 0.2 (10^y - 1) / 9``, hardest-negative
  hinge with the anchor's own margin in each direction. Clean and noisy pairs share a
  batch (the reference code draws them from two loaders; the loss is the same).
- NaN guards: ``tau = 0`` -> ``P = 0``; ``max = min`` in the normalisation -> range 1;
  non-finite losses -> the maximum (noisy).

Gaps filled: adapters are ``x + W2 relu(W1 x)`` (hidden ``hidden``, W2 zero at init, so
both heads start at the estimator's cosine); A and B differ by their seeds (init and batch
order). A reference pair that is itself in the reference set meets its own caption once
among ``reference`` negatives (a 0.2 / reference shift); not masked, so fitting and
applying compute exactly the same function.

Output: raw score ``ncr_score`` = minus the mean of A's and B's per-pair losses against the
reference set (higher = cleaner); ``p_clean`` = mean of A's and B's posteriors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pairclean.refine.common import FloatArray, Heads, Mixture1D, apply_chunks, batches, fit_mixture, guard_finite, load_state, residual_adapter, state_arrays, torch_generator

__all__ = ["NcrSettings", "fit", "apply", "SCORE_COLUMN"]

log = logging.getLogger(__name__)

SCORE_COLUMN = "ncr_score"
MARGIN = 0.2


@dataclass(frozen=True)
class NcrSettings:
    """NCR's settings (defaults: the reference's, see the module docstring)."""

    warmup_epochs: int = 5
    epochs: int = 5
    batch_size: int = 128
    lr: float = 2e-4
    hidden: int = 256
    reference: int = 256
    top_fraction: float = 0.1


def _heads(dim: int, hidden: int, seed: int, salt: int) -> Any:
    from torch import nn

    gen = torch_generator(seed, salt)
    return nn.ModuleDict({"img": residual_adapter(dim, hidden, gen), "txt": residual_adapter(dim, hidden, gen)})


def mean_hinge(sim: Any) -> Any:
    """(B, B) similarities -> (B,) mean over negatives of both directions' hinge, halved."""
    import torch

    diag = sim.diagonal()
    n = sim.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    i2t = (MARGIN - diag[:, None] + sim).clamp(min=0)[off].view(n, n - 1).mean(1)
    t2i = (MARGIN - diag[None, :] + sim).clamp(min=0).t()[off].view(n, n - 1).mean(1)
    return 0.5 * (i2t + t2i)


def soft_margin_loss(sim: Any, alpha: Any) -> Any:
    """Hardest-negative hinge with per-anchor margins ``alpha`` (B,), both directions."""
    import torch

    diag = sim.diagonal()
    mask = torch.eye(sim.shape[0], dtype=torch.bool)
    i2t = (alpha[:, None] - diag[:, None] + sim).masked_fill(mask, 0).clamp(min=0).max(1).values
    t2i = (alpha[None, :] - diag[None, :] + sim).masked_fill(mask, 0).clamp(min=0).max(0).values
    return (i2t + t2i).mean()


def rectified(sim: Any, top_fraction: float) -> Any:
    """``P`` of co-rectify for one batch: (B, B) -> (B,) in [0, 1], tau = 0 guarded."""
    import torch

    p = (MARGIN - mean_hinge(sim)).clamp(0, MARGIN)
    k = max(1, int(round(top_fraction * p.numel())))
    tau = torch.topk(p, k).values.mean()
    if float(tau) <= 0:
        return torch.zeros_like(p)
    return (p / tau).clamp(0, 1)


def _reference_loss(head: Any, img: Any, txt: Any, ref_img: Any, ref_txt: Any) -> FloatArray:
    """Per-pair loss against the fixed reference negatives: (N, D) x2 -> (N,) float32."""
    import torch

    out = np.empty(img.shape[0], dtype=np.float32)
    with torch.no_grad():
        ri, rt = head["img"](ref_img), head["txt"](ref_txt)
        for sl in apply_chunks(img.shape[0]):
            a, b = head["img"](img[sl].float()), head["txt"](txt[sl].float())
            pos = (a * b).sum(1, keepdim=True)
            i2t = (MARGIN - pos + a @ rt.t()).clamp(min=0).mean(1)
            t2i = (MARGIN - pos + b @ ri.t()).clamp(min=0).mean(1)
            out[sl] = (0.5 * (i2t + t2i)).numpy()
    return guard_finite(out, float(np.nanmax(out)) if np.isfinite(out).any() else MARGIN)


def _divide(loss: FloatArray, seed: int) -> tuple[FloatArray, dict[str, Any]]:
    """Co-divide one head: min-max normalise, fit the pinned mixture, clean posterior."""
    lo, hi = float(loss.min()), float(loss.max())
    span = hi - lo if hi - lo > 1e-12 else 1.0  # guard: min = max
    norm = (loss - lo) / span
    mix = fit_mixture(norm, seed, clean="low", max_iter=10, tol=1e-2, reg_covar=5e-4)
    return mix.posterior_clean(norm), {"min": lo, "span": span, "mixture": mix.to_json()}


def fit(img: FloatArray, txt: FloatArray, seed: int, settings: NcrSettings | None = None) -> Heads:
    """Fit NCR on (N, D) image and text embeddings (N >= 2); deterministic given ``seed``."""
    import torch

    s = settings or NcrSettings()
    n, dim = img.shape
    X, T = torch.from_numpy(np.asarray(img)), torch.from_numpy(np.asarray(txt))  # kept in their dtype (float16 saves memory)
    rng = np.random.default_rng(seed)
    ref = np.sort(rng.choice(n, size=min(s.reference, n), replace=False))
    ref_img, ref_txt = X[ref].float(), T[ref].float()
    heads = [_heads(dim, s.hidden, seed, 1), _heads(dim, s.hidden, seed, 2)]
    opts = [torch.optim.Adam(h.parameters(), lr=s.lr) for h in heads]
    gens = [torch_generator(seed, 11), torch_generator(seed, 12)]
    epoch_seconds: list[float] = []
    for epoch in range(s.warmup_epochs):
        t0 = time.perf_counter()
        for h, opt, gen in zip(heads, opts, gens):
            h.train()
            for idx in batches(n, s.batch_size, gen):
                sim = h["img"](X[idx].float()) @ h["txt"](T[idx].float()).t()
                loss = mean_hinge(sim).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        epoch_seconds.append(time.perf_counter() - t0)
    for epoch in range(s.epochs):
        t0 = time.perf_counter()
        w = [_divide(_reference_loss(h, X, T, ref_img, ref_txt), seed + epoch)[0] for h in heads]
        for k, (h, opt, gen) in enumerate(zip(heads, opts, gens)):
            other = heads[1 - k]
            w_other = torch.from_numpy(w[1 - k])  # A trains on B's division and vice versa
            h.train()
            for idx in batches(n, s.batch_size, gen):
                xi, ti = X[idx].float(), T[idx].float()
                sim = h["img"](xi) @ h["txt"](ti).t()
                with torch.no_grad():
                    p_self = rectified(sim.detach(), s.top_fraction)
                    p_other = rectified(other["img"](xi) @ other["txt"](ti).t(), s.top_fraction)
                    wi = w_other[idx]
                    clean = wi > 0.5
                    y = torch.where(clean, wi + (1 - wi) * p_self, 0.5 * (p_self + p_other))
                    alpha = MARGIN * (10.0**y - 1.0) / 9.0
                loss = soft_margin_loss(sim, alpha)
                opt.zero_grad()
                loss.backward()
                opt.step()
        epoch_seconds.append(time.perf_counter() - t0)
    for h in heads:
        h.eval()
    divisions = [_divide(_reference_loss(h, X, T, ref_img, ref_txt), seed + s.epochs)[1] for h in heads]
    arrays = {**state_arrays("A", heads[0]), **state_arrays("B", heads[1]), "ref_img": ref_img.numpy(), "ref_txt": ref_txt.numpy()}
    doc = {"settings": asdict(s), "seed": seed, "sample_pairs": n, "dim": dim, "divide": {"A": divisions[0], "B": divisions[1]}}
    return Heads("ncr", arrays, doc, epoch_seconds)


def apply(heads: Heads, img: FloatArray, txt: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(raw ``ncr_score``, ``p_clean``) for (N, D) ok pairs: (N,) float32 each."""
    import torch

    s = NcrSettings(**heads.doc["settings"])
    dim = heads.doc["dim"]
    ref_img, ref_txt = torch.from_numpy(heads.arrays["ref_img"]), torch.from_numpy(heads.arrays["ref_txt"])
    X, T = torch.from_numpy(np.asarray(img, dtype=np.float32)), torch.from_numpy(np.asarray(txt, dtype=np.float32))
    losses, posts = [], []
    for name in ("A", "B"):
        head = load_state(name, _heads(dim, s.hidden, 0, 0), heads.arrays)
        loss = _reference_loss(head, X, T, ref_img, ref_txt) if len(img) else np.zeros(0, np.float32)
        div = heads.doc["divide"][name]
        norm = (loss - div["min"]) / div["span"]
        losses.append(loss)
        posts.append(Mixture1D.from_json(div["mixture"]).posterior_clean(norm))
    raw = -0.5 * (losses[0] + losses[1])
    p = np.clip(0.5 * (posts[0] + posts[1]), 0.0, 1.0)
    return guard_finite(raw, -MARGIN * 2), guard_finite(p, 0.0)
