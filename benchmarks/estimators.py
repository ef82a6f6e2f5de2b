"""Learned estimators vs OSA alone on Flickr8k dev with shuffled captions (pairclean-lite).

Pairs: every dev image with each of its captions (5,000 pairs); a fraction of the
captions (20%, 50%, 80%) is moved to other pairs as a derangement. The estimator's
embeddings are computed once per run (cached in a temporary .npz, or ``--cache``). Each
method is fitted on the noisy pairs themselves, as ``pairclean refine`` does, and prints
one JSON line per (noise, method): ROC-AUC of the raw score, noise recall and clean
accuracy of ``noisy``, mean-noise-rank ratio, Brier score and expected calibration error
(15 equal-width bins) of ``p_clean``, fit+apply seconds. When ``ensemble`` is among the
methods, the other methods are read from its fitted members (the same fits as lone ones,
same seed and settings), so each noise level fits once; their seconds are then apply only.

    python benchmarks/estimators.py [--noise 0.2 0.5 0.8] [--methods ncr disncl sdcmr ensemble] [--cache FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from _embed_dev import embed_dev


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error of probabilities ``p`` for binary outcomes ``y``."""
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1]), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.mean() * abs(p[m].mean() - y[m].mean())
    return float(total)


def mnr_ratio(score: np.ndarray, noisy: np.ndarray) -> float:
    from scipy.stats import rankdata

    n, k = len(score), int(noisy.sum())
    ranks = rankdata(-score, method="average")
    return float(ranks[noisy].mean() / (n - (k - 1) / 2))


def metrics(raw: np.ndarray, p: np.ndarray, noisy: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score

    clean = ~noisy
    flagged = ~(p > 0.5)
    return {
        "auc": round(float(roc_auc_score(clean, raw)), 4),
        "noise_recall": round(float(flagged[noisy].mean()), 4),
        "clean_accuracy": round(float((~flagged)[clean].mean()), 4),
        "mean_noise_rank_ratio": round(mnr_ratio(raw, noisy), 4),
        "brier": round(float(((p - clean) ** 2).mean()), 4),
        "ece": round(ece(p, clean.astype(float)), 4),
    }


def noisy_pairs(data: dict[str, np.ndarray], noise: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    img = np.repeat(data["img"], data["txt"].shape[1], axis=0)
    txt = data["txt"].reshape(-1, data["txt"].shape[-1]).copy()
    owner = np.repeat(np.arange(len(data["img"])), data["txt"].shape[1])
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(txt), int(round(noise * len(txt))), replace=False)
    src = np.roll(chosen, 1)
    txt[chosen] = txt[src]
    noisy = np.zeros(len(txt), bool)
    noisy[chosen] = owner[src] != owner[chosen]  # a caption of the same image is not noise
    return img, txt, noisy


def osa_row(img: np.ndarray, txt: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """OSA as ``pairclean score`` runs it for pairclean-lite: gmm beta, the calibration's p_clean."""
    from pairclean import osa
    from pairclean.calibrate.calibration import calibrate

    sims = osa.cosine_rows(img, txt)
    cal = calibrate(beta_recipe="gmm", k=256, seed=seed, weighting="paper", batch_size=64, similarities=sims[:4096],
                    image_emb=img[:4096], text_emb=txt[:4096], random_beta=lambda: 0.0)
    return sims, osa.apply_weighting(sims, cal.beta, cal.p_clean_params())


def evaluate_methods(img: np.ndarray, txt: np.ndarray, noisy: np.ndarray, methods: list[str], seed: int) -> Iterator[dict[str, Any]]:
    """One row of ``metrics`` per method, each fitted on the noisy pairs themselves.

    When ``ensemble`` is among ``methods`` it is fitted first and the other methods are read
    from its members (the same fits as lone ones: same seed, default settings), so one fit
    serves all; their seconds are then apply only (``fitted_in_ensemble``).
    """
    from pairclean import refine
    from pairclean.refine import ensemble

    shared, shared_seconds = None, 0.0
    if "ensemble" in methods:
        t0 = time.perf_counter()
        shared = refine.fit("ensemble", img, txt, seed)
        shared_seconds = time.perf_counter() - t0
    for method in methods:
        t0 = time.perf_counter()
        if shared is None:
            heads = refine.fit(method, img, txt, seed)
        else:
            heads = shared if method == "ensemble" else ensemble._member_heads(shared, method)
        raw, p = refine.apply(heads, img, txt)
        seconds = time.perf_counter() - t0 + (shared_seconds if method == "ensemble" else 0.0)
        extra = {"fitted_in_ensemble": True} if shared is not None and method != "ensemble" else {}
        yield {"method": method, "pairs": len(img), **metrics(raw, p, noisy), "seconds": round(seconds, 2), **extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--noise", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    ap.add_argument("--methods", nargs="+", default=["ncr", "disncl", "sdcmr", "ensemble"])
    ap.add_argument("--cache", default=None, help="embeddings cache (.npz); default: a temporary file for this run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        data = embed_dev(Path(args.cache) if args.cache else Path(tmp) / "dev.npz")
        for noise in args.noise:
            img, txt, noisy = noisy_pairs(data, noise, args.seed)
            t0 = time.perf_counter()
            raw, p = osa_row(img, txt, args.seed)
            row = {"noise": noise, "method": "osa", "pairs": len(img), **metrics(raw, p, noisy), "seconds": round(time.perf_counter() - t0, 2)}
            print(json.dumps(row), flush=True)
            for row in evaluate_methods(img, txt, noisy, args.methods, args.seed):
                print(json.dumps({"noise": noise, **row}), flush=True)


if __name__ == "__main__":
    main()
