"""Evaluation data: Flickr8k captions, noisy pairings, and WebDataset shard writing.

Used by ``train-lite``, the benchmarks and the tests. Flickr8k is research-use data read
from ``shared/data/flickr8k``; nothing here copies it anywhere but the temporary shards
a caller asks for.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "FLICKR_ENV",
    "find_flickr8k",
    "FlickrImage",
    "load_flickr8k",
    "NoisyPairs",
    "noisy_pairing",
    "write_shard",
    "write_pair_shards",
]

#: Environment variable that points at the Flickr8k folder (else ../shared/data/flickr8k).
FLICKR_ENV = "PAIRCLEAN_FLICKR8K"


def find_flickr8k(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The Flickr8k folder: ``$PAIRCLEAN_FLICKR8K``, else ``shared/data/flickr8k`` beside the repo."""
    explicit = os.environ.get(FLICKR_ENV)
    if explicit:
        return Path(explicit) if (Path(explicit) / "captions.jsonl").exists() else None
    here = Path(start or __file__).resolve()
    for parent in [here, *here.parents]:
        candidate = parent.parent / "shared" / "data" / "flickr8k"
        if (candidate / "captions.jsonl").exists():
            return candidate
    return None


@dataclass(frozen=True)
class FlickrImage:
    """One Flickr8k photo with its five captions."""

    image: str
    path: Path
    captions: tuple[str, ...]
    split: str


def load_flickr8k(root: Path, split: str | None = None) -> list[FlickrImage]:
    """Images of ``split`` (train | dev | none | None for all), in file order."""
    captions: dict[str, list[str]] = {}
    splits: dict[str, str] = {}
    with open(root / "captions.jsonl", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            captions.setdefault(rec["image"], []).append(rec["caption"].strip())
            splits[rec["image"]] = rec["split"]
    return [
        FlickrImage(name, root / "images" / name, tuple(caps), splits[name])
        for name, caps in captions.items()
        if split is None or splits[name] == split
    ]


@dataclass(frozen=True)
class NoisyPairs:
    """A pairing of images with captions; ``noisy[i]`` says caption i is not image i's own."""

    images: list[FlickrImage]
    captions: list[str]
    noisy: np.ndarray


def noisy_pairing(images: Sequence[FlickrImage], noise_rate: float, seed: int, caption_index: int = 0) -> NoisyPairs:
    """Pair each image with one of its captions, then shuffle a ``noise_rate`` fraction.

    The shuffled captions are permuted among the chosen images as a derangement (a
    cyclic shift of a random order), so none lands back on its own image.
    """
    rng = np.random.default_rng(seed)
    captions = [img.captions[caption_index % len(img.captions)] for img in images]
    noisy = np.zeros(len(images), dtype=bool)
    n_noisy = int(round(noise_rate * len(images)))
    if n_noisy >= 2:
        chosen = rng.choice(len(images), size=n_noisy, replace=False)
        shifted = np.roll(chosen, 1)
        original = list(captions)
        for dst, src in zip(chosen, shifted):
            captions[dst] = original[src]
        noisy[chosen] = True
    return NoisyPairs(list(images), captions, noisy)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: str | os.PathLike[str], samples: Iterable[dict[str, bytes | str | dict[str, object]]]) -> Path:
    """Write a WebDataset tar: each sample is ``{"__key__": k, "jpg": bytes, "txt": str, "json": {...}}``.

    Members are written in order as ``<key>.<ext>``, which is how WebDataset's own
    TarWriter lays them out.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for sample in samples:
            key = str(sample["__key__"])
            for ext, value in sample.items():
                if ext == "__key__":
                    continue
                if isinstance(value, dict):
                    data = json.dumps(value).encode()
                elif isinstance(value, str):
                    data = value.encode("utf-8")
                else:
                    data = bytes(value)
                _add(tar, f"{key}.{ext}", data)
    return out


def write_pair_shards(folder: str | os.PathLike[str], pairs: Sequence[tuple[str, Path, str]], per_shard: int, prefix: str) -> list[str]:
    """Write ``(key, image path, caption)`` pairs as ``<prefix>-NNNNN.tar`` shards of ``per_shard``."""
    paths = []
    for start in range(0, len(pairs), per_shard):
        samples: list[dict[str, bytes | str | dict[str, object]]] = [
            {"__key__": key, "jpg": path.read_bytes(), "txt": caption} for key, path, caption in pairs[start : start + per_shard]
        ]
        paths.append(str(write_shard(Path(folder) / f"{prefix}-{start // per_shard:05d}.tar", samples)))
    return paths
