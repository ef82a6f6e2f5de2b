"""Scale of ``pairclean refine`` on synthetic planted embeddings (no images needed).

Prints JSON lines:

- ``fit_epoch``: NCR seconds per epoch (warm-up and co-rectify) at several sample sizes;
- ``apply``: pairs/s of applying NCR heads with one torch thread (per CPU core);
- ``refine``: a whole ``pairclean refine --executor local`` of a job of ``--pairs`` pairs
  (``--shards`` shards) in a subprocess: wall seconds and its peak RSS.

    python benchmarks/refine_scale.py [--pairs 1000000] [--dim 256] [--set warmup_epochs=1 --set epochs=1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def planted(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = centres[rng.integers(0, len(centres), n)] + 0.6 * rng.normal(size=(n, dim)).astype(np.float32)
    img = z + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    txt = z + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    chosen = rng.choice(n, int(0.3 * n), replace=False)
    txt[chosen] = txt[np.roll(chosen, 1)]
    noisy = np.zeros(n, bool)
    noisy[chosen] = True
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    return unit(img), unit(txt), noisy


def build_job(uri: str, pairs: int, shards: int, dim: int, seed: int = 0) -> None:
    """A scored job folder of planted pairs, written shard by shard through the output APIs."""
    from pairclean.calibrate.calibration import calibrate
    from pairclean.spec import JobSpec, spec_digest
    from pairclean.output.folder import OutputDir, ShardRecord
    from pairclean.output.tables import embeddings_table, output_metadata, scores_table

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(64, dim)).astype(np.float32)
    per = pairs // shards
    names = tuple(f"/synthetic/part-{s:05d}.tar" for s in range(shards))
    spec = JobSpec(names, "synthetic", None, None, "fp32", "shuffled", 64, "paper", 0, 64, 1, None, True, 4096)
    out = OutputDir(uri)
    out.prepare(spec, overwrite=False)
    img, txt, _ = planted(4096, dim, rng, centres)
    cal = calibrate(beta_recipe="shuffled", k=64, seed=0, weighting="paper", batch_size=64, similarities=(img * txt).sum(1),
                    image_emb=img, text_emb=txt, random_beta=lambda: 0.0)
    out.write_calibration(cal)
    for s in range(shards):
        img, txt, _ = planted(per, dim, rng, centres)
        keys = [f"{s:05d}/{i:06d}" for i in range(per)]
        meta = output_metadata({"model_id": "synthetic", "embed_dim": dim, "checkpoint_sha256": None}, cal,
                               {"shard": names[s], "job": spec_digest(spec)})
        stem = f"part-{s:05d}"
        info = out.write_table(out.score_name(stem), scores_table(names[s], keys, np.arange(per), ["ok"] * per, [None] * per,
                                                                    (img * txt).sum(1), cal, meta))
        out.write_table(out.emb_name(stem), embeddings_table(keys, img, txt, np.ones(per, bool), meta))
        out.record_completion(ShardRecord(names[s], stem, None, per, out.score_name(stem), info.sha256, info.bytes, {"ok": per}, out.emb_name(stem)))
    out.compact()


def fit_epochs(dim: int, sizes: list[int]) -> None:
    import torch

    from pairclean import refine

    torch.set_num_threads(2)
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(64, dim)).astype(np.float32)
    for n in sizes:
        img, txt, _ = planted(n, dim, rng, centres)
        heads = refine.fit("ncr", img.astype(np.float16), txt.astype(np.float16), 0, {"warmup_epochs": 1, "epochs": 1})
        print(json.dumps({"bench": "fit_epoch", "method": "ncr", "sample_pairs": n, "warmup_epoch_s": round(heads.epoch_seconds[0], 2),
                          "corectify_epoch_s": round(heads.epoch_seconds[1], 2),
                          "us_per_pair_epoch": round(1e6 * sum(heads.epoch_seconds) / (2 * n), 2)}), flush=True)
    torch.set_num_threads(1)
    img, txt, _ = planted(200_000, dim, rng, centres)
    t0 = time.perf_counter()
    refine.apply(heads, img, txt)
    dt = time.perf_counter() - t0
    print(json.dumps({"bench": "apply", "method": "ncr", "pairs": 200_000, "threads": 1, "pairs_per_s_per_core": round(200_000 / dt)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 40_000, 160_000])
    ap.add_argument("--set", action="append", default=[], help="passed to pairclean refine --set")
    ap.add_argument("--skip-fit-epochs", action="store_true")
    args = ap.parse_args()
    if not args.skip_fit_epochs:
        fit_epochs(args.dim, args.sizes)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_job(f"{tmp}/job", args.pairs, args.shards, args.dim)
        build_s = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "pairclean_workers.cli", "refine", f"{tmp}/job", "--executor", "local", "--method", "ncr"]
        for s in args.set:
            cmd += ["--set", s]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(json.dumps({"bench": "refine", "pairs": args.pairs, "shards": args.shards, "dim": args.dim, "settings": args.set,
                          "build_s": round(build_s, 1), "wall_s": round(wall, 1), "peak_rss_mib": round(peak), "rc": res.returncode,
                          "summary": (res.stdout.strip() or res.stderr.strip()[-500:])}), flush=True)


if __name__ == "__main__":
    main()
