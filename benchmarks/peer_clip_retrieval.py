"""pairclean against clip-retrieval's ``inference`` on the same shards and checkpoint, interleaved.

clip-retrieval (https://github.com/rom1504/clip-retrieval) embeds the images and captions
of WebDataset shards with a CLIP model: the embedding half of pairclean's work. Both read
the same Flickr8k shards (real photos, 20% shuffled captions) and, for the like-for-like
run, the same open_clip ViT-B-32 checkpoint (random weights saved once as a local file: no
model hub; speed does not depend on the weights). Per round, in this order:

- ``clip-retrieval``: ``clip-retrieval inference`` in its own virtualenv (``--venv``,
  created on first use: clip-retrieval 2.45.0 needs ``setuptools==80.9.0`` and
  ``numpy<2``; torch as pinned here), ``--clip_model open_clip:ViT-B-32/<checkpoint>``,
  ``HF_HUB_OFFLINE=1``, the same batch size, ``--num_prepro_workers`` = CPU count;
- ``pairclean-vit``: ``pairclean score --model ViT-B-32 --checkpoint <the same file>``
  (default executor, precision and engine ``auto``);
- ``pairclean-default``: ``pairclean score`` with its default estimator (pairclean-lite).

Rates are pairs over the wall time of each whole command (model load and start-up
included; clip-retrieval's own warm-up too); CPU seconds are those of each process tree.
One JSON line per run, then a ``summary`` with medians and ``ratio`` = pairclean /
clip-retrieval (goal for the default path: >= 3 on CPU), and ``vit_min_cosine``: the
agreement of the two tools' ViT-B-32 image embeddings on the same keys (proof that they
ran the same checkpoint).

    python benchmarks/peer_clip_retrieval.py [--pairs 1000] [--rounds 1] [--venv DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from _measure import cpu_split, flickr_shards, json_line, random_checkpoint, run_measured, warm_beta_cache
from throughput import pairclean_command

CLIP_RETRIEVAL = ["clip-retrieval==2.45.0", "setuptools==80.9.0", "numpy<2", "torch==2.14.1", "torchvision==0.29.1"]
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pairclean" / "clip-retrieval-2.45.0-venv"


def ensure_venv(path: Path) -> Path:
    """The clip-retrieval command of the virtualenv at ``path``, created and filled if absent."""
    command = path / "bin" / "clip-retrieval"
    if command.exists():
        return command
    print(f"creating {path} with {' '.join(CLIP_RETRIEVAL)} (once)", file=sys.stderr, flush=True)
    venv.create(path, with_pip=True, clear=True)
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", *CLIP_RETRIEVAL], check=True)
    if not command.exists():
        sys.exit(f"{command} missing after the install")
    return command


def _brace_pattern(shards: list[str]) -> str:
    """``dir/name-{00000..00003}.tar`` for consecutive shards (clip-retrieval's input form)."""
    if len(shards) == 1:
        return shards[0]
    folder, first, last = Path(shards[0]).parent, Path(shards[0]).stem, Path(shards[-1]).stem
    prefix, start = first.rsplit("-", 1)
    return f"{folder}/{prefix}-{{{start}..{last.rsplit('-', 1)[1]}}}.tar"


def _clip_retrieval(command: Path, shards: list[str], checkpoint: str, out: Path, batch_size: int) -> list[str]:
    return [str(command), "inference", "--input_dataset", _brace_pattern(shards), "--output_folder", str(out),
            "--input_format", "webdataset", "--clip_model", f"open_clip:ViT-B-32/{os.path.abspath(checkpoint)}",
            "--batch_size", str(batch_size), "--num_prepro_workers", str(os.cpu_count() or 1)]


def _pairclean(shards: list[str], out: Path, batch_size: int, model_args: list[str]) -> list[str]:
    return pairclean_command() + ["score", *shards, "--out", str(out), "--overwrite", "--no-progress",
                                  "--batch-size", str(batch_size), *model_args]


def _vit_agreement(clip_out: Path, pairclean_out: Path) -> float | None:
    """Over clip-retrieval's image embeddings, the smallest cosine to the nearest of
    pairclean's (its output order follows its loader workers, so rows are matched by
    nearest neighbour; the shards hold each photo once): ~1 when both ran one checkpoint."""
    import numpy as np
    import pyarrow.parquet as pq

    embs = sorted((clip_out / "img_emb").glob("*.npy"))
    ours = [row for part in sorted((pairclean_out / "_emb").glob("*.parquet"))
            for row in pq.read_table(part, columns=["image_emb"]).column(0).to_pylist() if row is not None]
    if not embs or not ours:
        return None
    theirs = np.concatenate([np.load(e) for e in embs]).astype(np.float32)
    mine = np.asarray(ours, dtype=np.float32)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    mine /= np.linalg.norm(mine, axis=1, keepdims=True)
    return round(float((theirs @ mine.T).max(axis=1).min()), 5)


def _clip_retrieval_rows(out: Path) -> int:
    """Image embeddings clip-retrieval wrote (it exits 0 even when its reader dropped every sample)."""
    import numpy as np

    return sum(int(np.load(e, mmap_mode="r").shape[0]) for e in (out / "img_emb").glob("*.npy"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="clip-retrieval's virtualenv (created if absent)")
    parser.add_argument("--work", type=Path, default=None, help="keep shards and checkpoint here (reused)")
    args = parser.parse_args()

    command = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory(prefix="pairclean-peer-") as tmp:
        work = args.work or Path(tmp)
        shards = flickr_shards(work / f"shards-{args.pairs}", args.pairs, args.per_shard)
        checkpoint = random_checkpoint(work, "ViT-B-32")
        warm_beta_cache("ViT-B-32", checkpoint)  # pairclean's once-per-model beta: not a per-run cost
        runs: dict[str, list[str]] = {
            "clip-retrieval": _clip_retrieval(command, shards, checkpoint, work / "out-clip-retrieval", args.batch_size),
            "pairclean-vit": _pairclean(shards, work / "out-pairclean-vit", args.batch_size, ["--model", "ViT-B-32", "--checkpoint", checkpoint]),
            "pairclean-default": _pairclean(shards, work / "out-pairclean-default", args.batch_size, []),
        }
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        rates: dict[str, list[float]] = {name: [] for name in runs}
        expected = args.pairs
        for round_ in range(args.rounds):
            for name, cmd in runs.items():
                if name == "clip-retrieval":
                    subprocess.run(["rm", "-rf", str(work / "out-clip-retrieval")], check=True)  # it refuses a non-empty folder
                m = run_measured(cmd, env)
                if m.rc != 0 or (name == "clip-retrieval" and _clip_retrieval_rows(work / "out-clip-retrieval") != expected):
                    sys.exit(f"{name} failed ({m.rc}) or embedded too few pairs:\n{m.output[-3000:]}")
                rates[name].append(args.pairs / m.wall_s)
                json_line({"benchmark": "peer_clip_retrieval", "run": name, "round": round_, "pairs": args.pairs,
                           "wall_s": round(m.wall_s, 1), "pairs_per_s": round(args.pairs / m.wall_s, 2), **cpu_split(m, args.pairs)})
        median = {name: statistics.median(r) for name, r in rates.items()}
        json_line({
            "benchmark": "peer_clip_retrieval", "summary": True, "pairs": args.pairs, "rounds": args.rounds, "cpus": os.cpu_count(),
            **{f"{name}_pairs_per_s": round(v, 2) for name, v in median.items()},
            "ratio_same_checkpoint": round(median["pairclean-vit"] / median["clip-retrieval"], 2),
            "ratio_default_estimator": round(median["pairclean-default"] / median["clip-retrieval"], 2),
            "vit_min_cosine": _vit_agreement(work / "out-clip-retrieval", work / "out-pairclean-vit"),
        })


if __name__ == "__main__":
    main()
