"""Ray execution against the single-process path, in one run; and memory against corpus size.

Prints JSON lines:

- ``ray_vs_local``: pairs/s of the Ray path (local Ray, actor pool) and of the in-process
  path on the same shards and estimator, their ratio (goal >= 0.9 on 2 cores), Ray start-up
  seconds and the peak RSS of the whole process tree (driver, raylet, actors).
- ``memory``: peak RSS of the Ray path for a small and a 20x larger job (tiny model, so the
  run stays short; streaming does not depend on the model): flat means bounded.
- ``driver_cost``: what the driver spends per committed shard in the scoring phase (CPU
  ms of its job loop per record, and the pickled bytes of the record it receives) for small
  and 16x larger shards: it must not grow with the shard (goal: under 10 kB and 5 ms per
  shard); and the whole driver process's CPU use (Ray's client threads included) as a
  fraction of one core, which is paid per second, not per shard.
- ``gpu``: pairs/s per GPU, model alone and end to end, when a CUDA device is present.

    python benchmarks/ray_bench.py [--pairs 1024] [--per-shard 256] [--model pairclean-lite]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from _common import bench_spec, flickr_root, timed_run


class PeakRss:
    """Samples the summed RSS of this process and all its descendants."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001 - processes come and go
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build_shards(folder: Path, pairs: int, per_shard: int) -> list[str]:
    """Shards of Flickr8k dev photos (repeated under new keys past 1,000 pairs)."""
    from pairclean.lite.evaldata import load_flickr8k, write_pair_shards

    root = flickr_root()
    images = load_flickr8k(root, "dev")
    items = [(f"{i:08d}", images[i % len(images)].path, images[i % len(images)].captions[0]) for i in range(pairs)]
    return write_pair_shards(folder, items, per_shard, "b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Real shards hold thousands of pairs; per-shard costs (result transfer, commit) weigh
    # more on tiny ones: 64-pair shards measured a ratio of 0.85 where 256-pair ones gave 0.91.
    parser.add_argument("--pairs", type=int, default=1024)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="pairclean-lite")
    parser.add_argument("--memory-pairs", type=int, nargs=2, default=[1000, 20000])
    parser.add_argument("--driver-shards", type=int, default=48, help="shards per driver-cost run")
    parser.add_argument("--sections", nargs="+", default=["ray_vs_local", "memory", "driver_cost", "gpu"],
                        choices=["ray_vs_local", "memory", "driver_cost", "gpu"])
    parser.add_argument("--driver-shard-sizes", type=int, nargs="+", default=[32, 512], help="pairs per shard in the driver-cost runs")
    args = parser.parse_args()

    import ray
    import torch

    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.job.runner import LocalSource, score_options
    from pairclean.job.work import random_beta_fn
    from pairclean_workers.ray_exec import RayOptions, RaySource

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    est_spec = EstimatorSpec(args.model, precision="auto", device="cpu")
    tiny = EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        shards = build_shards(Path(tmp) / "s", args.pairs, args.per_shard)
        spec = bench_spec(shards, args.model, args.batch_size)
        if "ray_vs_local" in args.sections:
            estimator = load_estimator(est_spec)
            random_beta_fn(estimator, 256, 0)()  # cached for both paths
            local_rate, pairs, _ = timed_run(spec, Path(tmp) / "local", lambda out: LocalSource(estimator, spec, out, score_options(spec)))
            del estimator  # free the in-process model before Ray's actors load theirs
        t0 = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False)
        startup = time.perf_counter() - t0
        if "ray_vs_local" in args.sections:
            with PeakRss() as rss:
                ray_rate, _, _ = timed_run(spec, Path(tmp) / "ray", lambda out: RaySource(est_spec, spec, out, score_options(spec), RayOptions()))
            print(json.dumps({
                "benchmark": "ray_vs_local", "model": args.model, "pairs": pairs, "cpus": threads,
                "local_pairs_per_s": round(local_rate, 2), "ray_pairs_per_s": round(ray_rate, 2),
                "ratio": round(ray_rate / local_rate, 3), "ray_startup_s": round(startup, 2),
                "peak_rss_gb": round(rss.peak / 2**30, 2),
            }), flush=True)
        if "memory" in args.sections:
            print(json.dumps(_memory(Path(tmp), tiny, args.memory_pairs, args.batch_size)), flush=True)
        if "driver_cost" in args.sections:
            for per_shard in args.driver_shard_sizes:
                print(json.dumps(_driver_cost(Path(tmp), tiny, per_shard, args.driver_shards, args.batch_size)), flush=True)
        ray.shutdown()
        if "gpu" not in args.sections:
            return
        if torch.cuda.is_available():
            print(json.dumps(_gpu(est_spec, shards, spec)), flush=True)
        else:
            print(json.dumps({"benchmark": "gpu", "skipped": "no CUDA device on this machine"}), flush=True)


def _memory(tmp: Path, tiny, sizes: list[int], batch_size: int) -> dict:
    """Peak RSS of the whole process tree for a small and a large job (tiny model)."""
    from pairclean.job.runner import score_options
    from pairclean_workers.ray_exec import RayOptions, RaySource

    peaks = []
    for n in sizes:
        mem_shards = build_shards(tmp / f"m{n}", n, 500)
        mspec = bench_spec(mem_shards, "pairclean-tiny-test", batch_size)
        with PeakRss() as rss:
            timed_run(mspec, tmp / f"mo{n}", lambda out, ms=mspec: RaySource(tiny, ms, out, score_options(ms), RayOptions()))
        peaks.append(rss.peak / 2**30)
    return {"benchmark": "memory", "pairs": sizes, "peak_rss_gb": [round(p, 2) for p in peaks], "ratio_large_to_small": round(peaks[1] / peaks[0], 3)}


def _driver_cost(tmp: Path, tiny, per_shard: int, n_shards: int, batch_size: int) -> dict:
    """Driver CPU ms and record bytes per committed shard (tiny model: the driver's cost
    does not depend on the model, and a fast model makes the driver's share the largest)."""
    from pairclean.job.runner import score_options
    from pairclean_workers.ray_exec import RayOptions, RaySource

    shards = build_shards(tmp / f"d{per_shard}", per_shard * n_shards, per_shard)
    spec = bench_spec(shards, "pairclean-tiny-test", batch_size)
    _, pairs, report = timed_run(spec, tmp / f"do{per_shard}", lambda out: RaySource(tiny, spec, out, score_options(spec), RayOptions()))
    cost = report.driver.per_shard()
    return {
        "benchmark": "driver_cost", "pairs_per_shard": per_shard, "shards": report.driver.shards,
        "driver_commit_cpu_ms_per_shard": round(cost["cpu_ms_per_shard"], 3), "record_bytes_per_shard": round(cost["bytes_per_shard"]),
        "driver_process_cpu_fraction_of_a_core": round(cost["process_cpu_fraction"], 4),
    }


def _gpu(est_spec, shards: list[str], spec) -> dict:
    """pairs/s on one GPU: the model on pre-decoded tensors, and the whole scoring path."""
    import torch

    from pairclean.read.decode import decode_image
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.job.runner import LocalSource, score_options
    from pairclean.read.shards import iter_pairs

    est = load_estimator(EstimatorSpec(est_spec.model, precision="auto", device="cuda"))
    pixels, texts = [], []
    for uri in shards:
        for p in iter_pairs(uri):
            pixels.append(est.preprocess(decode_image(p.image)))
            texts.append(p.text)
    x = torch.stack(pixels)
    est.encode_images(x[:64])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(texts), spec.batch_size):
        est.encode_images(x[i : i + spec.batch_size])
        est.encode_texts(texts[i : i + spec.batch_size])
    torch.cuda.synchronize()
    model_rate = len(texts) / (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        e2e, _, _ = timed_run(spec, Path(tmp), lambda out: LocalSource(est, spec, out, score_options(spec)))
    return {"benchmark": "gpu", "device": torch.cuda.get_device_name(0), "model_pairs_per_s": round(model_rate, 1), "end_to_end_pairs_per_s": round(e2e, 1)}


if __name__ == "__main__":
    main()
