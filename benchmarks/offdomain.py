"""Learned estimators off the estimator's domain: scenes its heads were never trained on.

Issue 12 asks where corpus-fitted heads pay off: on images and captions that the
estimator's heads never saw and that look different from what they saw. pairclean-lite's
towers are generic (ImageNet EfficientNet-Lite0, MiniLM sentences); only its projection
heads are trained on Flickr8k. This benchmark holds whole *scenes* out of that training:

1. Scene of a photo: at least two of its five captions match the scene's words (water:
   water, beach, ocean, lake, pool, river, sea, swim..., surf..., wave..., splash...;
   snow: snow..., ski...). About one photo in five is a water or snow scene.
2. The heads are trained with pairclean-lite's recipe on the train photos of *no* held-out
   scene (a "scene-blind" estimator). For reference, heads trained on every train photo
   (the shipped recipe) are evaluated too.
3. Evaluation sets, every photo with each of its captions: ``off``: held-out-scene photos
   of train and dev (never seen by the scene-blind heads); ``in``: dev photos of other
   scenes. Captions are shuffled at 20%, 50% and 80% as in ``estimators.py``.
4. OSA alone and each learned method (fitted on the noisy set itself, as ``pairclean
   refine`` does) are scored with ``estimators.py``'s metrics.

Prints one JSON line per (heads, set, noise, method).

    python benchmarks/offdomain.py [--noise 0.2 0.5 0.8] [--methods ncr disncl sdcmr ensemble]
                                   [--heads scene_blind all_scenes] [--sets off in]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time

import numpy as np

from _common import flickr_root
from estimators import evaluate_methods, metrics, noisy_pairs, osa_row

SCENES = {
    "water": re.compile(r"\b(water|beach|ocean|lake|pool|river|sea|swim\w*|surf\w*|wave\w*|splash\w*)\b", re.I),
    "snow": re.compile(r"\b(snow\w*|ski|skis|skier\w*|skiing)\b", re.I),
}


def scene_mask(captions: list[tuple[str, ...]], min_hits: int = 2) -> np.ndarray:
    """(I,) True where at least ``min_hits`` captions of a photo name a held-out scene."""
    hits = [sum(any(p.search(c) for p in SCENES.values()) for c in caps) for caps in captions]
    return np.array(hits) >= min_hits


def _captions(root, split: str, names: list[str]) -> list[tuple[str, ...]]:
    from pairclean.lite.evaldata import load_flickr8k

    by_name = {img.image: img.captions for img in load_flickr8k(root, split)}
    return [by_name[n] for n in names]


def _pairs_set(zi: np.ndarray, zt: np.ndarray, owner: np.ndarray, keep: np.ndarray) -> dict[str, np.ndarray]:
    """{"img": (N, D), "txt": (N, C, D)} for the kept photos (C = the fewest captions any has)."""
    photos = np.nonzero(keep)[0]
    caps = [np.nonzero(owner == p)[0] for p in photos]
    c = min(len(x) for x in caps)
    return {"img": zi[photos], "txt": np.stack([zt[x[:c]] for x in caps])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    ap.add_argument("--methods", nargs="+", default=["ncr", "disncl", "sdcmr", "ensemble"])
    ap.add_argument("--heads", nargs="+", default=["scene_blind", "all_scenes"], help="which estimator heads to evaluate")
    ap.add_argument("--sets", nargs="+", default=["off", "in"], help="which evaluation sets")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import torch

    from pairclean.calibrate.calibration import cache_dir
    from pairclean.lite.train import Features, HeadRecipe, _project, extract_features, train_heads

    torch.set_num_threads(os.cpu_count() or 1)
    root = flickr_root()
    feats = extract_features(root, cache_dir() / "features")
    train, dev = feats["train"], feats["dev"]
    scene_train = scene_mask(_captions(root, "train", train.names))
    scene_dev = scene_mask(_captions(root, "dev", dev.names))
    print(json.dumps({"benchmark": "offdomain", "scene_photos_train": int(scene_train.sum()), "train_photos": len(scene_train),
                      "scene_photos_dev": int(scene_dev.sum()), "dev_photos": len(scene_dev)}), flush=True)

    recipe = HeadRecipe()
    keep = np.nonzero(~scene_train)[0]
    remap = -np.ones(len(train.image), dtype=np.int64)
    remap[keep] = np.arange(len(keep))
    cap_keep = remap[train.caption_image] >= 0
    blind_train = Features(train.image[keep], train.text[cap_keep], remap[train.caption_image[cap_keep]], [train.names[i] for i in keep])
    trainers = {"scene_blind": lambda: train_heads(blind_train, recipe), "all_scenes": lambda: train_heads(train, recipe)}
    heads = {name: trainers[name]() for name in args.heads}

    for head_name, state in heads.items():
        zi_tr, zt_tr = _project(state, recipe, train)
        zi_dv, zt_dv = _project(state, recipe, dev)
        off_tr = _pairs_set(zi_tr, zt_tr, train.caption_image, scene_train)
        off_dv = _pairs_set(zi_dv, zt_dv, dev.caption_image, scene_dev)
        c = min(off_tr["txt"].shape[1], off_dv["txt"].shape[1])
        sets = {
            "off": {"img": np.concatenate([off_tr["img"], off_dv["img"]]), "txt": np.concatenate([off_tr["txt"][:, :c], off_dv["txt"][:, :c]])},
            "in": _pairs_set(zi_dv, zt_dv, dev.caption_image, ~scene_dev),
        }
        for set_name, data in ((k, v) for k, v in sets.items() if k in args.sets):
            for noise in args.noise:
                img, txt, noisy = noisy_pairs(data, noise, args.seed)
                base = {"benchmark": "offdomain", "heads": head_name, "set": set_name, "noise": noise, "pairs": len(img)}
                t0 = time.perf_counter()
                raw, p = osa_row(img, txt, args.seed)
                print(json.dumps({**base, "method": "osa", **metrics(raw, p, noisy), "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
                for row in evaluate_methods(img, txt, noisy, args.methods, args.seed):
                    print(json.dumps({**base, **row}), flush=True)


if __name__ == "__main__":
    main()
