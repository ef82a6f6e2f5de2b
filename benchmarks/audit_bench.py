"""The audit loop with a simulated labeller on Flickr8k dev: is the noise-rate interval honest,
how narrow is it with 200 labels, and how well calibrated is the recalibrated p_clean?

For each noise kind and rate it builds dev shards (1,000 images x 5 captions = 5,000
pairs), runs the real ``pairclean score`` command on them (cached in ``--work``), and then,
for each of ``--seeds`` seeds, does what ``pairclean audit`` does: draws ``--labels``
pairs (``draw_design``, stratified by the model's p_clean), labels them with the ground
truth (a perfect labeller, or one who flips ``--labeller-error`` of the labels), and
computes the 95% interval of the noise rate, the isotonic recalibration of p_clean and its
ECE on *all* pairs of the job (15 equal-width bins, against the truth). The precision of
the noisy flag is checked where the sample holds a flagged pair (its interval's coverage
of the true precision, out of the seeds where it is defined).

Noise kinds: ``random`` (captions of a random fraction of pairs permuted among them, none
back on its own image) and ``nearest`` (a pair's caption replaced by the same-numbered
caption of the image nearest to it, by the estimator's own image embedding: near-miss
noise that the model finds hard).

    python benchmarks/audit_bench.py [--seeds 100] [--labels 200] [--noise 0.2 0.5] [--kinds random nearest]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from _common import flickr_root

PER_IMAGE = 5
PER_SHARD = 500


def _pairs(kind: str, rate: float, seed: int, image_emb: dict[str, np.ndarray] | None) -> tuple[list[tuple[str, Path, str]], dict[str, bool]]:
    """(key, image path, caption) of every dev pair, with ``rate`` of them noisy, and the truth."""
    from pairclean.lite.evaldata import load_flickr8k

    images = load_flickr8k(flickr_root(), "dev")
    rng = np.random.default_rng(seed)
    items = [(f"dev/{img.image[:-4]}_{c}", i, c) for i, img in enumerate(images) for c in range(PER_IMAGE)]
    n = len(items)
    chosen = rng.choice(n, size=int(round(rate * n)), replace=False)
    caption = {it[0]: images[it[1]].captions[it[2] % len(images[it[1]].captions)] for it in items}
    noisy = dict.fromkeys(caption, False)
    if kind == "random":
        order = rng.permutation(chosen)
        # a cyclic shift of a random order, skipping sources of the same image
        src = np.roll(order, 1)
        for dst_i, src_i in zip(order, src):
            if items[dst_i][1] == items[src_i][1]:
                src_i = (src_i + PER_IMAGE) % n
            caption[items[dst_i][0]] = images[items[src_i][1]].captions[items[src_i][2] % 5]
            noisy[items[dst_i][0]] = True
    else:
        assert image_emb is not None
        names = [img.image for img in images]
        emb = np.stack([image_emb[name] for name in names]).astype(np.float32)
        sims = emb @ emb.T
        np.fill_diagonal(sims, -np.inf)
        nearest = sims.argmax(1)
        for i in chosen:
            key, img_i, c = items[i]
            caption[key] = images[int(nearest[img_i])].captions[c % 5]
            noisy[key] = True
    pairs = [(key, images[i].path, caption[key]) for key, i, _ in items]
    return pairs, noisy


def _score(folder: Path, pairs: list[tuple[str, Path, str]]) -> Path:
    from pairclean.lite.evaldata import write_pair_shards

    out = folder / "out"
    if (out / "_pairclean" / "job.json").exists() and (folder / "done").exists():
        return out
    shards = write_pair_shards(folder / "shards", pairs, PER_SHARD, "dev")
    subprocess.run([sys.executable, "-m", "pairclean_workers.cli", "score", *shards, "--out", str(out), "--executor", "local",
                    "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    (folder / "done").touch()
    return out


def _image_embeddings(out: Path) -> dict[str, np.ndarray]:
    """Image embedding of each dev image, from a scored job's sidecars (the image's first pair)."""
    from pairclean.output.folder import OutputDir
    from pairclean.output.tables import read_embeddings

    folder = OutputDir(str(out))
    found: dict[str, np.ndarray] = {}
    for record in folder.iter_committed():
        keys = folder.read_scores(record, columns=["key", "status"]).to_pylist()
        img, _ = read_embeddings(folder.read_embeddings_table(record))
        ok_keys = [r["key"] for r in keys if r["status"] == "ok"]
        for key, vec in zip(ok_keys, img):
            found.setdefault(key.split("/")[1].rsplit("_", 1)[0] + ".jpg", vec)
    return found


def evaluate(out: Path, truth: dict[str, bool], seeds: int, labels: int, labeller_error: float) -> dict[str, float]:
    from pairclean.audit import stats
    from pairclean.audit.design import draw_design
    from pairclean.audit.run import population
    from pairclean.output.folder import OutputDir

    pop = population(OutputDir(str(out)))
    y = np.asarray([truth[k] for k in pop.keys], dtype=np.float64)
    true_rate = float(y.mean())
    cover, halves, eces, prec_cover, prec_defined = 0, [], [], 0, 0
    for seed in range(seeds):
        design = draw_design(pop.p_model, labels, seed)
        rows, strata = design.rows, design.strata
        given = y[rows].copy()
        if labeller_error:
            flip = np.random.default_rng(10_000 + seed).random(len(rows)) < labeller_error
            given[flip] = 1 - given[flip]
        iv = stats.noise_rate(design.sizes, strata, given)
        cover += iv.lower <= true_rate <= iv.upper
        halves.append(iv.half_width)
        q = stats.flag_quality(design.sizes, strata, given, pop.noisy[rows])
        true_prec = float(y[pop.noisy].mean()) if pop.noisy.any() else float("nan")
        if q["precision"] is not None:  # None: no flagged pair among the labelled ones
            prec_defined += 1
            prec_cover += q["precision"].lower <= true_prec <= q["precision"].upper
        weight = design.sizes[strata] / np.bincount(strata, minlength=len(design.sizes))[strata]
        knots = stats.fit_recalibration(pop.p_model[rows], 1 - given, weight)
        eces.append(stats.ece(stats.apply_recalibration(knots, pop.p_model), 1 - y))
    return {"pairs": len(pop), "true_rate": true_rate, "coverage": int(cover), "precision_coverage": int(prec_cover), "precision_defined": prec_defined,
            "flagged": int(pop.noisy.sum()),
            "half_width_mean": float(np.mean(halves)), "half_width_max": float(np.max(halves)),
            "ece_model": stats.ece(pop.p_model, 1 - y), "ece_recalibrated_mean": float(np.mean(eces)),
            "ece_recalibrated_max": float(np.max(eces))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--labels", type=int, default=200)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.2, 0.5])
    parser.add_argument("--kinds", nargs="+", default=["random", "nearest"], choices=["random", "nearest"])
    parser.add_argument("--labeller-error", type=float, default=0.0, help="share of labels the simulated labeller gets wrong")
    parser.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pairclean-audit-bench"),
                        help="scored jobs are kept here and reused")
    args = parser.parse_args()
    work = Path(args.work)
    rows = []
    embeddings = None
    for kind in sorted(args.kinds, key=lambda k: k != "random"):  # nearest needs a scored job's image embeddings
        for rate in args.noise:
            if kind == "nearest" and embeddings is None:
                first = work / f"random-{args.noise[0]}"
                if not (first / "done").exists():
                    pairs, _ = _pairs("random", args.noise[0], 0, None)
                    _score(first, pairs)
                embeddings = _image_embeddings(first / "out")
            pairs, truth = _pairs(kind, rate, 0, embeddings)
            folder = work / f"{kind}-{rate}"
            out = _score(folder, pairs)
            row = {"kind": kind, "noise": rate, **evaluate(out, truth, args.seeds, args.labels, args.labeller_error)}
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            rows.append(row)
    print(f"\n{args.labels} labels, {args.seeds} seeds, labeller error {args.labeller_error:g}\n")
    print("| noise kind | noise | pairs | true rate | 95% interval covers truth | mean half-width | max half-width | "
          "flagged noisy | precision interval covers | ECE model p_clean | ECE recalibrated (mean, max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['noise']:.0%} | {r['pairs']} | {r['true_rate']:.3f} | {r['coverage']}/{args.seeds} | "
              f"{100 * r['half_width_mean']:.1f} pts | {100 * r['half_width_max']:.1f} pts | {r['flagged']} | "
              f"{r['precision_coverage']}/{r['precision_defined']} | "
              f"{r['ece_model']:.3f} | {r['ece_recalibrated_mean']:.3f}, {r['ece_recalibrated_max']:.3f} |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
