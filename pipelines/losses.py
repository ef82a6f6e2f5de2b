"""Loss helpers for training on pairclean outputs (torch is imported lazily).

- ``weighted_clip_loss``: OSA's use in training (seed 004): each pair's weight multiplies
  both directions' cross-entropy, and the mean is over the batch size (no renormalisation
  by the sum of weights), as the reference code does.
- ``rcm_loss``: RCSL's robust loss for pseudo-pairs (seed 002),
  ``0.5 * sum_i [(1 - p_ii^i2t) + (1 - p_ii^t2i)]`` with softmax temperature 0.03,
  averaged over the batch so its scale does not grow with the batch size; optional
  per-pair weights (a pseudo-pair's weight) multiply each pair's term, the mean still over
  the batch size, as in ``weighted_clip_loss``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["weighted_clip_loss", "rcm_loss"]


def weighted_clip_loss(image_emb: Any, text_emb: Any, weights: Any, logit_scale: Any = 100.0) -> Any:
    """OSA-weighted symmetric InfoNCE.

    image_emb, text_emb: (B, D) float, L2-normalised; weights: (B,) float in [0, 1];
    logit_scale: scalar (or 0-d tensor), e.g. ``model.logit_scale.exp()``. Returns a 0-d
    tensor: ``sum_i w_i (CE_i2t(i) + CE_t2i(i)) / (2 B)``.
    """
    import torch
    import torch.nn.functional as F

    logits = logit_scale * image_emb @ text_emb.T
    target = torch.arange(logits.shape[0], device=logits.device)
    per_pair = F.cross_entropy(logits, target, reduction="none") + F.cross_entropy(logits.T, target, reduction="none")
    return (weights.to(per_pair.dtype) * per_pair).sum() / (2 * logits.shape[0])


def rcm_loss(image_emb: Any, text_emb: Any, temperature: float = 0.03, weights: Any = None) -> Any:
    """RCSL's robust loss for pseudo-pairs.

    image_emb, text_emb: (B, D) float, L2-normalised, row i a (pseudo-)pair. Returns a 0-d
    tensor ``0.5 * mean_i [(1 - p_ii^i2t) + (1 - p_ii^t2i)]`` where ``p`` are softmaxes of
    the similarities divided by ``temperature``. Bounded in [0, 1] per pair, so a wrong
    pseudo-pair cannot dominate the gradient the way cross-entropy lets it.

    ``weights``: optional (B,) float in [0, 1] (e.g. the pseudo-pairs' ``weight``): pair i's
    term is multiplied by ``w_i`` and the mean stays over B (no renormalisation by the sum
    of weights), so a zero-weight pair drops out; None = all ones.
    """
    import torch

    sims = image_emb @ text_emb.T / temperature
    p_i2t = torch.softmax(sims, dim=1).diagonal()
    p_t2i = torch.softmax(sims, dim=0).diagonal()
    per_pair = (1 - p_i2t) + (1 - p_t2i)
    if weights is not None:
        per_pair = weights.to(per_pair.dtype) * per_pair
    return 0.5 * per_pair.mean()
