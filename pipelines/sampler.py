"""Trainer-facing use of the weights: a WebDataset stage and a distributed weighted sampler.

Light on purpose: numpy and pyarrow only (torch and webdataset are optional and never
imported here). ``import pairclean.sampler`` is safe in any training environment.

- ``WeightStore`` joins weights by ``__key__`` from a job's per-shard Parquet, loading
  one shard's file the first time one of its samples is seen.
- ``weight_stage`` is a WebDataset pipeline stage (a function from an iterator of samples
  to an iterator of samples): mode ``loss`` adds ``sample["weight"]``, ``sample`` keeps a
  sample with probability ``min(1, w / w_cap)`` (seeded, deterministic per rank), ``keep``
  drops pairs flagged noisy, ``pseudo`` replaces a noisy pair's caption and weight by its
  RCSL pseudo-caption (``pairclean.pseudo.PseudoCaptions``, from ``pairclean pseudo-pair``).
- ``WeightedSampler`` draws indices of a map-style dataset in proportion to weights, for
  any number of weights (no 2^24 limit), each rank its own slice, reseeded by ``set_epoch``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from numpy.typing import NDArray

__all__ = ["MISSING_POLICIES", "MODES", "WeightStore", "weight_stage", "WeightedSampler"]

MODES = ("loss", "sample", "keep", "pseudo")
MISSING_POLICIES = ("error", "skip", "default")
_CHUNK = 1 << 20  # weights processed per chunk: bounds temporary memory


def _stem_of(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class WeightStore:
    """Weights and noisy flags of one job's output folder, loaded lazily per shard.

    ``get(url, key)`` -> ``(weight, noisy)`` or None when the shard or key has no row
    (a shard with no output file counts as missing, not as an error).
    """

    def __init__(self, output_dir: str | os.PathLike[str], max_cached_shards: int = 64) -> None:
        self.root = Path(output_dir)
        if not self.root.is_dir():
            raise FileNotFoundError(f"pairclean output folder not found: {self.root}")
        self.max_cached = max_cached_shards
        self._cache: dict[str, dict[str, tuple[float, bool]]] = {}

    def _load(self, stem: str) -> dict[str, tuple[float, bool]]:
        if stem in self._cache:
            return self._cache[stem]
        path = self.root / f"{stem}.parquet"
        table = pq.read_table(path, columns=["key", "weight", "noisy"]) if path.exists() else None
        rows: dict[str, tuple[float, bool]] = {}
        if table is not None:
            keys = table.column("key").to_pylist()
            weights = table.column("weight").to_numpy()
            noisy = table.column("noisy").to_numpy(zero_copy_only=False)
            rows = {k: (float(w), bool(n)) for k, w, n in zip(keys, weights, noisy)}
        if len(self._cache) >= self.max_cached:
            self._cache.pop(next(iter(self._cache)))  # shards stream in order: drop the oldest
        self._cache[stem] = rows
        return rows

    def get(self, url: str, key: str) -> tuple[float, bool] | None:
        return self._load(_stem_of(url)).get(key)


def _unit_hash(seed: int, rank: int, url: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, rank, shard, key): reproducible decisions
    that do not depend on the order or the worker that sees a sample."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{url}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True)
class _StageConfig:
    mode: str
    w_cap: float
    missing: str
    default: float
    seed: int
    rank: int
    pseudo: Any = None  # a PseudoCaptions in mode "pseudo"


def weight_stage(
    output_dir: str | os.PathLike[str],
    mode: str = "loss",
    *,
    w_cap: float = 1.0,
    missing: str = "error",
    default: float = 1.0,
    seed: int = 0,
    rank: int = 0,
    pseudo: Any = None,
) -> Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]:
    """A WebDataset stage joining pairclean weights by ``__key__`` (and ``__url__``'s shard).

    Use as ``wds.WebDataset(urls).compose(weight_stage(out, "sample"))`` or as a stage of
    ``wds.DataPipeline``. ``missing``: ``error`` raises ``KeyError``, ``skip`` drops the
    sample, ``default`` uses ``default`` as its weight (and counts it as clean). Mode
    ``pseudo``: like ``loss``, but a noisy pair with a pseudo-pair gets the pseudo-caption
    (same field, e.g. ``txt``) and its weight, and ``sample["pseudo"] = True``; ``pseudo``
    is a ``PseudoCaptions`` (default: one over ``output_dir``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, not {missing!r}")
    if w_cap <= 0:
        raise ValueError("w_cap must be positive")
    store = WeightStore(output_dir)
    if mode == "pseudo" and pseudo is None:
        from .pseudo import PseudoCaptions

        pseudo = PseudoCaptions(output_dir)
    cfg = _StageConfig(mode, w_cap, missing, default, seed, rank, pseudo)

    def stage(samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for sample in samples:
            out = _apply(sample, store, cfg)
            if out is not None:
                yield out

    return stage


def _apply(sample: dict[str, Any], store: WeightStore, cfg: _StageConfig) -> dict[str, Any] | None:
    url, key = str(sample.get("__url__", "")), str(sample["__key__"])
    found = store.get(url, key)
    if found is None:
        if cfg.missing == "error":
            raise KeyError(f"no pairclean weight for key {key!r} of shard {url!r} in {store.root}")
        if cfg.missing == "skip":
            return None
        found = (cfg.default, False)
    weight, noisy = found
    if cfg.mode == "keep":
        return None if noisy else sample
    if cfg.mode == "sample":
        return sample if _unit_hash(cfg.seed, cfg.rank, url, key) < min(1.0, weight / cfg.w_cap) else None
    sample["weight"] = weight
    if cfg.mode == "pseudo":
        sample["pseudo"] = bool(noisy) and cfg.pseudo.substitute(sample, url, key)
    return sample


class WeightedSampler:
    """Indices of a map-style dataset drawn in proportion to ``weights``, sliced per rank.

    - any length (50 million and more; no 2^24 limit). With replacement, draws go chunk by
      chunk (a chunk by its total weight, then an index inside it), so temporary memory is
      O(chunk + num_samples); without replacement one float32 key per weight is needed;
    - ``replacement=True``: each rank draws ``num_samples`` independent indices;
      ``replacement=False``: one global weighted permutation (Efraimidis-Spirakis keys),
      dealt to ranks round-robin, so ranks never share an index within an epoch;
    - ``set_epoch(e)`` reseeds, as ``torch.utils.data.DistributedSampler`` does.

    Works as a ``sampler=`` of a torch ``DataLoader`` (it has ``__iter__`` and ``__len__``).
    """

    def __init__(
        self,
        weights: NDArray[np.floating[Any]] | Iterable[float],
        num_samples: int | None = None,
        *,
        replacement: bool = True,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        w = np.asarray(weights, dtype=np.float32)
        if w.ndim != 1 or w.size == 0:
            raise ValueError("weights must be a non-empty 1-D array")
        if not np.all(np.isfinite(w)) or (w < 0).any():
            raise ValueError("weights must be finite and non-negative")
        if not (w > 0).any():
            raise ValueError("at least one weight must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.weights = w
        self.replacement = replacement
        self.rank, self.world_size, self.seed = rank, world_size, seed
        positive = int((w > 0).sum())
        total = num_samples if num_samples is not None else w.size
        if not replacement and total > positive:
            raise ValueError(f"cannot draw {total} samples without replacement from {positive} positive weights")
        self.total = total
        self.epoch = 0
        # Chunk totals are the only O(N / chunk) state kept between epochs.
        self._chunk_sums = np.array([w[i : i + _CHUNK].sum(dtype=np.float64) for i in range(0, w.size, _CHUNK)])

    def set_epoch(self, epoch: int) -> None:
        """Draw a different, reproducible sequence for ``epoch``."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(range(self.rank, self.total, self.world_size))

    def __iter__(self) -> Iterator[int]:
        indices = self._with_replacement() if self.replacement else self._without_replacement()
        return iter(indices.tolist())

    def _rng(self, *extra: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, *extra])

    def _with_replacement(self) -> NDArray[np.int64]:
        rng = self._rng(self.rank)
        n = len(self)
        # Two-level draw: a chunk by its total weight, then an index inside it.
        probs = self._chunk_sums / self._chunk_sums.sum()
        per_chunk = rng.multinomial(n, probs)
        out = np.empty(n, dtype=np.int64)
        pos = 0
        for c, count in enumerate(per_chunk):
            if count == 0:
                continue
            start = c * _CHUNK
            cdf = np.cumsum(self.weights[start : start + _CHUNK], dtype=np.float64)
            u = rng.random(count) * cdf[-1]
            out[pos : pos + count] = start + np.searchsorted(cdf, u, side="right")
            pos += count
        rng.shuffle(out)  # chunk order must not leak into the sample order
        return out

    def _without_replacement(self) -> NDArray[np.int64]:
        rng = self._rng()  # the same global permutation on every rank
        keys = np.empty(self.weights.size, dtype=np.float32)
        for start in range(0, self.weights.size, _CHUNK):
            w = self.weights[start : start + _CHUNK]
            e = rng.exponential(size=w.size).astype(np.float32)
            with np.errstate(divide="ignore"):
                keys[start : start + _CHUNK] = np.where(w > 0, e / w, np.inf)
        # Smallest E/w first is a weighted sample without replacement (Efraimidis-Spirakis).
        top = np.argpartition(keys, self.total - 1)[: self.total] if self.total < keys.size else np.arange(keys.size)
        order = top[np.argsort(keys[top], kind="stable")]
        return order[self.rank :: self.world_size].astype(np.int64)
