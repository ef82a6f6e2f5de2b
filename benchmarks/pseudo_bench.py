"""Pseudo-pairing (RCSL, ``pairclean pseudo-pair``): scale on synthetic vectors, quality on Flickr8k.

``scale``: a pool of ``--n`` (default 1,000,000) mismatched pairs of synthetic 512-d
vectors (clustered images; each image's own caption planted on another pool row), stored
float16 in memmaps as the command stores them. Runs both directions (each image's nearest
caption, each caption's nearest image) with the index ``auto`` picks, and prints build and
search time, peak RSS, recall@1 against exact search (on ``--exact-queries`` sampled
queries per direction, exact top-1 by brute force) and the share of planted captions found.

``quality``: Flickr8k dev (1,000 images, first caption each) embedded once with
pairclean-lite (cached in ``--cache``), captions shuffled at 20/50/80%; the pool is what
the job flags noisy (OSA, gmm beta as pairclean-lite's default), the truly noisy pairs
(oracle), or every pair. Prints, per setting, the share of noisy images whose pseudo-caption
(nearest pool caption, own caption excluded) is the caption displaced from them, with and
without the mutual filter, and the same at 50% noise against pool size (250/500/1000 images).

``executor``: a synthetic scored job of ``--n`` pairs (score tables, float16 sidecars and
caption-only shards written through pairclean's own output APIs, pool = every pair),
pseudo-paired by ``pairclean.pseudo.pairing.pseudo_pair`` with the queries in this process and
then on a Ray actor pool (``pairclean_workers.pseudo_exec``: actors read their query rows
from the sidecars). Prints load/build/search/total seconds of each, Ray's start-up, and
whether the two outputs are byte-identical.

    python benchmarks/pseudo_bench.py scale [--n 1000000]
    python benchmarks/pseudo_bench.py quality [--cache /tmp/pairclean-bench/dev-lite.npz]
    python benchmarks/pseudo_bench.py executor [--n 100000] [--num-actors 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np



def _emit(row: dict) -> None:
    print(json.dumps(row, sort_keys=True), flush=True)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- scale ------------------------------------------------------------------------------------
def _synthetic(n: int, dim: int, folder: str, clusters: int, seed: int, chunk: int = 100_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float16 memmaps (image, text) and ``home``: image i's own caption is text row home[i]."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)
    order = rng.permutation(n)
    home = np.empty(n, dtype=np.int64)
    home[order] = np.roll(order, 1)
    image = np.lib.format.open_memmap(os.path.join(folder, "img.npy"), "w+", np.float16, (n, dim))
    text = np.lib.format.open_memmap(os.path.join(folder, "txt.npy"), "w+", np.float16, (n, dim))
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = centres[rng.integers(0, clusters, m)] + 0.8 * rng.normal(size=(m, dim)).astype(np.float32)
        c = x + 0.5 * rng.normal(size=(m, dim)).astype(np.float32)
        image[start : start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
        # Writes scattered by home: fine for a benchmark's set-up.
        rows = home[start : start + m]
        srt = np.argsort(rows)
        text[rows[srt]] = (c / np.linalg.norm(c, axis=1, keepdims=True))[srt]
    image.flush()
    text.flush()
    return image, text, home


def _exact_top1(queries: np.ndarray, data: np.ndarray, own: np.ndarray, chunk: int = 131_072) -> np.ndarray:
    """Brute-force nearest row of ``data`` for each query, excluding row ``own[q]``."""
    q = np.asarray(queries, dtype=np.float32)
    best = np.full(len(q), -np.inf, dtype=np.float32)
    arg = np.full(len(q), -1, dtype=np.int64)
    for start in range(0, data.shape[0], chunk):
        block = np.asarray(data[start : start + chunk], dtype=np.float32)
        s = q @ block.T
        hit = (own >= start) & (own < start + len(block))
        s[np.flatnonzero(hit), own[hit] - start] = -np.inf
        j = s.argmax(axis=1)
        v = s[np.arange(len(q)), j]
        better = v > best
        best[better], arg[better] = v[better], start + j[better]
    return arg


def bench_scale(args: argparse.Namespace) -> None:
    from pairclean.pseudo.pairing import PseudoOptions, nearest_pairs

    with tempfile.TemporaryDirectory(prefix="pseudo-bench-", dir=args.tmp) as folder:
        t0 = time.perf_counter()
        image, text, home = _synthetic(args.n, args.dim, folder, args.clusters, args.seed)
        gen_s = time.perf_counter() - t0
        rss_before = _peak_rss_mb()
        t0 = time.perf_counter()
        result = nearest_pairs(image, text, PseudoOptions(index=args.index, nprobe=args.nprobe), seed=args.seed)
        total_s = time.perf_counter() - t0
        rss_peak = _peak_rss_mb()
        rng = np.random.default_rng(1)
        rows: dict[str, float] = {}
        top = {"i2t": result.i2t_top, "t2i": result.t2i_top}
        for d, (queries, data) in {"i2t": (image, text), "t2i": (text, image)}.items():
            sample = np.sort(rng.choice(args.n, size=min(args.exact_queries, args.n), replace=False))
            t1 = time.perf_counter()
            exact = _exact_top1(queries[sample], data, sample)
            rows[f"{d}_exact_s"] = round(time.perf_counter() - t1, 1)
            rows[f"{d}_recall_at1_vs_exact"] = round(float((top[d][sample] == exact).mean()), 4)
        rows["planted_found_i2t"] = round(float((top["i2t"] == home).mean()), 4)
        timings = {k: round(v, 1) for k, v in result.timings.items()}
        build_s = sum(v for k, v in result.timings.items() if k.endswith(("train_s", "add_s")))
        search_s = sum(v for k, v in result.timings.items() if k.endswith("search_s"))
        _emit({
            "bench": "pseudo_scale", "n": args.n, "dim": args.dim, "clusters": args.clusters, "plan": result.plans["i2t"],
            "generate_s": round(gen_s, 1), "build_s": round(build_s, 1), "search_s": round(search_s, 1),
            "pairing_total_s": round(total_s, 1), "timings": timings, "peak_rss_mb_before_pairing": round(rss_before),
            "peak_rss_mb": round(rss_peak), "exact_queries_per_direction": args.exact_queries,
            "pseudo_pairs": int(len(result.img)), "mutual": int(result.mutual.sum()), "cpus": os.cpu_count(), **rows,
        })


# -- executor ---------------------------------------------------------------------------------
def _synthetic_job(uri: str, folder: str, n: int, dim: int, per_shard: int, clusters: int, seed: int) -> None:
    """A scored job at ``uri`` over ``n`` synthetic pairs (as ``_synthetic``), every pair ok,
    with sidecars, and caption-only tar shards under ``folder`` (captions are read back)."""
    from pairclean.calibrate.calibration import calibrate
    from pairclean.lite.evaldata import write_shard
    from pairclean.spec import JobSpec, spec_digest
    from pairclean.output.folder import OutputDir, ShardRecord
    from pairclean.output.tables import embeddings_table, output_metadata, scores_table

    image, text, _ = _synthetic(n, dim, folder, clusters, seed)
    starts = range(0, n, per_shard)
    shards = tuple(os.path.join(folder, "shards", f"syn-{s:05d}.tar") for s in range(len(starts)))
    spec = JobSpec(shards, "synthetic", None, None, "fp32", "shuffled", 16, "paper", seed, 64, 1, None, True, 4096)
    out = OutputDir(uri)
    out.prepare(spec, overwrite=False)
    sample = slice(0, min(n, 4096))
    img0, txt0 = np.asarray(image[sample], np.float32), np.asarray(text[sample], np.float32)
    cal = calibrate(beta_recipe="shuffled", k=16, seed=seed, weighting="paper", batch_size=64, similarities=(img0 * txt0).sum(1),
                    image_emb=img0, text_emb=txt0, random_beta=lambda: 0.0)
    out.write_calibration(cal)
    digest = spec_digest(spec)
    for s, start in enumerate(starts):
        rows = slice(start, min(start + per_shard, n))
        img, txt = np.asarray(image[rows], np.float32), np.asarray(text[rows], np.float32)
        m = img.shape[0]
        keys = [f"{s:05d}/{i:06d}" for i in range(m)]
        write_shard(shards[s], ({"__key__": k, "txt": f"caption {k}"} for k in keys))
        meta = output_metadata({"model_id": "synthetic", "embed_dim": dim, "checkpoint_sha256": None}, cal, {"shard": shards[s], "job": digest})
        table = scores_table(shards[s], keys, np.arange(m), ["ok"] * m, [None] * m, (img * txt).sum(1).astype(np.float32), cal, meta)
        stem = f"syn-{s:05d}"
        info = out.write_table(out.score_name(stem), table)
        out.write_table(out.emb_name(stem), embeddings_table(keys, img, txt, np.ones(m, bool), meta))
        out.record_completion(ShardRecord(shards[s], stem, None, m, out.score_name(stem), info.sha256, info.bytes, {"ok": m}, out.emb_name(stem)))
    out.compact()


def bench_executor(args: argparse.Namespace) -> None:
    from pairclean.output.folder import OutputDir
    from pairclean.pseudo.pairing import PSEUDO_DIR, PseudoOptions, pseudo_pair
    from pairclean_workers.pseudo_exec import RaySearcher
    from pairclean_workers.ray_exec import RayOptions, init_ray

    with tempfile.TemporaryDirectory(prefix="pseudo-bench-", dir=args.tmp) as folder:
        uri = os.path.join(folder, "job")
        t0 = time.perf_counter()
        _synthetic_job(uri, folder, args.n, args.dim, args.per_shard, args.clusters, args.seed)
        gen_s = time.perf_counter() - t0
        out = OutputDir(uri)
        opts = PseudoOptions(pool="all", index=args.index, chunk=args.chunk)

        def files() -> dict[str, bytes | None]:
            return {n: out.store.get(f"{PSEUDO_DIR}/{n}") for n in out.store.list(PSEUDO_DIR)}

        def row(report) -> dict[str, float]:
            t = report.timings
            return {"load_s": round(t["load_s"], 1), "build_s": round(sum(v for k, v in t.items() if k.endswith(("train_s", "add_s"))), 1),
                    "search_s": round(t["i2t_search_s"] + t["t2i_search_s"], 1), "total_s": round(t["total_s"], 1)}

        local = pseudo_pair(out, opts)
        local_files = files()
        ray_opts = RayOptions(num_actors=args.num_actors, threads_per_actor=args.threads)
        t0 = time.perf_counter()
        init_ray(ray_opts)
        ray_start_s = time.perf_counter() - t0
        with RaySearcher(out, ray_opts, min_pool=0) as searcher:
            t0 = time.perf_counter()
            remote = pseudo_pair(out, opts, searcher=searcher)
            actors = searcher.num_actors
        _emit({
            "bench": "pseudo_executor", "n": args.n, "dim": args.dim, "shards": -(-args.n // args.per_shard), "chunk": args.chunk,
            "plan": local.plans["i2t"], "generate_s": round(gen_s, 1), "cpus": os.cpu_count(), "local": row(local),
            "ray": {**row(remote), "actors": actors, "ray_start_s": round(ray_start_s, 1), "executor": remote.executor},
            "identical_output": files() == local_files, "pseudo_pairs": local.pairs,
        })


# -- quality ----------------------------------------------------------------------------------
def _setting(img: np.ndarray, txt0: np.ndarray, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(image emb, pair text emb, truly noisy flags, home): pair j carries the first caption
    of image ``owner[j]``; ``home[i]`` is the pair holding image i's own caption."""
    from pairclean.lite.evaldata import FlickrImage, noisy_pairing

    n = len(img)
    fake = [FlickrImage(str(i), Path(str(i)), (str(i),), "dev") for i in range(n)]  # captions = owner ids
    pairs = noisy_pairing(fake, noise, seed=seed)
    owner = np.array([int(c) for c in pairs.captions])
    home = np.empty(n, dtype=np.int64)
    home[owner] = np.arange(n)
    return img, txt0[owner], pairs.noisy, home


def _osa_flags(img: np.ndarray, txt: np.ndarray, seed: int) -> tuple[np.ndarray, object]:
    from pairclean.calibrate.calibration import calibrate
    from pairclean.osa import cosine_rows, noisy_flags

    sims = cosine_rows(img, txt)
    cal = calibrate(beta_recipe="gmm", k=256, seed=seed, weighting="paper", batch_size=64, similarities=sims,
                    image_emb=img, text_emb=txt, random_beta=lambda: float("nan"))
    return noisy_flags(sims, cal.beta), cal


def _recovery(img: np.ndarray, txt: np.ndarray, noisy: np.ndarray, home: np.ndarray, pool: np.ndarray, mutual: bool) -> dict[str, float]:
    from pairclean.pseudo.pairing import PseudoOptions, nearest_pairs

    ids = np.flatnonzero(pool)
    res = nearest_pairs(img[ids].astype(np.float16), txt[ids].astype(np.float16), PseudoOptions(mutual_only=mutual))
    sel = res.direction == "i2t"
    got = dict(zip(ids[res.img[sel]].tolist(), ids[res.cap[sel]].tolist()))
    truly = np.flatnonzero(noisy)
    hits = sum(got.get(int(i)) == int(home[i]) for i in truly)
    paired_noisy = [i for i in truly if int(i) in got]
    return {
        "pool": int(len(ids)), "pool_purity": round(float(noisy[ids].mean()), 3),
        "recovered_share_of_noisy_images": round(hits / max(1, len(truly)), 3),
        "precision_on_noisy_images_paired": round(hits / max(1, len(paired_noisy)), 3),
        "noisy_images_paired": len(paired_noisy),
    }


def bench_quality(args: argparse.Namespace) -> None:
    from _embed_dev import embed_dev  # shared with estimators.py: one cache of the dev embeddings

    emb = embed_dev(Path(args.cache))
    img, txt0 = emb["img"].astype(np.float32), emb["txt"][:, 0].astype(np.float32)
    for noise in (0.2, 0.5, 0.8):
        im, tx, noisy, home = _setting(img, txt0, noise, args.seed)
        flags, cal = _osa_flags(im, tx, args.seed)
        pools = {"osa_noisy": flags, "oracle_noisy": noisy.copy(), "all": np.ones(len(im), dtype=bool)}
        for name, pool in pools.items():
            for mutual in (False, True):
                _emit({"bench": "pseudo_quality", "noise": noise, "pool_kind": name, "mutual": mutual, "beta": round(cal.beta, 4),
                       "n_images": len(im), **_recovery(im, tx, noisy, home, pool, mutual)})
    for size in (250, 500, 1000):
        im, tx, noisy, home = _setting(img[:size], txt0[:size], 0.5, args.seed)
        flags, _ = _osa_flags(im, tx, args.seed)
        for mutual in (False, True):
            _emit({"bench": "pseudo_quality_vs_pool", "noise": 0.5, "n_images": size, "pool_kind": "osa_noisy", "mutual": mutual,
                   **_recovery(im, tx, noisy, home, flags, mutual)})


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scale")
    s.add_argument("--n", type=int, default=1_000_000)
    s.add_argument("--dim", type=int, default=512)
    s.add_argument("--clusters", type=int, default=10_000)
    s.add_argument("--index", default="auto")
    s.add_argument("--nprobe", type=int, default=None)
    s.add_argument("--exact-queries", type=int, default=2000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tmp", default=None, help="folder for the float16 memmaps (2 x n x dim x 2 bytes)")
    q = sub.add_parser("quality")
    q.add_argument("--cache", default="/tmp/pairclean-bench/dev-lite.npz")
    q.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("executor")
    e.add_argument("--n", type=int, default=100_000)
    e.add_argument("--dim", type=int, default=512)
    e.add_argument("--per-shard", type=int, default=10_000)
    e.add_argument("--clusters", type=int, default=1_000)
    e.add_argument("--index", default="auto")
    e.add_argument("--chunk", type=int, default=16_384, help="query rows per FAISS call and per Ray task")
    e.add_argument("--num-actors", type=int, default=None)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tmp", default=None)
    args = parser.parse_args()
    {"scale": bench_scale, "quality": bench_quality, "executor": bench_executor}[args.what](args)


if __name__ == "__main__":
    main()
