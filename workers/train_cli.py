"""``pairclean train-lite``: train and select pairclean-lite's projection heads.

Runs a one-factor-at-a-time comparison around the baseline recipe (heads, width,
temperature, epochs, same-image masking, captions per image) and writes the best heads
(by dev ROC-AUC, then R@1) with their recipe and metrics in the file's metadata. The
comparison table goes to ``--report``. The baseline itself came out of a wider search
recorded in ``pipelines/data/MODEL_CARD.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pairclean.errors import InputError

__all__ = ["add_train_parser", "cmd_train_lite", "candidate_recipes"]

log = logging.getLogger(__name__)


def add_train_parser(sub: Any) -> None:
    """Register the ``train-lite`` sub-command."""
    p = sub.add_parser("train-lite", help="train pairclean-lite's projection heads on Flickr8k (train split, selected on dev)")
    p.add_argument("--data", default=None, help="Flickr8k folder (default: $PAIRCLEAN_FLICKR8K or ../shared/data/flickr8k)")
    p.add_argument("--out", required=True, help="where to write the heads (.safetensors)")
    p.add_argument("--report", default=None, help="write the comparison as JSON here")
    p.add_argument("--features-cache", default=None, help="folder for cached tower features")
    p.add_argument("--quick", action="store_true", help="baseline recipe only (no comparison)")
    p.add_argument("--threads", type=int, default=None)


def candidate_recipes() -> tuple[Any, list[tuple[str, Any]]]:
    """The baseline and its one-factor variants, each with a label."""
    from pairclean.lite.train import HeadRecipe

    base = HeadRecipe()
    variants = [
        ("mlp heads", replace(base, proj="mlp")),
        ("width 256", replace(base, embed_dim=256)),
        ("learnable T from 0.1", replace(base, learn_temperature=True)),
        ("fixed T=0.05", replace(base, temperature=0.05)),
        ("fixed T=0.2", replace(base, temperature=0.2)),
        ("1 epoch", replace(base, epochs=1)),
        ("10 epochs", replace(base, epochs=10)),
        ("no same-image masking", replace(base, mask_same_image=False)),
        ("first caption only", replace(base, all_captions=False)),
    ]
    return base, variants


def _score(metrics: dict[str, float]) -> tuple[float, float]:
    return (round(metrics["auc_true_vs_shuffled"], 4), metrics["i2t_r1"] + metrics["t2i_r1"])


def _run(label: str, recipe: Any, feats: dict[str, Any]) -> dict[str, Any]:
    from pairclean.lite.train import evaluate, train_heads

    t0 = time.perf_counter()
    state = train_heads(feats["train"], recipe)
    metrics = evaluate(state, recipe, feats["dev"])
    row = {"label": label, "recipe": asdict(recipe), "dev": metrics, "seconds": round(time.perf_counter() - t0, 1), "state": state}
    print(f"{label:<28} AUC {metrics['auc_true_vs_shuffled']:.4f}  i2t R@1 {metrics['i2t_r1']:.3f}  t2i R@1 {metrics['t2i_r1']:.3f}  ({row['seconds']} s)", flush=True)
    return row


def cmd_train_lite(args: argparse.Namespace) -> int:
    """Extract features (cached), compare recipes, save the best heads."""
    import torch

    from pairclean.calibrate.calibration import cache_dir
    from pairclean.lite.evaldata import find_flickr8k
    from pairclean.lite.train import extract_features, save_heads

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    root = Path(args.data) if args.data else find_flickr8k(os.getcwd())
    if root is None or not (root / "captions.jsonl").exists():
        raise InputError("Flickr8k not found: pass --data /path/to/flickr8k or set PAIRCLEAN_FLICKR8K")
    cache = Path(args.features_cache) if args.features_cache else cache_dir() / "features"
    print(f"extracting (or loading cached) tower features into {cache} ...", flush=True)
    feats = extract_features(root, cache)
    base, variants = candidate_recipes()
    rows = [_run("baseline", base, feats)]
    if not args.quick:
        rows += [_run(label, recipe, feats) for label, recipe in variants]
    best = max(rows, key=lambda r: _score(r["dev"]))
    from pairclean.lite.train import HeadRecipe

    sha = save_heads(Path(args.out), best["state"], HeadRecipe(**best["recipe"]), best["dev"])
    print(f"best: {best['label']} -> {args.out} (sha256 {sha})")
    if args.report:
        report = {"best": best["label"], "sha256": sha, "rows": [{k: v for k, v in r.items() if k != "state"} for r in rows]}
        Path(args.report).write_text(json.dumps(report, indent=2))
    return 0
