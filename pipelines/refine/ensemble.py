"""A label-free ensemble of OSA's cosine and the learned methods (NCR, DisNCL, SDCMR).

Every member's raw score is standardised with the mean and standard deviation it has on
the fit sample, and the ensemble score is their weighted mean. A member's weight is its
*separation* on the sample: fit a seeded 2-component mixture on its standardised scores
and take ``|mu_1 - mu_0| / sqrt((var_0 + var_1) / 2)`` (a d'). A member whose scores do not
split into two groups gets little weight; no label is used anywhere. ``p_clean`` is the
posterior of a seeded 2-component mixture fitted on the sample's ensemble scores; the
package's ``fit`` replaces it by its ``p_clean`` curve, and each member keeps its own
curve, so ``_member_heads`` gives the member as a lone fit would.

Output: raw score ``ensemble_score`` (standardised units, higher = cleaner).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pairclean.refine.common import FloatArray, Heads, Mixture1D, fit_mixture, guard_finite

__all__ = ["MEMBERS", "fit", "apply", "SCORE_COLUMN"]

SCORE_COLUMN = "ensemble_score"
#: The members; "osa" is the estimator's own cosine (nothing fitted).
MEMBERS = ("osa", "ncr", "disncl", "sdcmr")


def _member_raw(name: str, heads: Heads | None, img: FloatArray, txt: FloatArray) -> FloatArray:
    from pairclean.refine import METHOD_MODULES

    if name == "osa":
        cosine: FloatArray = (np.asarray(img, np.float32) * np.asarray(txt, np.float32)).sum(1).astype(np.float32)
        return cosine
    assert heads is not None
    raw: FloatArray = METHOD_MODULES[name].apply(heads, img, txt)[0]
    return raw


def _separation(z: FloatArray, seed: int) -> float:
    mix = fit_mixture(z, seed, clean="high")
    spread = np.sqrt(max((mix.variances[0] + mix.variances[1]) / 2, 1e-12))
    return float(abs(mix.means[1] - mix.means[0]) / spread)


def fit(img: FloatArray, txt: FloatArray, seed: int, settings: dict[str, Any] | None = None) -> Heads:
    """Fit every learned member (``settings``: per-member settings objects by name), then
    the standardisation, weights and mixture; deterministic given ``seed``."""
    from pairclean.refine import METHOD_MODULES, p_clean_curve

    settings = settings or {}
    arrays: dict[str, np.ndarray] = {}
    members: dict[str, Any] = {}
    epoch_seconds: list[float] = []
    zs = []
    for name in MEMBERS:
        heads = None
        if name != "osa":
            heads = METHOD_MODULES[name].fit(img, txt, seed, settings.get(name))
            heads.doc["p_clean"] = p_clean_curve(heads, img, txt, seed)  # as a lone fit has it
            arrays.update({f"{name}/{k}": v for k, v in heads.arrays.items()})
            epoch_seconds += heads.epoch_seconds
        raw = _member_raw(name, heads, img, txt)
        mean, std = float(np.mean(raw)), float(np.std(raw)) or 1.0
        z = (raw - mean) / std
        members[name] = {"doc": heads.doc if heads else {}, "mean": mean, "std": std, "weight": _separation(z, seed)}
        zs.append(z)
    total = sum(m["weight"] for m in members.values()) or 1.0
    for m in members.values():
        m["weight"] = m["weight"] / total
    score = sum(members[name]["weight"] * z for name, z in zip(MEMBERS, zs))
    doc = {"settings": {"members": list(MEMBERS)}, "seed": seed, "sample_pairs": int(len(img)), "members": members,
           "mixture": fit_mixture(np.asarray(score, np.float32), seed, clean="high").to_json()}
    return Heads("ensemble", arrays, doc, epoch_seconds)


def _member_heads(heads: Heads, name: str) -> Heads:
    prefix = f"{name}/"
    arrays = {k[len(prefix):]: v for k, v in heads.arrays.items() if k.startswith(prefix)}
    return Heads(name, arrays, heads.doc["members"][name]["doc"])


def apply(heads: Heads, img: FloatArray, txt: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(raw ``ensemble_score``, ``p_clean``) for (N, D) ok pairs: (N,) float32 each."""
    score = np.zeros(len(img), dtype=np.float64)
    for name in MEMBERS:
        m = heads.doc["members"][name]
        raw = _member_raw(name, None if name == "osa" else _member_heads(heads, name), img, txt)
        score += m["weight"] * (raw - m["mean"]) / m["std"]
    raw = guard_finite(score.astype(np.float32), -10.0)
    return raw, Mixture1D.from_json(heads.doc["mixture"]).posterior_clean(raw)
