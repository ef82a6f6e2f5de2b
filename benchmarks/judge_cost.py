"""What the default path costs: `pairclean score --judge off|band|all`, and the corpus contrast.

Each run is the whole `pairclean score --executor local` command (start-up, model load,
calibration and exit included) on the same shards of real Flickr8k dev-and-train photos
(20% shuffled captions), one process at a time, the judge settings interleaved over
``--repeats`` rounds so that load from elsewhere falls on all alike. Prints one JSON line per
run and a summary: median pairs/s (wall) and CPU seconds per 1,000 pairs (user + system of
the process tree: on a shared machine the steadier measure of cost), each as a ratio to
``--judge off`` (the issue's floor for the default path: >= 0.6), and to ``plain`` (``--judge
off --contrast off``: the default path before the corpus contrast) as ``*_vs_plain``.

    python benchmarks/judge_cost.py [--pairs 1000] [--per-shard 250] [--repeats 2] [--budget 0.3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _measure import cpu_split, flickr_shards, json_line, run_measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=None, help="folder for shards and outputs (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="pairclean-judge-cost-"))
    shards = flickr_shards(work / "shards", args.pairs, args.per_shard)
    exe = str(Path(sys.executable).with_name("pairclean"))
    settings = {"plain": ["--judge", "off", "--contrast", "off"], "off": ["--judge", "off"], "band": ["--judge", "band", "--judge-budget", str(args.budget)], "all": ["--judge", "all"]}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in settings}
    for round_ in range(args.repeats):
        for name, flags in settings.items():
            out = work / f"out-{name}-{round_}"
            cmd = [exe, "score", *shards, "--out", str(out), "--executor", "local", "--no-progress", "--threads", str(args.threads),
                   "--overwrite", *flags]
            m = run_measured(cmd)
            if m.rc != 0:
                print(m.output, file=sys.stderr)
                return 1
            record = {"setting": name, "round": round_, "pairs": args.pairs, "wall_s": round(m.wall_s, 2),
                      "pairs_per_s": round(args.pairs / m.wall_s, 2), **cpu_split(m, args.pairs)}
            json_line(record)
            runs[name].append(record)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def cpu(name: str) -> float:
        return median(name, "user_s_per_1k") + median(name, "sys_s_per_1k")

    base_rate, base_cpu = median("off", "pairs_per_s"), cpu("off")
    plain_rate, plain_cpu = median("plain", "pairs_per_s"), cpu("plain")
    for name in settings:
        json_line({"summary": name, "pairs_per_s": median(name, "pairs_per_s"), "cpu_s_per_1000": round(cpu(name), 1),
                   "throughput_vs_off": round(median(name, "pairs_per_s") / base_rate, 3),
                   "cpu_throughput_vs_off": round(base_cpu / cpu(name), 3),
                   "throughput_vs_plain": round(median(name, "pairs_per_s") / plain_rate, 3),
                   "cpu_throughput_vs_plain": round(plain_cpu / cpu(name), 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
