"""Decode + preprocess throughput: one thread against a pool, and the batched GPU JPEG path.

On real Flickr8k dev photos (bytes read into memory first: no disk in the timing) with
the pairclean-lite estimator's preprocessing, prints JSON lines:

- ``cpu``: images/s of ``decode_and_preprocess`` (what each ``decode_workers`` thread of
  ``score_shard`` runs) with 1 thread and with ``--threads`` threads, and per core;
- ``reader``: pairs/s of ``score_shard``'s reader alone (tar reading, decoding on the
  pool, batching; no model) with ``decode_workers`` = 1 and ``--threads``;
- ``gpu``: images/s of ``decode_jpeg_batch`` on CUDA (nvJPEG), only where a GPU is
  visible; otherwise ``{"section": "gpu", "skipped": "no CUDA device"}``.

``--torch-threads`` sets torch's intra-op threads first: the preprocess's tensor ops
(ToTensor, Normalize) use them, and in every pool thread at once, which oversubscribes
the cores when both are the CPU count.

    python benchmarks/decode_bench.py [--images 512] [--threads N] [--torch-threads T]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = "decode"


def _emit(section: str, **fields: Any) -> None:
    print(json.dumps({"benchmark": BENCH, "section": section, **fields}), flush=True)


def _photos(n: int) -> list[tuple[str, bytes, str]] | None:
    """(key, JPEG bytes, caption) of the first ``n`` dev photos, or None without Flickr8k."""
    from pairclean.lite.evaldata import find_flickr8k, load_flickr8k

    root = find_flickr8k(Path(__file__))
    if root is None:
        return None
    images = load_flickr8k(root, "dev")[:n]
    return [(f"{i:06d}", img.path.read_bytes(), img.captions[0]) for i, img in enumerate(images)]


def _rate(run: Callable[[], int], repeat: int) -> float:
    """Best items/s of ``repeat`` runs of ``run`` (which returns how many items it did)."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = run()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def _cpu_images_per_s(datas: Sequence[bytes], estimator: Any, threads: int, repeat: int) -> float:
    from pairclean.read.decode import DEFAULT_MAX_PIXELS, DecodeFailure, decode_and_preprocess

    def one(data: bytes) -> Any:
        out = decode_and_preprocess(data, DEFAULT_MAX_PIXELS, estimator.preprocess, draft_size=estimator.image_size)
        assert not isinstance(out, DecodeFailure), out
        return out

    # A pool even for 1 thread: score_shard decodes off the main thread too, and torch's
    # OpenMP ops behave differently there (on busy cores, the main thread's team stalls).
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, datas[:threads]))  # threads started, warm
        return _rate(lambda: len(list(pool.map(one, datas))), repeat)


def _reader_pairs_per_s(shard: str, estimator: Any, workers: int, batch_size: int, repeat: int) -> float:
    # The reader thread of score_shard on its own: what it can hand a model per second.
    from pairclean.embed.shard import ScoreOptions, _prepared_batches

    opts = ScoreOptions(batch_size=batch_size, decode_workers=workers)
    return _rate(lambda: sum(len(b.rows) for b in _prepared_batches(shard, estimator, opts)), repeat)


def _gpu_images_per_s(datas: Sequence[bytes], estimator: Any, batch_size: int, repeat: int) -> dict[str, Any]:
    import torch

    from pairclean.read.decode import DEFAULT_MAX_PIXELS, decode_jpeg_batch, tensor_preprocess_of

    params = tensor_preprocess_of(estimator.preprocess)
    if params is None:
        return {"skipped": "preprocess not recognised as resize/crop/normalise"}

    def run() -> int:
        for i in range(0, len(datas), batch_size):
            out = decode_jpeg_batch(
                datas[i : i + batch_size], DEFAULT_MAX_PIXELS, params.image_size, params.mean, params.std, "cuda", params.interpolation
            )
            assert all(isinstance(t, torch.Tensor) for t in out)
        torch.cuda.synchronize()
        return len(datas)

    run()  # warm-up: nvJPEG handles, CUDA kernels
    return {"device": torch.cuda.get_device_name(0), "batch_size": batch_size, "images_per_s": round(_rate(run, repeat), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="pairclean-lite")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()

    photos = _photos(args.images)
    if photos is None:
        reason = "Flickr8k not found: set PAIRCLEAN_FLICKR8K or keep ../shared/data/flickr8k beside the repo"
        for section in ("cpu", "reader", "gpu"):
            _emit(section, skipped=reason)
        sys.exit(0)

    import torch

    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.lite.evaldata import write_pair_shards

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    estimator = load_estimator(EstimatorSpec(args.model, precision="fp32", device="cpu"))
    datas = [data for _, data, _ in photos]
    common = {"model": args.model, "image_size": estimator.image_size, "images": len(datas), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}

    single = _cpu_images_per_s(datas, estimator, 1, args.repeat)
    pooled = _cpu_images_per_s(datas, estimator, args.threads, args.repeat)
    _emit(
        "cpu",
        **common,
        threads=args.threads,
        images_per_s_1_thread=round(single, 1),
        images_per_s_n_threads=round(pooled, 1),
        images_per_s_per_core=round(pooled / args.threads, 1),
        speedup=round(pooled / single, 2),
    )

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for key, data, _ in photos:
            (folder / f"{key}.jpg").write_bytes(data)
        items = [(key, folder / f"{key}.jpg", caption) for key, _, caption in photos]
        shard = write_pair_shards(folder / "shards", items, len(items), "bench")[0]
        reader_1 = _reader_pairs_per_s(shard, estimator, 1, args.batch_size, args.repeat)
        reader_n = _reader_pairs_per_s(shard, estimator, args.threads, args.batch_size, args.repeat)
    _emit(
        "reader",
        **common,
        batch_size=args.batch_size,
        pairs_per_s_decode_workers_1=round(reader_1, 1),
        pairs_per_s_decode_workers_n=round(reader_n, 1),
        decode_workers_n=args.threads,
        speedup=round(reader_n / reader_1, 2),
    )

    if torch.cuda.is_available():
        _emit("gpu", **common, **_gpu_images_per_s(datas, estimator, args.batch_size, args.repeat))
    else:
        _emit("gpu", skipped="no CUDA device")


if __name__ == "__main__":
    main()
