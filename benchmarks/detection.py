"""Noise detection quality of `pairclean score` on Flickr8k dev with shuffled captions.

For each noise rate (default 0%, 20%, 50%) builds shards of the dev split (first caption
of every image; a chosen fraction of captions permuted so none returns to its image),
runs the real ``pairclean score`` command, then ``pairclean rescore`` for every other beta
recipe (no re-embedding), and prints one JSON line per (noise rate, recipe) with:

- ``auc_similarity`` / ``auc_weight``: ROC-AUC for telling clean from noisy pairs;
- ``noise_recall`` / ``clean_accuracy``: of the noisy flag (similarity <= beta);
- ``mean_noise_rank_ratio``: mean rank of noisy pairs with weights sorted descending,
  divided by the optimal one (all noisy pairs last), seed 004 Table 9;
- ``noise_rate_estimate`` (as `pairclean inspect` reports it) against ``noise_rate_true``;
- ``pairs_per_s`` of the score command (wall clock, model load included).

    python benchmarks/detection.py [--noise 0 0.2 0.5] [--model pairclean-lite] [--limit 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import flickr_root

import numpy as np


def build_shards(folder: Path, noise: float, limit: int, per_shard: int, seed: int) -> tuple[list[str], dict[str, bool]]:
    """Dev-split shards with ``noise`` of captions shuffled; returns shard paths and key -> noisy."""
    from pairclean.lite.evaldata import load_flickr8k, noisy_pairing, write_pair_shards

    root = flickr_root()
    paired = noisy_pairing(load_flickr8k(root, "dev")[:limit], noise, seed=seed)
    keys = [f"dev/{img.image[:-4]}" for img in paired.images]
    truth = {key: bool(n) for key, n in zip(keys, paired.noisy)}
    pairs = [(key, img.path, cap) for key, img, cap in zip(keys, paired.images, paired.captions)]
    paths = write_pair_shards(folder, pairs, per_shard, "dev")
    return paths, truth


def mean_noise_rank_ratio(weights: np.ndarray, noisy: np.ndarray) -> float:
    """Mean rank (1-based, weights descending, ties averaged) of noisy pairs / the optimal one."""
    from scipy.stats import rankdata

    n, k = len(weights), int(noisy.sum())
    if k == 0:
        return float("nan")
    ranks = rankdata(-weights, method="average")
    optimal = n - (k - 1) / 2
    return float(ranks[noisy].mean() / optimal)


def metrics(out: Path, truth: dict[str, bool]) -> dict[str, float]:
    """Detection metrics of a scored output folder against the ground truth."""
    import pyarrow.parquet as pq

    from pairclean.output.folder import OutputDir
    from pairclean.lite.train import roc_auc
    from pairclean.output.report import summarize

    rows = []
    for path in sorted(out.glob("dev-*.parquet")):
        if path.name.endswith(".emb.parquet"):
            continue
        rows.extend(pq.read_table(path, columns=["key", "status", "similarity", "weight", "noisy"]).to_pylist())
    rows = [r for r in rows if r["status"] == "ok"]
    noisy = np.array([truth[r["key"]] for r in rows])
    clean = ~noisy
    sims = np.array([r["similarity"] for r in rows], dtype=np.float64)
    weights = np.array([r["weight"] for r in rows], dtype=np.float64)
    flagged = np.array([r["noisy"] for r in rows])
    return {
        "pairs": len(rows),
        "auc_similarity": roc_auc(sims, clean),
        "auc_weight": roc_auc(weights, clean),
        "noise_recall": float(flagged[noisy].mean()) if noisy.any() else float("nan"),
        "clean_accuracy": float((~flagged[clean]).mean()) if clean.any() else float("nan"),
        "flag_accuracy": float((flagged == noisy).mean()),
        "mean_noise_rank_ratio": mean_noise_rank_ratio(weights, noisy),
        "noise_rate_true": float(noisy.mean()),
        # what `pairclean inspect` reports: mixture with the noise side pinned to mismatched pairs
        "noise_rate_estimate": summarize(OutputDir(str(out))).noise_rate_gmm,
    }


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.2, 0.5])
    parser.add_argument("--model", default="pairclean-lite")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--recipes", nargs="+", default=["random-inputs", "shuffled", "gmm"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    exe = [sys.executable, "-m", "pairclean_workers.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        for noise in args.noise:
            folder = Path(tmp) / f"noise-{noise}"
            shards, truth = build_shards(folder / "shards", noise, args.limit, args.per_shard, args.seed)
            out = folder / "out"
            model = ["--model", args.model] + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
            first, *rest = args.recipes
            seconds = _run([*exe, "score", *shards, "--out", str(out), *model, "--beta-recipe", first, "--no-progress"])
            for i, recipe in enumerate([first, *rest]):
                if i:
                    _run([*exe, "rescore", str(out), "--beta-recipe", recipe, "--weighting", "paper"])
                beta = json.loads((out / "_calibration.json").read_text())["beta"]
                row = {"benchmark": "detection", "model": args.model, "noise": noise, "beta_recipe": recipe, "beta": beta}
                row.update(metrics(out, truth))
                if i == 0:
                    row["pairs_per_s"] = row["pairs"] / seconds
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
