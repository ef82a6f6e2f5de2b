"""Ranking and calibration measures of pair scores (pure numpy; labels: True = clean)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["roc_auc", "ece", "brier"]


def roc_auc(scores: NDArray[np.floating], labels: NDArray[np.bool_]) -> float:
    """ROC-AUC of ``scores`` (N,) for the positive ``labels`` (N,) (ties averaged); NaN if one class is empty."""
    scores = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # average ranks of ties
    starts = np.r_[0, np.nonzero(np.diff(sorted_scores))[0] + 1]
    ends = np.r_[starts[1:], len(scores)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = 0.5 * (s + e - 1) + 1
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def ece(p_clean: NDArray[np.floating], labels: NDArray[np.bool_], bins: int = 10) -> float:
    """Expected calibration error of ``p_clean`` (N,) in ``bins`` equal-width bins."""
    p = np.asarray(p_clean, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    which = np.minimum((p * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * abs(p[sel].mean() - y[sel].mean())
    return float(total / max(1, len(p)))


def brier(p_clean: NDArray[np.floating], labels: NDArray[np.bool_]) -> float:
    """Mean squared error of ``p_clean`` (N,) against the 0/1 ``labels``."""
    return float(np.mean((np.asarray(p_clean, np.float64) - np.asarray(labels, np.float64)) ** 2))
