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
import sys
import tempfile
import time
from pathlib import Path


def _build_shards(folder: Path, pairs: int, per_shard: int) -> list[str]:
    from pairclean.evaldata import find_flickr8k, load_flickr8k, noisy_pairing, write_pair_shards

    root = find_flickr8k(Path(__file__))
    if root is None:
        sys.exit("Flickr8k not found: set PAIRCLEAN_FLICKR8K or keep ../shared beside the repo")
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


class _Timer:
    """Progress sink that notes when the first shard starts being scored and the last commits."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_done = 0.0

    def start(self, total_shards: int, already_done: int) -> None:
        pass

    def shard_done(self, stem: str, rows: int) -> None:
        self.last_done = time.perf_counter()

    def shard_failed(self, uri: str, error: str) -> None:
        raise RuntimeError(error)


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
    from pairclean.job import JobSpec, OutputDir
    from pairclean.runner import LocalSource, random_beta_fn, run_job, score_options

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shards = _build_shards(Path(tmp) / "shards", args.pairs, args.per_shard)
        t_wall = time.perf_counter()
        estimator = load_estimator(EstimatorSpec(args.model, precision=args.precision))
        spec = JobSpec(tuple(shards), args.model, None, None, args.precision, "random-inputs", 256, "paper", 0, args.batch_size, 64_000_000, None, True, 4096)
        random_beta_fn(estimator, 256, 0)()  # beta computed (and cached) before timing the loop
        estimator.encode_images(torch.zeros((2, 3, estimator.image_size, estimator.image_size)))
        timer = _Timer()
        t_loop = time.perf_counter()
        report = run_job(spec, OutputDir(str(Path(tmp) / "out")), lambda: LocalSource(estimator, score_options(spec)), progress=timer)
        loop_s = timer.last_done - t_loop
        wall_s = time.perf_counter() - t_wall
        bare = _bare(estimator, shards, args.batch_size)
    command = report.pairs / loop_s
    print(json.dumps({
        "benchmark": "throughput",
        "model": args.model,
        "precision": estimator.info.precision,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "pairs": report.pairs,
        "bare_pairs_per_s": round(bare, 2),
        "command_pairs_per_s": round(command, 2),
        "command_wall_pairs_per_s": round(report.pairs / wall_s, 2),
        "ratio": round(command / bare, 3),
    }))


if __name__ == "__main__":
    main()
