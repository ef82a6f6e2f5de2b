"""Throughput of `pairclean score` against the bare model forward, in one run.

Builds shards of real Flickr8k dev photos in a temporary folder, then measures:

- ``bare``: the estimator's image and text forward on already-decoded, preprocessed
  tensors (same batch size, same threads) - the ceiling;
- ``command``: the scoring job (read tar, decode, preprocess, embed, weight, write Parquet,
  commit) with the same estimator, timed from the first shard to the last commit;
- ``command_wall``: the same including model load and beta (what a user waits for).

Prints one JSON line. Goal on CPU: ``ratio`` (command / bare) >= 0.85.

    python benchmarks/throughput.py [--pairs 512] [--batch-size 64] [--model pairclean-lite]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _common import bench_spec, flickr_root, timed_run


def _build_shards(folder: Path, pairs: int, per_shard: int) -> list[str]:
    from pairclean.evaldata import load_flickr8k, noisy_pairing, write_pair_shards

    root = flickr_root()
    paired = noisy_pairing(load_flickr8k(root, "dev")[:pairs], 0.2, seed=0)
    items = [(f"{i:06d}", img.path, cap) for i, (img, cap) in enumerate(zip(paired.images, paired.captions))]
    return write_pair_shards(folder, items, per_shard, "bench")


def _bare(estimator, shards: list[str], batch_size: int) -> float:
    """pairs/s of the model alone on pre-decoded tensors."""
    import torch

    from pairclean.decode import decode_image
    from pairclean.shards import iter_pairs

    pixels, texts = [], []
    for uri in shards:
        for pair in iter_pairs(uri):
            pixels.append(estimator.preprocess(decode_image(pair.image, draft_size=estimator.image_size)))
            texts.append(pair.text)
    tensor = torch.stack(pixels)
    estimator.encode_images(tensor[:batch_size])  # warm-up, as the command's first batch is
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        estimator.encode_images(tensor[i : i + batch_size])
        estimator.encode_texts(texts[i : i + batch_size])
    return len(texts) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="pairclean-lite")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch

    from pairclean.estimators import EstimatorSpec, load_estimator
    from pairclean.runner import LocalSource, score_options
    from pairclean.work import random_beta_fn

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shards = _build_shards(Path(tmp) / "shards", args.pairs, args.per_shard)
        t_wall = time.perf_counter()
        estimator = load_estimator(EstimatorSpec(args.model, precision=args.precision))
        spec = bench_spec(shards, args.model, args.batch_size, args.precision)
        random_beta_fn(estimator, 256, 0)()  # beta computed (and cached) before timing the loop
        estimator.encode_images(torch.zeros((2, 3, estimator.image_size, estimator.image_size)))
        command, pairs, _ = timed_run(spec, Path(tmp) / "out", lambda out: LocalSource(estimator, spec, out, score_options(spec)))
        wall_s = time.perf_counter() - t_wall
        bare = _bare(estimator, shards, args.batch_size)
    print(json.dumps({
        "benchmark": "throughput",
        "model": args.model,
        "precision": estimator.info.precision,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "pairs": pairs,
        "bare_pairs_per_s": round(bare, 2),
        "command_pairs_per_s": round(command, 2),
        "command_wall_pairs_per_s": round(pairs / wall_s, 2),
        "ratio": round(command / bare, 3),
    }))


if __name__ == "__main__":
    main()
