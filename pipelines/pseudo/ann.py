"""Nearest-neighbour search for pseudo-pairing (RCSL, docs/methods.md): which FAISS index,
how to build it with bounded memory, and chunked top-k search.

Inner product on L2-normalised vectors is cosine. Index choice by pool size:

- ``flat`` (exact) up to ``FLAT_MAX`` vectors: a full scan per query, O(n^2 d) over the
  pool (20,000 x 512 both ways: about 10-40 s on 2 cores);
- ``ivf`` (IVF-Flat: exact distances inside the probed cells) up to ``IVF_MAX``; its scan
  costs ``d`` multiply-adds per visited vector, too slow for millions of queries on a CPU;
- ``ivfpq`` above: IVF with 4-bit PQ "fast-scan" codes (``d / PQ_DIM_PER_CODE`` codes,
  half a byte each: 64 bytes per 512-d vector), scanned with SIMD lookup tables, so
  hundreds of millions of vectors fit in memory and a million queries take minutes. PQ
  distances are coarse, so ``search`` fetches ``refine_k`` candidates and re-ranks them by
  exact inner product with the stored vectors (FAISS's IndexRefineFlat does the same but
  would keep a float32 copy of every vector in memory; ours may be a float16 memmap).

``nlist`` is the power of two nearest ``2 sqrt(n)`` (fewer lists than FAISS's 4-16 sqrt(n)
guideline: k-means training dominates the build on a CPU); ``nprobe`` is ``nlist / 64``, at
least 8. On the 1,000,000-pair benchmark (``benchmarks/pseudo_bench.py``) that kept
recall@1 against exact search above 0.95. Every parameter is recorded in ``IndexPlan``
and, through it, in the output's metadata.

BLAS speed matters (k-means training and flat search): OpenBLAS picks slow kernels on
some virtual CPUs unless ``OPENBLAS_CORETYPE`` names the core (e.g. ``SkylakeX``); that
must be set before numpy is imported, so it is the user's environment, not ours.

Vectors are added and queried in chunks of ``chunk`` rows, converted to float32 one chunk
at a time, so the only O(n) memory is the index itself (plus the caller's vectors, which
may be a ``numpy.memmap``). The FAISS calls of a search may run elsewhere (a ``RawSearch``,
e.g. on a Ray actor pool) on the same chunks (``query_chunks``), so with the same results;
re-ranking stays with the caller, who holds the indexed vectors. k-means training uses a seeded sample of at most
``TRAIN_PER_LIST * nlist`` vectors.

GPU: with the ``faiss-gpu`` extra installed (instead of ``faiss-cpu``: the two cannot share
a virtualenv) and ``faiss.get_num_gpus() > 0``, the built index is moved to all GPUs.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from pairclean.errors import InputError

__all__ = [
    "INDEX_KINDS",
    "FLAT_MAX",
    "IVF_MAX",
    "IndexPlan",
    "choose_index",
    "build_index",
    "search",
    "RawSearch",
    "query_chunks",
    "search_shape",
    "local_raw_search",
    "gpu_count",
]

INDEX_KINDS: Final = ("auto", "flat", "ivf", "ivfpq")
#: Largest pool searched exactly when ``kind="auto"``.
FLAT_MAX: Final = 20_000
#: Largest pool put into an IVF-Flat index when ``kind="auto"``; above it IVF-PQ fast-scan.
IVF_MAX: Final = 100_000
#: Training vectors per inverted list (FAISS warns below 39).
TRAIN_PER_LIST: Final = 48
#: Dimensions per 4-bit PQ code (4: 128 codes, 64 bytes per 512-d vector).
PQ_DIM_PER_CODE: Final = 4
#: IVF-PQ candidates re-ranked exactly per query.
REFINE_K: Final = 16
#: Vectors a 4-bit PQ codebook (16 centroids) needs to train: FAISS asks for 39 a centroid,
#: and printed one warning per sub-quantizer below that (about 250 lines on a 71-pair pool).
PQ_MIN_TRAIN: Final = 16 * 39
#: Rows converted to float32 and handed to FAISS at once.
DEFAULT_CHUNK: Final = 65_536


@dataclass(frozen=True)
class IndexPlan:
    """What index to build, with every parameter that decides its results.

    ``kind``: flat | ivf | ivfpq; ``nlist``/``nprobe``: inverted lists and lists probed
    per query (ivf, ivfpq); ``pq_m``/``pq_bits``: PQ sub-quantizers and bits each
    (ivfpq); ``train_size``: vectors k-means trains on; ``seed``: training sample and
    k-means seed; ``device``: cpu or gpu (filled by ``build_index``).
    """

    kind: str
    n: int
    dim: int
    nlist: int | None = None
    nprobe: int | None = None
    pq_m: int | None = None
    pq_bits: int | None = None
    train_size: int | None = None
    refine_k: int | None = None
    seed: int = 0
    device: str = "cpu"

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


def _pow2_near(x: float) -> int:
    return int(2 ** round(math.log2(max(x, 1.0))))


def choose_index(n: int, dim: int, kind: str = "auto", seed: int = 0, nprobe: int | None = None) -> IndexPlan:
    """The index for a pool of ``n`` vectors of ``dim`` dimensions.

    ``kind="auto"`` picks by size (see the module docstring); an explicit kind is honoured
    except that IVF on fewer vectors than one list per ``TRAIN_PER_LIST`` falls back to
    fewer lists (k-means needs data), and IVF-PQ on fewer than ``PQ_MIN_TRAIN`` is built as
    IVF-Flat (exact in its lists; its codebooks could not be trained). Raises ``InputError``
    for an unknown kind or n < 1.
    """
    if kind not in INDEX_KINDS:
        raise InputError(f"unknown index {kind!r}; choose one of {', '.join(INDEX_KINDS)}")
    if n < 1:
        raise InputError("cannot build an index over an empty pool")
    if kind == "auto":
        kind = "flat" if n <= FLAT_MAX else "ivf" if n <= IVF_MAX else "ivfpq"
    if kind == "ivfpq" and n < PQ_MIN_TRAIN:
        kind = "ivf"
    if kind == "flat":
        return IndexPlan("flat", n, dim, seed=seed)
    # Lists: ~2 sqrt(n), but never so many that a list gets fewer than TRAIN_PER_LIST points.
    nlist = max(1, min(_pow2_near(2 * math.sqrt(n)), 65_536, n // TRAIN_PER_LIST or 1))
    probe = nprobe if nprobe is not None else min(nlist, max(8, nlist // 64))
    train = min(n, TRAIN_PER_LIST * nlist)
    plan = IndexPlan(kind, n, dim, nlist=nlist, nprobe=min(probe, nlist), train_size=train, seed=seed)
    if kind == "ivfpq":
        # Re-ranking is cheap on small pools: take more candidates there.
        plan = replace(plan, pq_m=_pq_m(dim), pq_bits=4, refine_k=REFINE_K if n >= IVF_MAX else 4 * REFINE_K)
    return plan


def _pq_m(dim: int) -> int:
    """The largest even divisor of ``dim`` not above ``dim / PQ_DIM_PER_CODE`` (PQ needs
    m | d; fast-scan packs two 4-bit codes a byte), or 1 for odd tiny dims."""
    target = max(1, dim // PQ_DIM_PER_CODE)
    return next((m for m in range(target, 0, -1) if dim % m == 0 and m % 2 == 0), 1)


def gpu_count() -> int:
    """GPUs FAISS can use here (0 with ``faiss-cpu``)."""
    import faiss

    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def _f32(rows: NDArray[Any]) -> NDArray[np.float32]:
    return np.ascontiguousarray(rows, dtype=np.float32)


def _train_sample(vectors: NDArray[Any], size: int, seed: int) -> NDArray[np.float32]:
    if size >= vectors.shape[0]:
        return _f32(vectors[:])
    # Sorted ids: sequential reads when ``vectors`` is a memmap.
    ids = np.sort(np.random.default_rng(seed).choice(vectors.shape[0], size=size, replace=False))
    return _f32(vectors[ids])


def build_index(plan: IndexPlan, vectors: NDArray[Any], chunk: int = DEFAULT_CHUNK, use_gpu: bool | None = None) -> tuple[Any, IndexPlan, dict[str, float]]:
    """Build the index of ``plan`` over (n, dim) ``vectors`` (any float dtype, may be a memmap).

    Returns ``(index, plan with its device, {"train_s", "add_s"})``. Vectors are added in
    chunks of ``chunk`` rows; ids are row numbers. ``use_gpu``: None = when FAISS sees one.
    """
    import faiss

    n, dim = vectors.shape
    if (n, dim) != (plan.n, plan.dim):
        raise ValueError(f"plan is for {plan.n} x {plan.dim}, vectors are {n} x {dim}")
    timings = {"train_s": 0.0, "add_s": 0.0}
    if plan.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    else:
        quantizer = faiss.IndexFlatIP(dim)
        assert plan.nlist is not None
        if plan.kind == "ivf":
            index = faiss.IndexIVFFlat(quantizer, dim, plan.nlist, faiss.METRIC_INNER_PRODUCT)  # type: ignore[assignment]  # faiss's index classes share no typed base
        else:
            assert plan.pq_m is not None and plan.pq_bits == 4
            index = faiss.IndexIVFPQFastScan(quantizer, dim, plan.nlist, plan.pq_m, 4, faiss.METRIC_INNER_PRODUCT)  # type: ignore[assignment]  # faiss's index classes share no typed base
        index.cp.seed = plan.seed  # type: ignore[attr-defined]  # k-means initialisation: the same lists for the same seed
        t0 = time.perf_counter()
        index.train(_train_sample(vectors, plan.train_size or n, plan.seed))
        timings["train_s"] = time.perf_counter() - t0
        index.nprobe = plan.nprobe  # type: ignore[attr-defined]
    gpus = gpu_count() if use_gpu is None else (gpu_count() if use_gpu else 0)
    if gpus > 0:
        index = faiss.index_cpu_to_all_gpus(index)  # type: ignore[assignment]
        plan = replace(plan, device="gpu")
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        index.add(_f32(vectors[start : start + chunk]))
    timings["add_s"] = time.perf_counter() - t0
    return index, plan, timings


#: ``raw(fetch, chunk)``: FAISS's own results ``(start, scores, ids)`` for the query rows
#: ``[start, start + chunk)`` of every chunk of ``query_chunks(m, chunk)``, ``fetch``
#: neighbours each, in any order. ``search`` runs one in this process by default; a Ray
#: actor pool is another (``pairclean_workers.pseudo_exec``). Same chunks, same FAISS
#: inputs: the same results wherever they run.
RawSearch = Callable[[int, int], Iterable[tuple[int, NDArray[np.float32], NDArray[np.int64]]]]


def query_chunks(m: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of ``m`` query rows, ``chunk`` rows each (the last one
    shorter): the one chunking every ``RawSearch`` must follow."""
    return [(start, min(start + chunk, m)) for start in range(0, m, chunk)]


def search_shape(k: int, n: int, dim: int, chunk: int, refine_k: int | None, with_data: bool) -> tuple[int, int, bool]:
    """``(fetch, chunk, refine)`` of a search for ``k`` neighbours among ``n`` vectors:
    neighbours asked of FAISS per query, query rows per FAISS call, whether the candidates
    are re-ranked exactly."""
    refine = with_data and refine_k is not None and refine_k > k
    fetch = min(int(refine_k), n) if refine else k  # type: ignore[arg-type]
    if refine:
        # The gathered candidates are chunk x fetch x dim float32: keep them near 256 MB.
        chunk = max(1, min(chunk, (1 << 26) // max(1, fetch * dim)))
    return fetch, chunk, refine


def local_raw_search(index: Any, queries: NDArray[Any]) -> RawSearch:
    """The ``RawSearch`` of ``index`` over ``queries`` in this process."""

    def raw(fetch: int, chunk: int) -> Iterator[tuple[int, NDArray[np.float32], NDArray[np.int64]]]:
        for start, stop in query_chunks(queries.shape[0], chunk):
            d, i = index.search(_f32(queries[start:stop]), fetch)
            yield start, d, i

    return raw


def search(index: Any, queries: NDArray[Any], k: int, chunk: int = DEFAULT_CHUNK,
           data: NDArray[Any] | None = None, refine_k: int | None = None,
           raw: RawSearch | None = None) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """Top-``k`` neighbours of each row of (m, dim) ``queries``: ``(scores, ids)``, (m, k) each.

    Queried in chunks of ``chunk`` rows (float32 one chunk at a time). With ``data`` (the
    indexed vectors, row = id) and ``refine_k`` > k, ``refine_k`` candidates are fetched and
    re-ranked by exact inner product here (for IVF-PQ). Missing neighbours (fewer than k
    vectors, or empty probed lists) have id -1 and score -inf. ``raw``: where FAISS runs
    (default: ``local_raw_search``); ``queries`` is then read only to re-rank.
    """
    m = queries.shape[0]
    k = max(1, int(k))
    n = data.shape[0] if data is not None else k  # n matters only when re-ranking
    fetch, chunk, refine = search_shape(k, n, queries.shape[1], chunk, refine_k, data is not None)
    scores = np.full((m, k), -np.inf, dtype=np.float32)
    ids = np.full((m, k), -1, dtype=np.int64)
    done = 0
    for start, d, i in (raw or local_raw_search(index, queries))(fetch, chunk):
        stop = start + i.shape[0]
        if refine:
            d, i = _rerank(_f32(queries[start:stop]), i, data, k)
        elif fetch < k:
            d = np.pad(d, ((0, 0), (0, k - fetch)), constant_values=-np.inf)
            i = np.pad(i, ((0, 0), (0, k - fetch)), constant_values=-1)
        scores[start:stop], ids[start:stop] = d, i
        done += stop - start
    if done != m:  # a RawSearch that skipped or repeated chunks: a bug, never silently
        raise RuntimeError(f"search returned {done} query rows of {m}")
    scores[ids < 0] = -np.inf
    return scores, ids


def _rerank(q: NDArray[np.float32], cand: NDArray[np.int64], data: Any, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """Exact inner products of each query with its candidates; the best k, best first."""
    flat = cand.ravel()
    vecs = np.asarray(data[np.clip(flat, 0, None)], dtype=np.float32).reshape(*cand.shape, -1)
    exact = np.einsum("qd,qcd->qc", q, vecs)
    exact[cand < 0] = -np.inf
    order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
    ids = np.take_along_axis(cand, order, axis=1)
    best = np.take_along_axis(exact, order, axis=1).astype(np.float32)
    if ids.shape[1] < k:
        best = np.pad(best, ((0, 0), (0, k - ids.shape[1])), constant_values=-np.inf)
        ids = np.pad(ids, ((0, 0), (0, k - ids.shape[1])), constant_values=-1)
    return best, ids
