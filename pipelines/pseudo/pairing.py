"""RCSL-style pseudo-pairs (seed 002, docs/methods.md "RCSL"): recover pairs from the noisy ones.

Pairs a job judged noisy are the *unpaired pool*. For each pool image we find its nearest
pool caption and for each pool caption its nearest pool image (cosine of the stored
embeddings, FAISS via ``pairclean.pseudo.ann``), score every pseudo-pair with the job's own OSA
calibration and write them to ``OUT/_pseudo/<image shard stem>.parquet``, then the run's
completion record ``OUT/_pseudo/_run.json`` (see ``pseudo_pair`` for what a crash leaves).

Decisions (visible as options, recorded in each file's metadata):

- candidates are restricted to the pool (the paper; the code searched everything):
  ``pool="noisy"`` (default) is the ok pairs flagged noisy, ``pool="all"`` every ok pair;
- an image's own caption is never its pseudo-caption (it was judged mismatched; with
  ``pool="all"`` it would be the trivial answer): we search one extra neighbour and drop it;
- a pseudo-pair found from both sides (the image's nearest caption, whose nearest image is
  that image) is *mutual*; it is written once (as ``i2t``). ``mutual_only`` keeps only those;
- ``similarity`` is the exact cosine of the stored float16 embeddings, whatever the index
  (IVF-PQ distances are approximate); ``weight`` is the job's OSA weighting of it (of its
  adjusted value where the job has a corpus contrast: the scale its calibration was fitted
  on, ``contrast_adjusted``);
- ``rank`` is the caption's position among the image's neighbours (``i2t`` rows) or the
  image's among the caption's (``t2i`` rows), 0 = nearest; ``neighbours`` > 1 writes more.

The output has the logical name ``_pseudo/``, stored beside OUT in ``OUT.pairclean/pseudo/``
(``schema.side_name``; inside OUT for folders of the older layout), so ``OUT`` still reads
as exactly the score tables. Paths below say ``OUT/_pseudo`` for the logical name.

Memory: the pool's embeddings are copied, float16, into memory-mapped scratch files
(2 bytes x dim per vector and modality, on disk, unlinked once mapped), indexes are built
and queried in chunks, and one index is alive at a time. Queries may run elsewhere (a
``PoolSearcher``: workers read the query rows from the sidecars themselves, see
``Pool.segments`` and ``read_rows``) with the same chunks, so the same results. Captions
are read back from the shards (only those shards holding a chosen caption), since score
tables do not store text.

``PseudoCaptions`` is the trainer side: it maps ``(shard, key)`` of an image to its best
pseudo-caption and weight, loading one shard's file at a time (numpy and pyarrow only).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from pairclean import schema

if TYPE_CHECKING:
    from pairclean.pseudo.ann import IndexPlan, RawSearch
    from pairclean.calibrate.calibration import Calibration
    from pairclean.calibrate.contrast import Contrast
    from pairclean.output.folder import OutputDir

log = logging.getLogger(__name__)

__all__ = [
    "POOLS",
    "PSEUDO_DIR",
    "PseudoOptions",
    "Pool",
    "PairResult",
    "PseudoReport",
    "load_pool",
    "read_rows",
    "Search",
    "PoolSearcher",
    "RECORD",
    "nearest_pairs",
    "exact_cosine",
    "contrast_adjusted",
    "pseudo_pair",
    "PseudoCaptions",
]

POOLS: Final = ("noisy", "all")
#: Folder of the output, under OUT (the "_" keeps it out of dataset discovery).
PSEUDO_DIR: Final = schema.PSEUDO_DIR
#: The completion record of the last run, written after every file: a set of files without
#: it is an unfinished run (readers refuse it). The "_" keeps it out of dataset discovery.
RECORD: Final = schema.PSEUDO_RECORD_FILE
#: Columns of ``OUT/_pseudo/<stem>.parquet``.
COLUMNS: Final = ("image_shard", "image_key", "caption_shard", "caption_key", "caption", "similarity", "weight", "mutual", "rank", "direction")
_CHUNK: Final = 65_536


def _schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("image_shard", pa.string(), nullable=False),
            pa.field("image_key", pa.string(), nullable=False),
            pa.field("caption_shard", pa.string(), nullable=False),
            pa.field("caption_key", pa.string(), nullable=False),
            pa.field("caption", pa.string()),
            pa.field("similarity", pa.float32(), nullable=False),
            pa.field("weight", pa.float32(), nullable=False),
            pa.field("mutual", pa.bool_(), nullable=False),
            pa.field("rank", pa.int32(), nullable=False),
            pa.field("direction", pa.string(), nullable=False),
        ]
    )


@dataclass(frozen=True)
class PseudoOptions:
    """How to pseudo-pair. ``index``: auto | flat | ivf | ivfpq (``pairclean.pseudo.ann``);
    ``min_weight``: drop pseudo-pairs weighted below it; ``seed``: None = the job's seed;
    ``nprobe``: override the IVF probes; ``chunk``: rows per FAISS call."""

    pool: str = "noisy"
    mutual_only: bool = False
    index: str = "auto"
    min_weight: float = 0.0
    neighbours: int = 1
    seed: int | None = None
    nprobe: int | None = None
    chunk: int = _CHUNK


# -- the pool ---------------------------------------------------------------------------------
@dataclass
class Pool:
    """The unpaired pool: row ``g`` is pair ``keys[g]`` of shard ``stems[shard_of[g]]``.

    ``image``/``text``: (n, dim) float16 L2-normalised embeddings (memory-mapped scratch
    files, already unlinked: see ``_scratch``). ``sidecars[s]`` is the sidecar of shard
    ``s`` and ``side_rows[g]`` the row of pair ``g`` in it, so a worker can read any pool
    rows itself (``segments``, ``read_rows``).
    """

    stems: list[str]
    uris: list[str]
    shard_of: NDArray[np.int32]
    keys: list[str]
    image: NDArray[np.float16]
    text: NDArray[np.float16]
    sidecars: list[str] = field(default_factory=list)
    side_rows: NDArray[np.int64] = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    #: Rows left out because their embeddings hold NaN or infinity (a damaged sidecar).
    excluded: int = 0

    @property
    def size(self) -> int:
        return len(self.keys)

    def segments(self, start: int, stop: int) -> list[tuple[str, NDArray[np.int64]]]:
        """Pool rows ``[start, stop)`` as ``(sidecar name, rows in it)``, in pool order."""
        shards, rows = self.shard_of[start:stop], self.side_rows[start:stop]
        cuts = np.flatnonzero(np.diff(shards)) + 1
        return [(self.sidecars[int(part[0])], r) for part, r in zip(np.split(shards, cuts), np.split(rows, cuts))]


def _column(modality: str) -> str:
    """The sidecar column of ``modality`` (image or text)."""
    from pairclean import schema

    if modality not in ("image", "text"):
        raise ValueError(f"modality must be image or text, not {modality!r}")
    return schema.COL_IMAGE_EMB if modality == "image" else schema.COL_TEXT_EMB


def read_rows(out: OutputDir, segments: Iterable[tuple[str, NDArray[np.int64]]], modality: str) -> NDArray[np.float16]:
    """The ``modality`` embeddings of pool rows given as ``Pool.segments``, read from the
    sidecars of ``out`` and stored exactly as ``load_pool`` stores them (float16), so a
    search of them equals a search of the pool's own arrays."""
    column = _column(modality)
    parts = [_fixed_list_rows(out.store.read_parquet(name, columns=[column]).column(column), rows) for name, rows in segments]
    return np.concatenate(parts) if parts else np.empty((0, 0), dtype=np.float16)


def _pool_rows(table: pa.Table, pool: str) -> NDArray[np.int64]:
    from pairclean import schema

    ok = schema.ok_mask(table)
    if pool == "noisy":
        ok &= table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False).astype(bool)
    return np.flatnonzero(ok)


def _fixed_list_rows(col: pa.ChunkedArray, rows: NDArray[np.int64]) -> NDArray[np.float16]:
    taken = col.combine_chunks().take(pa.array(rows, type=pa.int64()))
    dim = taken.type.list_size
    rows16: NDArray[np.float16] = taken.flatten().to_numpy(zero_copy_only=False).astype(np.float16, copy=False).reshape(-1, dim)
    return rows16


def load_pool(out: OutputDir, pool: str, workdir: str | os.PathLike[str]) -> Pool:
    """Read the pool of a scored job: score tables first (small columns, to size it), then
    the sidecars one shard at a time into float16 memmaps under ``workdir``.

    Raises ``InputError`` (one line) for a folder that is not a scored job, a job without
    sidecars, or an empty pool.
    """
    from pairclean import schema
    from pairclean.errors import InputError

    if pool not in POOLS:
        raise InputError(f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}")
    spec = out.read_spec()
    if spec is None:
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})")
    records = list(out.iter_committed())
    if not records:
        raise InputError(f"{out.uri} holds no committed shard: run pairclean score first")
    lacking = [r.stem for r in records if not out.has_embeddings(r)]
    if lacking:
        raise InputError(
            f"{out.uri} has no embedding sidecars for {len(lacking)} shard(s) (e.g. {lacking[0]}): "
            "pseudo-pairing needs them; rescore into a new folder with pairclean score --embeddings"
        )
    uri_of = {stem: uri for uri, stem in spec.stems().items()}
    rows = [_pool_rows(out.read_scores(r, [schema.COL_KEY, schema.COL_STATUS, schema.COL_NOISY]), pool) for r in records]
    n = int(sum(len(r) for r in rows))
    if n == 0:
        which = "flagged noisy" if pool == "noisy" else "with status ok"
        raise InputError(f"the pool of {out.uri} is empty: no pair is {which}" + ("; try --pool all" if pool == "noisy" else ""))
    dim = out.read_embeddings_table(records[0]).schema.field(schema.COL_IMAGE_EMB).type.list_size
    image = _scratch(workdir, (n, dim))
    text = _scratch(workdir, (n, dim))
    keys: list[str] = []
    shard_of = np.empty(n, dtype=np.int32)
    kept: list[NDArray[np.int64]] = []
    excluded = 0
    pos = 0
    for s, (record, sel) in enumerate(zip(records, rows)):
        if not len(sel):
            kept.append(sel)
            continue
        side = out.read_embeddings_table(record)
        img = _fixed_list_rows(side.column(schema.COL_IMAGE_EMB), sel)
        txt = _fixed_list_rows(side.column(schema.COL_TEXT_EMB), sel)
        # Rows whose (float16) embeddings hold NaN or infinity come from a damaged sidecar:
        # they would match nothing or everything. Left out of the pool, and counted.
        finite = np.isfinite(img).all(axis=1) & np.isfinite(txt).all(axis=1)
        if not finite.all():
            excluded += int((~finite).sum())
            log.warning("%s: %d pool rows with NaN or infinite embeddings left out of the pool",
                        out.store.url(record.emb_output or ""), int((~finite).sum()))
            sel, img, txt = sel[finite], img[finite], txt[finite]
        image[pos : pos + len(sel)] = img
        text[pos : pos + len(sel)] = txt
        keys += side.column(schema.COL_KEY).take(pa.array(sel)).to_pylist()
        shard_of[pos : pos + len(sel)] = s
        pos += len(sel)
        kept.append(sel)
    if pos == 0:
        raise InputError(f"the pool of {out.uri} is empty: all {n} of its pairs have NaN or infinite embeddings (damaged sidecars)")
    stems = [r.stem for r in records]
    return Pool(stems, [uri_of.get(st, r.shard) for st, r in zip(stems, records)], shard_of[:pos], keys, image[:pos], text[:pos],
                sidecars=[r.emb_output or out.emb_name(r.stem) for r in records], side_rows=np.concatenate(kept),
                excluded=excluded)


def _scratch(workdir: str | os.PathLike[str], shape: tuple[int, int]) -> NDArray[np.float16]:
    """A float16 array of ``shape`` backed by a file under ``workdir`` that is unlinked as
    soon as it is mapped: the mapping keeps the data (paged to disk, not held in memory)
    and the kernel frees the file when the process ends, even by kill -9, so a crashed run
    leaves no scratch files behind (POSIX; the memory stays bounded by the page cache)."""
    fd, path = tempfile.mkstemp(prefix="pairclean-pseudo-", suffix=".npy", dir=workdir)
    os.close(fd)
    try:
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
    finally:
        os.unlink(path)


# -- nearest neighbours -----------------------------------------------------------------------
@dataclass
class PairResult:
    """Pseudo-pairs as pool row ids: image ``img[r]`` with caption ``cap[r]``; ``i2t_top``/
    ``t2i_top``: every image's nearest caption and every caption's nearest image (-1: none),
    before de-duplication and filtering."""

    img: NDArray[np.int64]
    cap: NDArray[np.int64]
    rank: NDArray[np.int32]
    direction: NDArray[np.str_]
    mutual: NDArray[np.bool_]
    plans: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    i2t_top: NDArray[np.int64] | None = None
    t2i_top: NDArray[np.int64] | None = None


def _drop_self(ids: NDArray[np.int64], k: int) -> NDArray[np.int64]:
    """Remove each query's own id (row i drops i) from its neighbour list; keep k columns."""
    ids = np.where(ids == np.arange(ids.shape[0])[:, None], -1, ids)
    # Stable sort moves the gaps (-1) to the end while keeping the others' order.
    order = np.argsort(ids < 0, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1)[:, :k]


#: ``search(index, plan, modality)``: where FAISS searches the pool's ``modality`` rows
#: ("image" or "text") against ``index``: an ``ann.RawSearch``, or None for this process.
Search = Callable[[Any, "IndexPlan", str], "RawSearch | None"]
#: ``searcher(pool, index, plan, modality)``: a ``Search`` that knows the pool (its sidecars),
#: e.g. a Ray actor pool reading query rows itself (``pairclean_workers.pseudo_exec``).
PoolSearcher = Callable[["Pool", Any, "IndexPlan", str], "RawSearch | None"]


def _neighbours(data: NDArray[Any], queries: NDArray[Any], modality: str, k: int, opts: PseudoOptions, seed: int,
                search: Search | None) -> tuple[NDArray[np.int64], dict[str, Any], dict[str, float]]:
    from pairclean.pseudo import ann

    plan = ann.choose_index(data.shape[0], data.shape[1], opts.index, seed=seed, nprobe=opts.nprobe)
    index, plan, timings = ann.build_index(plan, data, chunk=opts.chunk)
    t0 = time.perf_counter()
    raw = search(index, plan, modality) if search is not None else None
    # One extra neighbour: the query's own item (same pool row) is dropped.
    _, ids = ann.search(index, queries, min(k + 1, data.shape[0]), chunk=opts.chunk, data=data, refine_k=plan.refine_k, raw=raw)
    timings["search_s"] = time.perf_counter() - t0
    del index
    ids = _drop_self(ids, k)
    if ids.shape[1] < k:
        ids = np.concatenate([ids, np.full((ids.shape[0], k - ids.shape[1]), -1, dtype=np.int64)], axis=1)
    return ids, plan.to_json(), timings


def nearest_pairs(image: NDArray[Any], text: NDArray[Any], opts: PseudoOptions, seed: int = 0, search: Search | None = None) -> PairResult:
    """Pseudo-pairs of a pool of (n, dim) L2-normalised ``image`` and ``text`` rows (row i of
    each is the same original pair).

    ``i2t``: each image's ``opts.neighbours`` nearest captions; ``t2i``: each caption's
    nearest images; own pair excluded; a pair found both ways at rank 0 is ``mutual`` and
    appears once (as ``i2t``). With ``opts.mutual_only`` only mutual pairs remain.
    ``search``: where the queries run (default: here); the result is the same.
    """
    k = max(1, int(opts.neighbours))
    i2t, plan_t, tim_t = _neighbours(text, image, "image", k, opts, seed, search)
    t2i, plan_i, tim_i = _neighbours(image, text, "text", k, opts, seed, search)
    n = image.shape[0]
    top_i2t, top_t2i = i2t[:, 0], t2i[:, 0]

    def is_mutual(img: NDArray[np.int64], cap: NDArray[np.int64]) -> NDArray[np.bool_]:
        mutual: NDArray[np.bool_] = (img >= 0) & (cap >= 0) & (top_i2t[img.clip(0)] == cap) & (top_t2i[cap.clip(0)] == img)
        return mutual

    ranks = np.broadcast_to(np.arange(k, dtype=np.int32), (n, k))
    q = np.repeat(np.arange(n, dtype=np.int64), k)
    img = np.concatenate([q, t2i.ravel()])
    cap = np.concatenate([i2t.ravel(), q])
    rank = np.concatenate([ranks.ravel(), ranks.ravel()])
    direction = np.concatenate([np.full(n * k, "i2t"), np.full(n * k, "t2i")])
    keep = (img >= 0) & (cap >= 0)
    # A t2i pair that is also an i2t pair (mutual, or found at another rank) is written once.
    pair_code = img * max(n, 1) + cap
    i2t_codes = pair_code[: n * k][keep[: n * k]]
    keep[n * k :] &= ~np.isin(pair_code[n * k :], i2t_codes)
    mutual = is_mutual(img, cap)
    if opts.mutual_only:
        keep &= mutual
    return PairResult(
        img[keep], cap[keep], rank[keep], direction[keep], mutual[keep],
        plans={"i2t": plan_t, "t2i": plan_i},
        timings={**{f"i2t_{k_}": v for k_, v in tim_t.items()}, **{f"t2i_{k_}": v for k_, v in tim_i.items()}},
        i2t_top=top_i2t, t2i_top=top_t2i,
    )


def exact_cosine(image: NDArray[Any], text: NDArray[Any], img: NDArray[np.int64], cap: NDArray[np.int64], chunk: int = _CHUNK) -> NDArray[np.float32]:
    """Cosine of ``image[img[r]]`` and ``text[cap[r]]`` for each r, from the stored float16
    vectors (float32 arithmetic), gathered ``chunk`` rows at a time."""
    out = np.empty(len(img), dtype=np.float32)
    for start in range(0, len(img), chunk):
        a = np.asarray(image[img[start : start + chunk]], dtype=np.float32)
        b = np.asarray(text[cap[start : start + chunk]], dtype=np.float32)
        out[start : start + chunk] = (a * b).sum(axis=1)
    return out


def contrast_adjusted(sim: NDArray[np.float32], contrast: Contrast | None, image: NDArray[Any], text: NDArray[Any],
                      img: NDArray[np.int64], cap: NDArray[np.int64], chunk: int = _CHUNK) -> NDArray[np.float32]:
    """``sim`` (the cosines of ``image[img[r]]`` and ``text[cap[r]]``) adjusted by the job's
    corpus contrast, ``chunk`` rows at a time; ``sim`` itself when the job has none.

    Why: under a contrast the job's beta and curves were fitted on adjusted similarities, so
    a pseudo-pair is weighted on the same scale as the pairs its weights are compared with
    (a caption that fits many images gets less, as a scored pair's would). Cost: 4 x the bank's
    rows (at most 4,096) dot products a pseudo-pair, on the driver that already holds the pool
    (measured: about 9,000 pseudo-pairs/s on 2 cores with a full bank)."""
    if contrast is None:
        return sim
    out = np.empty(len(sim), dtype=np.float32)
    for start in range(0, len(sim), chunk):
        rows = slice(start, start + chunk)
        out[rows] = contrast.adjust(sim[rows], np.asarray(image[img[rows]]), np.asarray(text[cap[rows]]))
    return out


def weigh(similarity: NDArray[np.float32], calibration: Calibration) -> NDArray[np.float32]:
    """The job's own OSA weights of ``similarity`` (its beta, weighting and d_ref)."""
    from pairclean import osa

    return osa.apply_weighting(similarity, calibration.beta, calibration.weighting_params())


# -- the command ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PseudoReport:
    """What ``pseudo_pair`` did: pool size, pairs written (mutual among them), files, index
    plans, timings and where the queries ran."""

    pool_size: int
    pairs: int
    mutual: int
    files: list[str]
    plans: dict[str, Any]
    timings: dict[str, float]
    #: where the queries ran: local (this process), the searcher's ``name`` (default
    #: "remote"), or mixed
    executor: str = "local"
    #: pool pairs left out for NaN or infinite embeddings (damaged sidecars)
    excluded_nonfinite: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


def _captions(pool: Pool, caps: NDArray[np.int64], caption_field: str | None, storage_options: Mapping[str, Any]) -> dict[int, str | None]:
    """Text of the pool captions ``caps``, read from their shards (only shards that hold one)."""
    from pairclean.read.shards import ReadOptions, iter_pairs

    wanted: dict[int, dict[str, int]] = {}
    for g in np.unique(caps).tolist():
        wanted.setdefault(int(pool.shard_of[g]), {})[pool.keys[g]] = g
    texts: dict[int, str | None] = {}
    opts = ReadOptions(caption_field=caption_field, storage_options=dict(storage_options))
    for s, by_key in wanted.items():
        found = 0
        for sample in iter_pairs(pool.uris[s], opts):
            g = by_key.get(sample.key)
            if g is not None:
                texts[g] = sample.text
                found += 1
                if found == len(by_key):
                    break  # the rest of the shard holds no wanted caption
    return texts


def pseudo_pair(out: OutputDir, opts: PseudoOptions, storage_options: Mapping[str, Any] | None = None,
                before_write: Callable[[], None] | None = None, searcher: PoolSearcher | None = None,
                workdir: str | os.PathLike[str] | None = None) -> PseudoReport:
    """Pseudo-pair the pool of the scored job ``out`` and write ``OUT/_pseudo/<stem>.parquet``
    (one file per committed shard, empty when none of its images got a pseudo-caption;
    files of an earlier run under other names are removed), then the completion record
    ``OUT/_pseudo/_run.json``. Deterministic for a seed, wherever ``searcher`` runs the
    queries (default: this process).

    Crash safety (kill -9 at any point): every file is written whole or not at all
    (``Store.put``); the record is removed before the first file is replaced and written
    after the last, so an interrupted run leaves no record and readers refuse the mix of
    old and new files until a rerun, which recomputes everything (the search results are
    not kept) and writes the same bytes as an uninterrupted run. Temporaries of a killed
    local write are removed first; the pool's scratch files under ``workdir`` (default: the
    system's temporary folder) never outlive the process.

    Hold the folder's ``RunLock`` while calling and pass its ``check`` as ``before_write``
    (a run that lost the lock writes nothing). Raises ``InputError`` for unusable input.
    """
    from pairclean.errors import InputError

    calibration = out.read_calibration()
    if calibration is None:
        raise InputError(f"{out.uri} has no calibration yet: run pairclean score to completion first")
    if opts.min_weight < 0 or opts.min_weight > 1:
        raise InputError(f"--min-weight must be in [0, 1], not {opts.min_weight}")
    if opts.chunk < 1:
        raise InputError(f"--chunk must be at least 1, not {opts.chunk}")
    t0 = time.perf_counter()
    out.store.remove_temporaries(PSEUDO_DIR)  # a killed run's half-written temporaries (ours)
    pool = load_pool(out, opts.pool, workdir if workdir is not None else tempfile.gettempdir())
    spec = out.read_spec()
    assert spec is not None
    seed = spec.seed if opts.seed is None else opts.seed
    timings = {"load_s": time.perf_counter() - t0}
    if pool.size < 2:
        raise InputError(f"the pool of {out.uri} has a single pair: nothing to pair it with")
    where: set[str] = set()

    def search(index: Any, plan: IndexPlan, modality: str) -> RawSearch | None:
        raw = searcher(pool, index, plan, modality) if searcher is not None else None
        where.add("local" if raw is None else "remote")
        return raw

    result = nearest_pairs(pool.image, pool.text, opts, seed, search)
    timings.update(result.timings)
    t1 = time.perf_counter()
    sim = exact_cosine(pool.image, pool.text, result.img, result.cap, opts.chunk)
    contrast = out.read_contrast(calibration)
    weight = weigh(contrast_adjusted(sim, contrast, pool.image, pool.text, result.img, result.cap, opts.chunk), calibration)
    keep = weight >= opts.min_weight
    texts = _captions(pool, result.cap[keep], spec.caption_field, storage_options or {})
    timings["captions_s"] = time.perf_counter() - t1
    meta = {
        "kind": "pseudo-pairs", "method": "RCSL nearest-neighbour pseudo-pairing (docs/methods.md)",
        "pool": opts.pool, "pool_size": pool.size, "mutual_only": opts.mutual_only, "neighbours": opts.neighbours,
        "min_weight": opts.min_weight, "seed": seed, "index": result.plans, "calibration": calibration.to_json(),
        "weighted_on": "similarity" if contrast is None else "adjusted_similarity (the job's corpus contrast)",
        "job": _job_digest(out),
    }
    _check_targets(out, pool.stems)
    if before_write is not None:
        before_write()
    out.store.rm(RECORD)  # from here until the record is back, the folder is a run in progress
    files = _write(out, pool, result, sim, weight, keep, texts, meta)
    pairs, mutual = int(keep.sum()), int((result.mutual & keep).sum())
    record = {**{k: v for k, v in meta.items() if k != "calibration"}, "pairs": pairs, "mutual": mutual, "files": files}
    if before_write is not None:
        before_write()
    out.store.put(RECORD, json.dumps(record, indent=1, sort_keys=True).encode())
    out.store.rm(schema.PSEUDO_STALE_FILE)  # made from today's tables
    timings["total_s"] = time.perf_counter() - t0
    remote = getattr(searcher, "name", "remote")
    return PseudoReport(pool.size, pairs, mutual, sorted(files), result.plans, timings,
                        executor=remote if where == {"remote"} else "local" if where <= {"local"} else "mixed",
                        excluded_nonfinite=pool.excluded)


def _check_targets(out: OutputDir, stems: list[str]) -> None:
    """``InputError`` naming the first file at a name this run writes or replaces that
    pairclean did not write, before anything is written or deleted (such a file stopped the
    run half-way, after the record was deleted and some tables written)."""
    from pairclean import schema
    from pairclean.errors import InputError

    present = set(out.store.list(PSEUDO_DIR))
    targets = [f"{PSEUDO_DIR}/{stem}.parquet" for stem in stems if f"{stem}.parquet" in present]
    foreign = [n for n, ours in out.pseudo_records().items() if not ours]
    foreign += [n for n in targets if not out.written_by(n)]
    if foreign:
        where = out.store.url(foreign[0])
        raise InputError(f"{where} was not written by pairclean: pseudo-pair writes nothing over it (move it away, or "
                         f"out of {out.store.url(schema.PSEUDO_DIR)})", uri=where)


def _job_digest(out: OutputDir) -> str | None:
    doc = out.read_job_doc() or {}
    return doc.get("spec_sha256")


def _write(out: OutputDir, pool: Pool, result: PairResult, sim: NDArray[np.float32], weight: NDArray[np.float32],
           keep: NDArray[np.bool_], texts: dict[int, str | None], meta: dict[str, Any]) -> dict[str, str]:
    """Write one file per shard; returns ``{name: sha256}``. Removes our files of shards no
    longer committed (only ours: ``written_by``)."""
    from pairclean import __version__, schema

    idx = np.flatnonzero(keep)
    img_shard = pool.shard_of[result.img[idx]]
    # Rows grouped by image shard, in pool order, i2t before t2i, then rank: deterministic.
    order = np.lexsort((result.rank[idx], result.direction[idx] != "i2t", result.img[idx], img_shard))
    idx, img_shard = idx[order], img_shard[order]
    written: dict[str, str] = {}
    for s, stem in enumerate(pool.stems):
        rows = idx[img_shard == s]
        ig, cg = result.img[rows], result.cap[rows]
        table = pa.table(
            {
                "image_shard": [pool.uris[s]] * len(rows),
                "image_key": [pool.keys[g] for g in ig.tolist()],
                "caption_shard": [pool.uris[pool.shard_of[g]] for g in cg.tolist()],
                "caption_key": [pool.keys[g] for g in cg.tolist()],
                "caption": [texts.get(g) for g in cg.tolist()],
                "similarity": sim[rows], "weight": weight[rows], "mutual": result.mutual[rows],
                "rank": result.rank[rows], "direction": result.direction[rows].astype(str).tolist(),
            },
            schema=_schema(),
        )
        doc = {**meta, "shard": pool.uris[s], "pairclean_version": __version__}
        table = table.replace_schema_metadata({schema.META_KEY: json.dumps(doc, sort_keys=True).encode()})
        name = f"{PSEUDO_DIR}/{stem}.parquet"
        written[name] = out.write_table(name, table).sha256
    # Files of an earlier run for shards that are no longer committed: ours, so removed.
    for name in out.store.list(PSEUDO_DIR):
        full = f"{PSEUDO_DIR}/{name}"
        if full not in written and name.endswith(".parquet") and out.written_by(full):
            out.store.rm(full)
    return written


# -- the trainer side -------------------------------------------------------------------------
def _stem_of(url: str) -> str:
    from pairclean.uris import shard_stem  # the scorer's own naming: pipe:, query strings, any scheme

    return shard_stem(url)


def _read_pseudo(path: Path) -> Any:
    """One shard's pseudo-pairs (image_key, caption, weight), or a one-line ``InputError``
    naming the file: a FIFO there is refused before any read (it hung the reader), a file
    that is not such a table is damaged (pyarrow's own error had a 12-frame traceback)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairclean.errors import InputError, first_line
    from pairclean.storage import open_regular

    try:
        with open_regular(path) as fh:
            return pq.read_table(fh, columns=["image_key", "caption", "weight"])
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise InputError(f"{path} is not a readable pseudo-pair table with image_key, caption and weight ({first_line(exc)}); "
                         "run pairclean pseudo-pair again", uri=str(path)) from None


class PseudoCaptions:
    """Pseudo-captions of a job's images: ``get(shard_url, key)`` -> ``(caption, weight)`` or None.

    Reads ``OUT/_pseudo/<stem>.parquet`` (local folder) of a finished run (its ``_run.json``
    record present; else ``FileNotFoundError``) lazily, one shard's file the first
    time one of its samples is seen, keeping at most ``max_cached_shards``. An image with
    several pseudo-pairs (``t2i`` rows, or ``neighbours`` > 1) gets the highest-weighted one
    (ties: its own nearest caption first). Plain attributes only: picklable, so it works in
    DataLoader workers under any start method.

    ``substitute(sample, url, key)`` puts the pseudo-caption into ``sample[caption_key]``
    (bytes if the sample's value is bytes) and its weight into ``sample["weight"]``.
    """

    def __init__(self, output_dir: str | os.PathLike[str], caption_key: str = "txt", max_cached_shards: int = 64) -> None:
        from pairclean import schema

        # OUT.pairclean/pseudo/ (OUT/_pseudo/ in folders of the older layout)
        self.root = Path(schema.local_side_path(output_dir, PSEUDO_DIR))
        if not self.root.is_dir():
            raise FileNotFoundError(f"no pseudo-pairs in {output_dir}: run pairclean pseudo-pair {output_dir} first")
        if not Path(schema.local_side_path(output_dir, RECORD)).is_file():
            # Files without the record are a mix of an interrupted run's and an older run's.
            raise FileNotFoundError(f"the pseudo-pairs in {output_dir} are incomplete (a pseudo-pair run was interrupted): "
                                    f"run pairclean pseudo-pair {output_dir} again")
        if Path(schema.local_side_path(output_dir, schema.PSEUDO_STALE_FILE)).is_file():
            raise FileNotFoundError(f"the pseudo-pairs in {output_dir} were made from weights the job has replaced since "
                                    f"(rescore, refine or audit): run pairclean pseudo-pair {output_dir} again")
        self.caption_key = caption_key
        self.max_cached = max_cached_shards
        self._cache: dict[str, dict[str, tuple[str, float]]] = {}

    def _load(self, stem: str) -> dict[str, tuple[str, float]]:
        if stem in self._cache:
            return self._cache[stem]
        from pairclean import schema

        path = self.root / f"{stem}.parquet"
        best: dict[str, tuple[str, float]] = {}
        if path.exists():
            t = _read_pseudo(path)
            weights = schema.checked_weights(t.column("weight"), str(path))
            # Rows are written i2t first, then by rank: keep the first of equal weights.
            for key, caption, weight in zip(t.column("image_key").to_pylist(), t.column("caption").to_pylist(), weights):
                if caption is not None and key is not None and (key not in best or weight > best[key][1]):
                    best[key] = (str(caption), float(weight))
        if len(self._cache) >= self.max_cached:
            self._cache.pop(next(iter(self._cache)))
        self._cache[stem] = best
        return best

    def get(self, url: str, key: str) -> tuple[str, float] | None:
        """The pseudo-caption and weight of image ``key`` of shard ``url``, or None (the key
        as the tables hold it, ``schema.utf8_text``, as ``WeightStore.get`` reads it)."""
        from pairclean import schema

        return self._load(_stem_of(url)).get(schema.utf8_text(key)[0])

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the configuration, not the parent's cache (as WeightStore): spawned
        # DataLoader workers each got a copy of every shard the parent had read.
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def substitute(self, sample: dict[str, Any], url: str, key: str, weight_key: str = "weight") -> bool:
        """Replace the caption and weight (``sample[weight_key]``) of ``sample`` in place;
        False when it has no pseudo-pair."""
        found = self.get(url, key)
        if found is None:
            return False
        caption, weight = found
        old = sample.get(self.caption_key)
        sample[self.caption_key] = caption.encode("utf-8") if isinstance(old, (bytes, bytearray)) else caption
        sample[weight_key] = weight
        return True

    def keys(self, stems: Iterable[str]) -> dict[str, set[str]]:
        """Image keys with a pseudo-caption, per stem (for reports and tests)."""
        return {s: set(self._load(s)) for s in stems}
