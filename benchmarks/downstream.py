"""Does training on noisy pairs get better with pairclean's weights? (Flickr8k, one run)

Setup, all on frozen pairclean-lite tower features (cached by ``pairclean train-lite``):

- The train split's photos are split in two halves by a seeded permutation. The
  *estimator* is pairclean-lite's recipe trained on half A (clean), so it has never seen
  half B's pairs; the *student* trains on half B (all five captions per photo) in which a
  fraction of captions (0%, 20%, 50%) is moved to other photos.
- Half B is scored with the pairclean library itself: estimator embeddings, beta by the
  estimator's default recipe (gmm), calibrated on the first 4,096 pairs, ``paper``
  weighting, noisy flag ``similarity <= beta``. (Photos are not re-decoded: the features
  are exactly what the towers give; ``detection.py`` exercises the score command.)
- The student (same head recipe, same budget: 3 epochs) trains with (a) no weights,
  (b) pairclean weights in the loss, (c) the noisy flag as a hard filter, (d) only the
  truly clean pairs (oracle). Retrieval on the dev split (1,000 photos, first caption).

Prints one JSON line per (noise, variant) with R@1/5/10 both ways.

    python benchmarks/downstream.py [--noise 0 0.2 0.5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import replace
from _common import flickr_root

import numpy as np


def _subset(feats, image_idx: np.ndarray):
    from pairclean.lite_train import Features

    remap = -np.ones(len(feats.image), dtype=np.int64)
    remap[image_idx] = np.arange(len(image_idx))
    keep = remap[feats.caption_image] >= 0
    return Features(feats.image[image_idx], feats.text[keep], remap[feats.caption_image[keep]], [feats.names[i] for i in image_idx])


def _add_noise(feats, rate: float, seed: int):
    """Move ``rate`` of the captions to other photos (never their own); returns feats, noisy mask."""
    from pairclean.lite_train import Features

    rng = np.random.default_rng(seed)
    owner = feats.caption_image.copy()
    noisy = np.zeros(len(owner), dtype=bool)
    chosen = rng.choice(len(owner), size=int(round(rate * len(owner))), replace=False)
    if len(chosen) >= 2:
        new = owner[rng.permutation(chosen)]
        clash = np.nonzero(new == owner[chosen])[0]
        for i in clash:  # swap with a partner so both land on a foreign photo
            for j in rng.permutation(len(chosen)):
                if new[j] != owner[chosen[i]] and new[i] != owner[chosen[j]]:
                    new[i], new[j] = new[j], new[i]
                    break
        owner[chosen] = new
        noisy[chosen] = owner[chosen] != feats.caption_image[chosen]
    return Features(feats.image, feats.text, owner, feats.names), noisy


def _score(estimator_state, recipe, feats):
    """pairclean's weights and flags for (image, caption) pairs, through the library."""
    from pairclean import osa
    from pairclean.calibration import calibrate
    from pairclean.lite_train import _project

    zi, zt = _project(estimator_state, recipe, feats)
    img, txt = zi[feats.caption_image], zt
    sims = osa.cosine_rows(img, txt)
    n = 4096
    cal = calibrate(
        beta_recipe="gmm", k=256, seed=0, weighting="paper", batch_size=64, similarities=sims[:n],
        image_emb=img[:n].astype(np.float16).astype(np.float32), text_emb=txt[:n].astype(np.float16).astype(np.float32),
        random_beta=lambda: float("nan"),
    )
    weights = osa.apply_weighting(sims, cal.beta, osa.WeightingParams(cal.weighting, cal.d_ref, cal.weighting_batch_size))
    return weights, osa.noisy_flags(sims, cal.beta), cal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.2, 0.5])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.disable(logging.WARNING)

    import torch

    from pairclean.calibration import cache_dir
    from pairclean.lite_train import HeadRecipe, evaluate, extract_features, train_heads

    torch.set_num_threads(os.cpu_count() or 1)
    root = flickr_root()
    feats = extract_features(root, cache_dir() / "features")
    perm = np.random.default_rng(args.seed).permutation(len(feats["train"].image))
    half_a, half_b = _subset(feats["train"], np.sort(perm[: len(perm) // 2])), _subset(feats["train"], np.sort(perm[len(perm) // 2 :]))
    recipe = HeadRecipe()
    estimator = train_heads(half_a, recipe)
    for rate in args.noise:
        noisy_b, truth = _add_noise(half_b, rate, args.seed)
        weights, flags, cal = _score(estimator, recipe, noisy_b)
        variants = {
            "a_no_weights": None,
            "b_pairclean_weights": weights,
            "c_noisy_flag_filter": (~flags).astype(np.float32),
            "d_oracle_clean_only": (~truth).astype(np.float32),
        }
        for name, w in variants.items():
            state = train_heads(noisy_b, replace(recipe, seed=args.seed), weights=w)
            metrics = evaluate(state, recipe, feats["dev"])
            row = {"benchmark": "downstream", "noise": rate, "variant": name, "pairs": int(len(truth)),
                   "pairs_used": int((w > 0).sum()) if w is not None else int(len(truth)),
                   "beta": round(cal.beta, 4), "flag_recall": round(float(flags[truth].mean()), 4) if truth.any() else None}
            row.update({k: round(v, 4) for k, v in metrics.items() if k != "auc_true_vs_shuffled"})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
