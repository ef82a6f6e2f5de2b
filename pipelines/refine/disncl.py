"""DisNCL (seed 000) on frozen estimator embeddings. The paper has no public code.

Paper defaults kept: invariant (MII) and exclusive (MEI) parts, encoders and
discriminators are 3-layer MLPs with hidden 256 and LeakyReLU(0.2); gamma 0.5,
beta1 = beta2 = 0.1, beta3 = 0.5, tau 0.05, alpha 0.2, m 10; 5 warm-up epochs, Adam lr 2e-4.

Gaps filled (each a named setting):

- *Pooled features*: the inputs are the estimator's pooled, L2-normalised embeddings
  (no token or region features exist in a sidecar).
- *Sizes*: the invariant part has the embedding's own width ``D`` (512 for pairclean-lite,
  the paper's value) and is ``normalize(x + MLP(x))`` with the MLP's last layer zero at
  init: training starts from the estimator's aligned space instead of relearning it from
  a noisy corpus. The exclusive part has ``exclusive_dim`` (default 128, for speed).
- *Exclusive information*: a linear decoder reconstructs ``x`` from ``[invariant,
  exclusive]`` (MSE, weight 1); without it the exclusive part could be constant and the
  MI terms vacuous.
- *MI to maximise* (invariant image vs invariant text): Jensen-Shannon estimator with a
  learned discriminator on the concatenated codes, negatives by rolling the batch by one
  (weight beta1). *MI to minimise* (invariant vs exclusive, per modality): a
  discriminator of joint vs rolled pairs trained to separate them, the encoders trained
  against it through gradient reversal (weight beta2).
- *Conditional term* ``0.5 ||V_S - T_S||^2`` (weight gamma) on the batch's clean set only
  (pairs that are each other's argmax in both directions), so noisy pairs are not pulled
  together.
- *Alignment*: hardest-negative hinge with per-anchor soft margin
  ``alpha (m^y - 1) / (m - 1)``; ``y = 1`` on the clean set, else NCR's rectified
  ``P`` (mean in-batch hinge, top-10% normaliser) computed from invariant similarities.
- *Soft loss*: cross-entropy of ``softmax(S / tau)`` rows against bootstrapped targets
  ``beta3 e_i + (1 - beta3) p_other`` where ``p_other`` is the other direction's softmax,
  *detached* (weight 1).
- *Warm-up*: the alignment hinge with margin alpha averaged over in-batch negatives only.
- *Probability*: the paper scores by invariant similarity only; ``p_clean`` is the
  posterior of a seeded 2-component mixture fitted on the sample's scores (higher-mean
  component = clean).

Output: raw score ``disncl_score`` = invariant-space cosine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import time
from typing import Any

import numpy as np

from pairclean.refine.common import FloatArray, Heads, Mixture1D, apply_chunks, batches, fit_mixture, guard_finite, load_state, mlp, state_arrays, torch_generator
from pairclean.refine.ncr import mean_hinge, rectified, soft_margin_loss

__all__ = ["DisnclSettings", "fit", "apply", "SCORE_COLUMN"]

SCORE_COLUMN = "disncl_score"


@dataclass(frozen=True)
class DisnclSettings:
    """DisNCL's settings; see the module docstring for which are the paper's."""

    warmup_epochs: int = 5
    epochs: int = 5
    batch_size: int = 128
    lr: float = 2e-4
    hidden: int = 256
    exclusive_dim: int = 128
    gamma: float = 0.5
    beta1: float = 0.1
    beta2: float = 0.1
    beta3: float = 0.5
    tau: float = 0.05
    alpha: float = 0.2
    m: float = 10.0


def _modules(dim: int, s: DisnclSettings, seed: int) -> Any:
    import torch
    from torch import nn

    gen = torch_generator(seed, 21)

    class Invariant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp([dim, s.hidden, s.hidden, dim], gen)
            with torch.no_grad():
                self.net[-1].weight.zero_()
                self.net[-1].bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.normalize(x + self.net(x), dim=-1, eps=1e-8)

    e = s.exclusive_dim
    return nn.ModuleDict({
        "inv_img": Invariant(), "inv_txt": Invariant(),
        "exc_img": mlp([dim, s.hidden, s.hidden, e], gen), "exc_txt": mlp([dim, s.hidden, s.hidden, e], gen),
        "dec_img": mlp([dim + e, dim], gen), "dec_txt": mlp([dim + e, dim], gen),
        "mi_max": mlp([2 * dim, s.hidden, s.hidden, 1], gen),
        "mi_min_img": mlp([dim + e, s.hidden, s.hidden, 1], gen), "mi_min_txt": mlp([dim + e, s.hidden, s.hidden, 1], gen),
    })


def grad_reverse(x: Any, coefficient: float = 1.0) -> Any:
    """Identity forward; the gradient is multiplied by ``-coefficient`` on the way back."""
    import torch

    class Reverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, v: torch.Tensor) -> torch.Tensor:
            return v.view_as(v)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return -coefficient * g

    return Reverse.apply(x)


def _jsd(disc: Any, a: Any, b: Any) -> Any:
    """Jensen-Shannon MI lower bound of (a, b) with negatives from rolling b by one."""
    import torch
    from torch.nn.functional import softplus

    pos = disc(torch.cat([a, b], 1))
    neg = disc(torch.cat([a, b.roll(1, 0)], 1))
    return (-softplus(-pos)).mean() - softplus(neg).mean()


def _step_loss(mods: Any, xi: Any, ti: Any, s: DisnclSettings, warm: bool) -> Any:
    import torch
    from torch.nn.functional import log_softmax, mse_loss, softmax

    vs, ts = mods["inv_img"](xi), mods["inv_txt"](ti)
    sim = vs @ ts.t()
    if warm:
        return mean_hinge(sim).mean()
    with torch.no_grad():
        n = sim.shape[0]
        ar = torch.arange(n)
        clean = (sim.argmax(1) == ar) & (sim.argmax(0) == ar)
        y = torch.where(clean, torch.ones(n), rectified(sim.detach(), 0.1))
        alpha = s.alpha * (s.m**y - 1.0) / (s.m - 1.0)
    align = soft_margin_loss(sim, alpha)
    logits = sim / s.tau
    i2t, t2i = log_softmax(logits, 1), log_softmax(logits.t(), 1)
    eye = torch.eye(sim.shape[0])
    target_i2t = s.beta3 * eye + (1 - s.beta3) * softmax(logits.t(), 1).detach()
    target_t2i = s.beta3 * eye + (1 - s.beta3) * softmax(logits, 1).detach()
    soft = -(target_i2t * i2t).sum(1).mean() - (target_t2i * t2i).sum(1).mean()
    ve, te = mods["exc_img"](xi), mods["exc_txt"](ti)
    rec = mse_loss(mods["dec_img"](torch.cat([vs, ve], 1)), xi) + mse_loss(mods["dec_txt"](torch.cat([ts, te], 1)), ti)
    mi_max = _jsd(mods["mi_max"], vs, ts)
    # The discriminators maximise their JSD; the encoders see it reversed (minimise MI).
    mi_min = _jsd(mods["mi_min_img"], grad_reverse(vs), grad_reverse(ve)) + _jsd(mods["mi_min_txt"], grad_reverse(ts), grad_reverse(te))
    cond = 0.5 * ((vs - ts)[clean] ** 2).sum(1).mean() if bool(clean.any()) else sim.new_zeros(())
    return align + soft + rec - s.beta1 * mi_max - s.beta2 * mi_min + s.gamma * cond


def fit(img: FloatArray, txt: FloatArray, seed: int, settings: DisnclSettings | None = None) -> Heads:
    """Fit DisNCL on (N, D) image and text embeddings (N >= 2); deterministic given ``seed``."""
    import torch

    s = settings or DisnclSettings()
    n, dim = img.shape
    X, T = torch.from_numpy(np.asarray(img)), torch.from_numpy(np.asarray(txt))
    mods = _modules(dim, s, seed)
    opt = torch.optim.Adam(mods.parameters(), lr=s.lr)
    gen = torch_generator(seed, 22)
    epoch_seconds = []
    for epoch in range(s.warmup_epochs + s.epochs):
        t0 = time.perf_counter()
        mods.train()
        for idx in batches(n, s.batch_size, gen):
            loss = _step_loss(mods, X[idx].float(), T[idx].float(), s, warm=epoch < s.warmup_epochs)
            opt.zero_grad()
            loss.backward()
            opt.step()
        epoch_seconds.append(time.perf_counter() - t0)
    mods.eval()
    keep = {k: mods[k] for k in ("inv_img", "inv_txt")}
    arrays = {k2: v for k, m in keep.items() for k2, v in state_arrays(k, m).items()}
    heads = Heads("disncl", arrays, {"settings": asdict(s), "seed": seed, "sample_pairs": n, "dim": dim}, epoch_seconds)
    raw = _scores(heads, X, T)
    heads.doc["mixture"] = fit_mixture(raw, seed, clean="high").to_json()
    return heads


def _scores(heads: Heads, X: Any, T: Any) -> FloatArray:
    import torch

    s = DisnclSettings(**heads.doc["settings"])
    mods = _modules(heads.doc["dim"], s, 0)
    inv_img = load_state("inv_img", mods["inv_img"], heads.arrays)
    inv_txt = load_state("inv_txt", mods["inv_txt"], heads.arrays)
    out = np.empty(X.shape[0], dtype=np.float32)
    with torch.no_grad():
        for sl in apply_chunks(X.shape[0]):
            out[sl] = (inv_img(X[sl].float()) * inv_txt(T[sl].float())).sum(1).numpy()
    return guard_finite(out, -1.0)


def apply(heads: Heads, img: FloatArray, txt: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(raw ``disncl_score``, ``p_clean``) for (N, D) ok pairs: (N,) float32 each."""
    import torch

    raw = _scores(heads, torch.from_numpy(np.asarray(img, np.float32)), torch.from_numpy(np.asarray(txt, np.float32)))
    return raw, Mixture1D.from_json(heads.doc["mixture"]).posterior_clean(raw)
