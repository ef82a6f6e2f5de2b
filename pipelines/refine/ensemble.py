"""A label-free ensemble of OSA's score and the learned methods (NCR, DisNCL, SDCMR).

Every member's raw score is standardised with the mean and standard deviation it has on
the fit sample, and the ensemble score is their weighted mean. A member's weight is its
*separation* on held-out pairs: fit a seeded 2-component mixture on its standardised scores
and take ``|mu_1 - mu_0| / sqrt((var_0 + var_1) / 2)`` (a d'). A member whose scores do not
split into two groups gets little weight; no label is used anywhere.

Never worse than OSA (issue 21): the learned members are fitted on a seeded
``1 - HOLDOUT`` share of the sample and judged on the rest, which they never saw. The
ensemble is ``(1 - blend) * OSA + blend * learned``, where ``learned`` is the
separation-weighted mean of the learned members and ``blend`` the value of ``BLENDS`` whose
score separates the held-out pairs best (d' as above). Where the learned members do not
split the held-out pairs better than OSA's score (in the estimator's domain, typically)
the blend falls to 0 and refine is OSA; off domain, where they do, it rises. The choice,
with every candidate's held-out separation (and the referee's agreement, below), is in
``doc["choice"]``.
Samples of fewer than ``MIN_HOLDOUT_SAMPLE`` pairs hold nothing out (judged in-sample). ``p_clean`` is the
posterior of a seeded 2-component mixture fitted on the sample's ensemble scores; the
package's ``fit`` replaces it by its ``p_clean`` curve, and each member keeps its own
curve, so ``_member_heads`` gives the member as a lone fit would.

A referee, where the job has one (``referee``: the judge's ratios of the sample pairs, on
corpora where its word check is on): a blend is a candidate only if its held-out score agrees
with the referee (Spearman) at least as well as OSA's does and as the plain cosine does; the
best candidate by d' as above. Why: d' measures how bimodal a score is, not whether it is
right. On the hard-noise benchmark's ``retrieved`` corpus (each photo with its own and two
near-miss captions) the learned members split the held-out pairs best and were chosen, yet
ranked worse than the scored job (AUC 0.625 against 0.660) and agreed less with the judge
(0.544 against 0.628); on one-word edits at 20% likewise (0.585 against 0.599; 0.467 against
0.552). Why the cosine too: the judge reads the pair's plain cosine, so any cosine-like score
agrees with it in part for that reason alone, and the learned members are cosine-like
reorderings of the embeddings. Under the corpus contrast's version 2 (its caption rival at
full weight) the adjusted similarity agrees less with the judge than the cosine does (0.49
against 0.60 on near-image captions at 20%), and learned blends that only beat the adjusted
similarity's agreement were let in and ranked worse than the score (near-image captions
0.718 / 0.700 -> 0.646 / 0.609, ``retrieved`` 0.693 -> 0.629). A learned blend must now agree
with the judge better than the cosine it reorders.

OSA's member is the job's own score when the caller gives it (``osa``: what ``pairclean
score`` calibrated, the corpus contrast's adjusted similarity when the job has one), else the
cosine. Why: with the cosine as OSA, the member lost what the contrast adds on near-misses
(hard-noise benchmark, ``retrieved``: the cosine's AUC 0.596, the adjusted similarity's 0.660).

Output: raw score ``ensemble_score`` (standardised units, higher = cleaner).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pairclean.osa import cosine_rows
from pairclean.refine.common import FloatArray, Heads, Mixture1D, fit_mixture, guard_finite

__all__ = ["MEMBERS", "fit", "apply", "uses_only_osa", "SCORE_COLUMN"]

SCORE_COLUMN = "ensemble_score"
#: The members; "osa" is the job's own score, or the estimator's cosine (nothing fitted).
MEMBERS = ("osa", "ncr", "disncl", "sdcmr")
#: Share of the sample held out to judge the members (never fitted on).
HOLDOUT = 0.3
#: Fewer sample pairs than this and nothing is held out.
MIN_HOLDOUT_SAMPLE = 200
#: Candidate shares of the learned members in the ensemble score (the rest is OSA's cosine).
BLENDS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: How much better (relative d') a blend must separate the held-out pairs than OSA alone.
MIN_GAIN = 0.1


def _member_raw(name: str, heads: Heads | None, img: FloatArray, txt: FloatArray, osa: FloatArray | None = None) -> FloatArray:
    from pairclean.refine import METHOD_MODULES

    if name == "osa":
        if osa is not None:
            return np.asarray(osa, np.float32)
        cosine: FloatArray = (np.asarray(img, np.float32) * np.asarray(txt, np.float32)).sum(1).astype(np.float32)
        return cosine
    assert heads is not None
    raw: FloatArray = METHOD_MODULES[name].apply(heads, img, txt)[0]
    return raw


def _separation(z: FloatArray, seed: int) -> float:
    mix = fit_mixture(z, seed, clean="high")
    spread = np.sqrt(max((mix.variances[0] + mix.variances[1]) / 2, 1e-12))
    return float(abs(mix.means[1] - mix.means[0]) / spread)


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit indices, held-out indices) of a sample of ``n`` pairs; both all pairs when small."""
    if n < MIN_HOLDOUT_SAMPLE:
        every = np.arange(n)
        return every, every
    perm = np.random.default_rng([seed, 21]).permutation(n)
    hold = int(round(HOLDOUT * n))
    return np.sort(perm[hold:]), np.sort(perm[:hold])


#: Held-out pairs with a referee score needed before the referee is consulted.
MIN_REFEREE_PAIRS = 50


def spearman(a: FloatArray, b: FloatArray) -> float:
    """Rank correlation of (N,) ``a`` and ``b`` (scipy's; 0 where either is constant)."""
    from scipy.stats import spearmanr

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return 0.0
    return float(spearmanr(np.asarray(a, np.float64), np.asarray(b, np.float64))[0])


def choose_blend(z_osa: FloatArray, z_learned: FloatArray, seed: int,
                 referee: FloatArray | None = None,
                 cosine: FloatArray | None = None) -> tuple[float, dict[str, float], dict[str, float]]:
    """The blend of OSA's and the learned members' standardised held-out scores (N,) each
    that separates them best (see the module docstring), each candidate's d', and each
    candidate's agreement with ``referee`` (N,) (NaN: no referee score; empty when unused),
    plus the held-out plain ``cosine``'s (N,) as ``"cosine"`` when given: a learned blend must
    agree at least as well as OSA's score and the cosine."""
    blends = {f"{b:g}": ((1 - b) * z_osa + b * z_learned).astype(np.float32) for b in BLENDS}
    seps = {name: _separation(z, seed) for name, z in blends.items()}
    agreement: dict[str, float] = {}
    candidates = list(BLENDS)
    if referee is not None:
        has = np.isfinite(np.asarray(referee, np.float64))
        if int(has.sum()) >= MIN_REFEREE_PAIRS:
            agreement = {name: spearman(z[has], np.asarray(referee)[has]) for name, z in blends.items()}
            bar = agreement["0"]
            if cosine is not None:
                agreement["cosine"] = spearman(np.asarray(cosine, np.float32)[has], np.asarray(referee)[has])
                bar = max(bar, agreement["cosine"])
            candidates = [0.0] + [b for b in BLENDS if b > 0 and agreement[f"{b:g}"] >= bar]
    base = seps["0"]
    best = max(candidates, key=lambda b: seps[f"{b:g}"])
    if seps[f"{best:g}"] < base * (1 + MIN_GAIN):
        best = 0.0  # not clearly better than OSA's own score: use that
    return float(best), seps, agreement


def fit(img: FloatArray, txt: FloatArray, seed: int, settings: dict[str, Any] | None = None, osa: FloatArray | None = None,
        referee: FloatArray | None = None) -> Heads:
    """Fit every learned member (``settings``: per-member settings objects by name) on the
    fit part of the sample, then weights, blend and mixture on the held-out part;
    deterministic given ``seed``. ``osa``: (N,) the job's own score of each sample pair
    (default: the cosine); ``referee``: (N,) the judge's ratios (NaN where not judged), or None."""
    from pairclean.refine import METHOD_MODULES, p_clean_curve

    settings = settings or {}
    fit_idx, hold_idx = _split(len(img), seed)
    img_f, txt_f, img_h, txt_h = img[fit_idx], txt[fit_idx], img[hold_idx], txt[hold_idx]
    osa_all = None if osa is None else np.asarray(osa, np.float32)
    osa_f, osa_h = (None, None) if osa_all is None else (osa_all[fit_idx], osa_all[hold_idx])
    arrays: dict[str, np.ndarray] = {}
    members: dict[str, Any] = {}
    epoch_seconds: list[float] = []
    held: dict[str, np.ndarray] = {}
    for name in MEMBERS:
        heads = None
        if name != "osa":
            heads = METHOD_MODULES[name].fit(img_f, txt_f, seed, settings.get(name))
            heads.doc["p_clean"] = p_clean_curve(heads, img_f, txt_f, seed)  # as a lone fit has it
            arrays.update({f"{name}/{k}": v for k, v in heads.arrays.items()})
            epoch_seconds += heads.epoch_seconds
        raw = _member_raw(name, heads, img_f, txt_f, osa_f)
        mean, std = float(np.mean(raw)), float(np.std(raw)) or 1.0
        z = ((_member_raw(name, heads, img_h, txt_h, osa_h) - mean) / std).astype(np.float32)
        members[name] = {"doc": heads.doc if heads else {}, "mean": mean, "std": std, "held_out_separation": _separation(z, seed)}
        held[name] = z
    learned = [m for m in MEMBERS if m != "osa"]
    total = sum(members[m]["held_out_separation"] for m in learned) or 1.0
    z_learned = sum((members[m]["held_out_separation"] / total) * held[m] for m in learned)
    held_referee = None if referee is None else np.asarray(referee, np.float32)[hold_idx]
    blend, seps, agreement = choose_blend(held["osa"], np.asarray(z_learned, np.float32), seed, held_referee,
                                          cosine_rows(img_h, txt_h))
    members["osa"]["weight"] = 1.0 - blend
    for m in learned:
        members[m]["weight"] = blend * members[m]["held_out_separation"] / total
    score = sum(members[m]["weight"] * ((_member_raw(m, None if m == "osa" else _member_heads_of(arrays, members, m), img, txt, osa_all)
                                          - members[m]["mean"]) / members[m]["std"]) for m in MEMBERS if members[m]["weight"] > 0)
    choice = {"blend": blend, "used": "osa" if blend == 0 else ("learned" if blend == 1 else "blend"),
              "held_out_pairs": int(len(hold_idx)), "fit_pairs": int(len(fit_idx)), "held_out_separation": seps,
              "referee_agreement": agreement,
              "member_weights": {m: round(float(members[m]["weight"]), 4) for m in MEMBERS}}
    doc = {"settings": {"members": list(MEMBERS)}, "osa_member": "cosine" if osa is None else "given", "seed": seed, "sample_pairs": int(len(img)), "members": members, "choice": choice,
           "mixture": fit_mixture(np.asarray(score, np.float32), seed, clean="high").to_json()}
    return Heads("ensemble", arrays, doc, epoch_seconds)


def _member_heads_of(arrays: dict[str, np.ndarray], members: dict[str, Any], name: str) -> Heads:
    prefix = f"{name}/"
    return Heads(name, {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}, members[name]["doc"])


def _member_heads(heads: Heads, name: str) -> Heads:
    prefix = f"{name}/"
    arrays = {k[len(prefix):]: v for k, v in heads.arrays.items() if k.startswith(prefix)}
    return Heads(name, arrays, heads.doc["members"][name]["doc"])


def uses_only_osa(heads: Heads) -> bool:
    """Whether fitted ensemble ``heads`` chose OSA alone on their corpus (blend 0)."""
    return bool(heads.doc.get("choice", {}).get("blend", 1.0) == 0.0)


def apply(heads: Heads, img: FloatArray, txt: FloatArray, osa: FloatArray | None = None) -> tuple[FloatArray, FloatArray]:
    """(raw ``ensemble_score``, ``p_clean``) for (N, D) ok pairs: (N,) float32 each.
    ``osa``: (N,) the job's own score of each pair, as ``fit`` took it (default: the cosine)."""
    score = np.zeros(len(img), dtype=np.float64)
    for name in MEMBERS:
        m = heads.doc["members"][name]
        if m["weight"] == 0:
            continue  # not used on this corpus (doc["choice"]): skip its cost
        raw = _member_raw(name, None if name == "osa" else _member_heads(heads, name), img, txt, osa)
        score += m["weight"] * (raw - m["mean"]) / m["std"]
    raw = guard_finite(score.astype(np.float32), -10.0)
    return raw, Mixture1D.from_json(heads.doc["mixture"]).posterior_clean(raw)
