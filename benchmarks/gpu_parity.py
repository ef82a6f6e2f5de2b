"""Scores on a GPU against scores on the CPU: the same shards through `pairclean score` three times.

Runs the real CLI (``--executor local``) into three folders under ``--work``: ``--device
cpu``, ``--device cuda``, and ``--device cuda --decode-device cuda`` (nvJPEG), then compares
the tables row by row (joined on shard and key) and prints one JSON line per run:
pairs/s as the command reports it, and per score column the largest and mean absolute
difference from the CPU run, statuses and ``noisy`` flags that differ. Where no CUDA device
is visible it prints ``{"skipped": "no CUDA device"}`` and exits 0.

What README "On a GPU" reports came from this comparison: first on an H100 (2,000 Flickr8k
dev pairs, as a one-off script), then as this script on an H200 (500 pairs of the hard-noise
``mix`` set, the judge with its word grounding on every pair).

    python benchmarks/gpu_parity.py SHARD [SHARD ...] --work DIR [--extra-args "--judge all"]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

RUNS = {"cpu": ["--device", "cpu"], "cuda": ["--device", "cuda"], "nvjpeg": ["--device", "cuda", "--decode-device", "cuda"]}
SCORES = ("similarity", "weight", "p_clean", "adjusted_similarity", "owner_margin", "judge_score")


def _score(shards: list[str], out: Path, args: list[str], extra: list[str]) -> float | None:
    """Run `pairclean score`; pairs/s from its summary line (None when it does not say)."""
    cmd = [sys.executable, "-m", "pairclean_service.cli", "score", *shards, "--out", str(out), "--executor", "local",
           "--no-progress", *args, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    found = re.search(r"\(([\d.]+) pairs/s\)", done.stdout)
    return float(found.group(1)) if found else None


def _rows(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("*.parquet"))])


def _compare(ref: pa.Table, other: pa.Table) -> dict[str, Any]:
    """Per-column differences of ``other`` from ``ref`` on the rows both hold."""
    index = {k: i for i, k in enumerate(zip(other["shard"].to_pylist(), other["key"].to_pylist()))}
    pairs = [(i, index[k]) for i, k in enumerate(zip(ref["shard"].to_pylist(), ref["key"].to_pylist())) if k in index]
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    doc: dict[str, Any] = {"rows": len(pairs)}
    for col in ("status", "noisy"):
        doc[f"{col}_differ"] = sum(x != y for x, y in zip(ref[col].take(a).to_pylist(), other[col].take(b).to_pylist()))
    for col in SCORES:
        if col not in ref.column_names or col not in other.column_names:
            continue
        x = np.asarray(ref[col].take(a).to_pylist(), dtype=float)
        y = np.asarray(other[col].take(b).to_pylist(), dtype=float)
        both = np.isfinite(x) & np.isfinite(y)
        d = np.abs(x[both] - y[both])
        doc[col] = {"max": float(d.max()) if d.size else 0.0, "mean": float(d.mean()) if d.size else 0.0,
                    "nan_differ": int((np.isnan(x) != np.isnan(y)).sum())}
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", nargs="+")
    parser.add_argument("--work", required=True, help="a new folder for the three outputs")
    parser.add_argument("--extra-args", default="", help="more `pairclean score` arguments for every run")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_parity", "skipped": "no CUDA device"}))
        return 0
    work = Path(args.work)
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"--work {work} is not empty: give a new folder")
    extra = shlex.split(args.extra_args)
    speed = {name: _score(args.shards, work / name, flags, extra) for name, flags in RUNS.items()}
    ref = _rows(work / "cpu")
    for name in RUNS:
        doc = {"benchmark": "gpu_parity", "run": name, "device": torch.cuda.get_device_name(0), "pairs_per_s": speed[name]}
        if name != "cpu":
            doc["against_cpu"] = _compare(ref, _rows(work / name))
        print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
