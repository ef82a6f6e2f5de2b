"""Throughput of the whole `pairclean score` command against the model-bound limit.

For each model (default: pairclean-lite, the default estimator, and ViT-B-32 with random
open_clip weights saved once as a local checkpoint), at the precision and engine ``auto`` picks:

- ``bare``: the model-bound limit: both towers on pre-decoded, pre-tokenised batches
  (the first ``--bare-pairs`` pairs), same threads and batch size as the command;
- ``local``: ``pairclean score --executor local`` on all ``--pairs`` pairs;
- ``ray``: ``pairclean score`` on the default executor (a local Ray, one actor pool);

each a separate process, interleaved (bare, local, ray, then the next model; ``--repeats``
rounds), so that load from elsewhere on the machine falls on all of them alike. The
command's rate is pairs over the wall time of the whole process (start-up, model load,
calibration and commits included; the random-inputs beta that ViT-B-32's default recipe
needs is computed before the rounds, as it is cached after a model's first job);
``report_pairs_per_s`` is the rate the command itself
prints (from its job start); ``steady_pairs_per_s`` is the scoring loop alone (from
when the later score tables were written) and ``fixed_s`` the rest of the wall time
(start-up, model load, calibration, exit), which shrinks as a share of bigger jobs. CPU seconds are those of the command's whole process tree
(Ray's raylet, GCS and actors included), as user and system seconds per 1,000 pairs.

Prints one JSON line per run and a ``summary`` line per model (medians over repeats) with
``ray_vs_bare`` (goal >= 0.85 for the default path), ``local_vs_bare`` and
``ray_vs_local`` (goal >= 0.9). Shards are real Flickr8k photos (20% shuffled captions).

    python benchmarks/throughput.py [--pairs 8000] [--models pairclean-lite,ViT-B-32]
        [--runs bare,local,ray] [--repeats 1] [--work DIR]

A quick look: ``--pairs 1000 --models pairclean-lite``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import cpu_split, flickr_shards, json_line, random_checkpoint, run_measured, warm_beta_cache

DEFAULT_MODELS = ("pairclean-lite", "ViT-B-32")
_REPORT_RE = re.compile(r"(\d+) pairs in ([\d.]+) s \(([\d.]+) pairs/s\)")


def pairclean_command() -> list[str]:
    """The ``pairclean`` console script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("pairclean")
    found = str(beside) if beside.exists() else shutil.which("pairclean")
    if found is None:
        sys.exit("the pairclean command is not installed: pip install -e '.[all]'")
    return [found]


def bare_main(args: argparse.Namespace) -> None:
    """Child process: the model-bound limit of one estimator; prints one JSON line."""
    from pairclean.embed.cpu_settings import apply_process_env

    apply_process_env()  # the CPU settings `pairclean score` runs with (before torch loads)
    import torch

    from pairclean.read.decode import decode_and_preprocess
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.read.shards import iter_pairs

    torch.set_num_threads(args.threads or os.cpu_count() or 1)  # as `pairclean score` does
    est = load_estimator(EstimatorSpec(args.bare_only, args.checkpoint, precision=args.precision, engine=args.engine))
    pixels, texts = [], []
    for uri in json.loads(args.shards_json):
        for pair in iter_pairs(uri):
            if len(texts) == args.bare_pairs:
                break
            pixels.append(decode_and_preprocess(pair.image, 64_000_000, est.preprocess, draft_size=est.image_size))
            texts.append(pair.text)
    bs = args.batch_size
    batches = [(torch.stack(pixels[i : i + bs]), est.tokenizer(texts[i : i + bs])) for i in range(0, len(texts), bs)]
    del pixels
    est.encode_images(batches[0][0])  # warm-up: kernels are set up on the first call per shape
    est.encode_token_ids(batches[0][1])
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for images, tokens in batches:
        est.encode_images(images)
        est.encode_token_ids(tokens)
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    n = len(texts)
    print(json.dumps({
        "pairs": n, "pairs_per_s": n / seconds, "precision": est.info.precision, "engine": est.info.engine,
        "user_s_per_1k": round((r1.ru_utime - r0.ru_utime) * 1000 / n, 2),
        "sys_s_per_1k": round((r1.ru_stime - r0.ru_stime) * 1000 / n, 2),
    }))


def _run(kind: str, model: str, checkpoint: str | None, shards: list[str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    model_args = ["--model", model] + (["--checkpoint", checkpoint] if checkpoint else [])
    if kind == "bare":
        cmd = [sys.executable, __file__, "--bare-only", model, "--shards-json", json.dumps(shards),
               "--bare-pairs", str(args.bare_pairs), "--batch-size", str(args.batch_size), "--precision", args.precision,
               "--engine", args.engine]
        cmd += ["--checkpoint", checkpoint] if checkpoint else []
    else:
        out = work / f"out-{kind}"
        cmd = pairclean_command() + ["score", *shards, "--out", str(out), "--overwrite", "--no-progress",
                                     "--batch-size", str(args.batch_size), "--precision", args.precision,
                                     "--engine", args.engine, *model_args]
        cmd += ["--executor", "local"] if kind == "local" else []
    m = run_measured(cmd)
    if m.rc != 0:
        sys.exit(f"{kind} run of {model} failed ({m.rc}):\n{m.output[-3000:]}")
    record: dict[str, Any] = {"benchmark": "throughput", "run": kind, "model": model}
    if kind == "bare":
        record.update(json.loads(m.output.strip().splitlines()[-1]))
        record["pairs_per_s"] = round(record["pairs_per_s"], 2)
        return record
    found = _REPORT_RE.search(m.output)
    pairs = int(found.group(1)) if found else args.pairs
    steady = _steady_rate(work / f"out-{kind}")
    record.update({
        "pairs": pairs,
        "wall_s": round(m.wall_s, 1),
        "pairs_per_s": round(pairs / m.wall_s, 2),
        "report_pairs_per_s": float(found.group(3)) if found else None,
        "steady_pairs_per_s": round(steady, 2) if steady else None,
        "fixed_s": round(m.wall_s - pairs / steady, 1) if steady else None,
        **cpu_split(m, pairs),
        "cpu_by_process": dict(list(m.by_name.items())[:6]),
    })
    return record


def _steady_rate(out: Path) -> float | None:
    """Pairs/s of the scoring loop alone, from when the job's score tables were written:
    over the later half of them (the calibration phase writes the first shards in one
    burst), pairs committed after the first of that half over the time since. None for
    fewer than 4 shards."""
    import pyarrow.parquet as pq

    tables = sorted((p.stat().st_mtime, p) for p in out.glob("*.parquet"))
    if len(tables) < 4:
        return None
    half = tables[len(tables) // 2 :]
    span = half[-1][0] - half[0][0]
    pairs = sum(pq.read_metadata(p).num_rows for _, p in half[1:])
    return pairs / span if span > 0 else None


def _summary(model: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rate = {kind: statistics.median(r["pairs_per_s"] for r in runs if r["run"] == kind)
            for kind in ("bare", "local", "ray") if any(r["run"] == kind for r in runs)}
    out: dict[str, Any] = {"benchmark": "throughput", "summary": model, "rounds": sum(r["run"] == "bare" for r in runs) or None}
    out.update({f"{k}_pairs_per_s": round(v, 2) for k, v in rate.items()})
    for key in ("precision", "engine"):
        value = next((r.get(key) for r in runs if r.get(key)), None)
        if value:
            out[key] = value
    for num, den in (("ray", "bare"), ("local", "bare"), ("ray", "local")):
        if num in rate and den in rate:
            out[f"{num}_vs_{den}"] = round(rate[num] / rate[den], 3)
    for kind in ("local", "ray"):
        steady = [r["steady_pairs_per_s"] for r in runs if r["run"] == kind and r.get("steady_pairs_per_s")]
        if steady and "bare" in rate:
            out[f"{kind}_steady_vs_bare"] = round(statistics.median(steady) / rate["bare"], 3)
            out[f"{kind}_fixed_s"] = statistics.median(r["fixed_s"] for r in runs if r["run"] == kind and r.get("fixed_s") is not None)
    for kind in ("local", "ray"):
        split = [r for r in runs if r["run"] == kind]
        if split:
            out[f"{kind}_cpu_per_1k"] = {k: statistics.median(r[k] for r in split) for k in ("user_s_per_1k", "sys_s_per_1k", "sys_fraction")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8000, help="pairs the commands score")
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--runs", default="bare,local,ray", help="which of bare, local, ray to run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bare-pairs", type=int, default=1024, help="pairs the model-bound run embeds")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--engine", default="auto", help="auto (what pairclean picks) or torch")
    parser.add_argument("--work", type=Path, default=None, help="keep shards and checkpoint here (reused)")
    # Internal: the model-bound child process.
    parser.add_argument("--bare-only", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--shards-json", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_only:
        bare_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="pairclean-throughput-") as tmp:
        work = args.work or Path(tmp)
        shards = flickr_shards(work / f"shards-{args.pairs}", args.pairs, args.per_shard)
        models = [m for m in args.models.split(",") if m]
        checkpoints = {m: (None if m == "pairclean-lite" else random_checkpoint(work, m)) for m in models}
        for model in models:
            warm_beta_cache(model, checkpoints[model])
        kinds = [k for k in args.runs.split(",") if k]
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in models}
        for _ in range(args.repeats):
            for model in models:
                for kind in kinds:
                    record = _run(kind, model, checkpoints[model], shards, work, args)
                    results[model].append(record)
                    json_line(record)
        for model in models:
            json_line(_summary(model, results[model]))


if __name__ == "__main__":
    main()
