"""Pseudo-pairing on planted embeddings: every index finds the displaced captions."""

from __future__ import annotations

import numpy as np
import pytest

from pairclean.pseudo import ann
from pairclean.errors import InputError
from pairclean.pseudo.pairing import PseudoOptions, _drop_self, exact_cosine, nearest_pairs

N, DIM, ORPHANS = 2000, 32, 100


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


@pytest.fixture(scope="module")
def planted() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pool of N mismatched pairs. Image i's own caption sits on pool row ``home[i]``
    (another row, a derangement), except for the last ORPHANS images, whose captions were
    replaced by unrelated ones. Images come from 50 clusters, so IVF has structure to use."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(50, DIM))
    img = centres[rng.integers(0, 50, N)] + 0.7 * rng.normal(size=(N, DIM))
    own_caption = img + 0.15 * rng.normal(size=(N, DIM))
    order = rng.permutation(N)
    home = np.empty(N, dtype=np.int64)
    home[order] = np.roll(order, 1)  # home[i] != i for every i
    text = np.empty((N, DIM))
    text[home] = own_caption
    orphans = np.arange(N - ORPHANS, N)
    text[home[orphans]] = rng.normal(size=(ORPHANS, DIM)) * 3
    return _unit(img), _unit(text), home


def _i2t_top1(result) -> dict[int, int]:
    sel = (result.direction == "i2t") & (result.rank == 0)
    return dict(zip(result.img[sel].tolist(), result.cap[sel].tolist()))


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivfpq"])
def test_every_index_recovers_planted_captions(planted, kind: str) -> None:
    img, text, home = planted
    result = nearest_pairs(img, text, PseudoOptions(index=kind), seed=0)
    top = _i2t_top1(result)
    assert len(top) == N  # one pseudo-caption per pool image
    planted_ids = range(N - ORPHANS)
    found = sum(top[i] == home[i] for i in planted_ids)
    assert found == N - ORPHANS
    assert result.plans["i2t"]["kind"] == kind and result.plans["t2i"]["kind"] == kind
    # Planted pairs are mutual: the caption's nearest image is the image.
    mutual = dict(zip(zip(result.img.tolist(), result.cap.tolist()), result.mutual.tolist()))
    assert all(mutual[(i, int(home[i]))] for i in planted_ids)


def test_flat_and_ivf_agree_on_a_small_pool(planted) -> None:
    img, text, _ = planted
    flat = nearest_pairs(img, text, PseudoOptions(index="flat", neighbours=2))
    # Probing every list, IVF-Flat computes the exact scores of every vector: the same pairs.
    nlist = ann.choose_index(N, DIM, "ivf").nlist
    every = nearest_pairs(img, text, PseudoOptions(index="ivf", nprobe=nlist, neighbours=2))
    assert every.plans["i2t"]["nprobe"] == nlist
    for field in ("img", "cap", "rank", "direction", "mutual"):
        assert np.array_equal(getattr(flat, field), getattr(every, field)), field
    # With its default probes (a fraction of the lists), top-1 still agrees in both directions,
    # orphans (whose nearest caption is any caption) included.
    default = nearest_pairs(img, text, PseudoOptions(index="ivf"))
    assert default.plans["i2t"]["nprobe"] < nlist
    assert np.mean(flat.i2t_top == default.i2t_top) >= 0.99
    assert np.mean(flat.t2i_top == default.t2i_top) >= 0.99


def test_mutual_filter_and_no_duplicates(planted) -> None:
    img, text, home = planted
    full = nearest_pairs(img, text, PseudoOptions())
    mutual = nearest_pairs(img, text, PseudoOptions(mutual_only=True))
    pairs_full = list(zip(full.img.tolist(), full.cap.tolist()))
    assert len(pairs_full) == len(set(pairs_full))  # a mutual pair is written once
    assert mutual.mutual.all() and (mutual.direction == "i2t").all()
    kept = set(zip(mutual.img.tolist(), mutual.cap.tolist()))
    assert kept == {p for p, m in zip(pairs_full, full.mutual.tolist()) if m}
    assert {(i, int(home[i])) for i in range(N - ORPHANS)} <= kept
    # Orphan images mostly find no mutual partner: the filter removes them.
    assert sum(i >= N - ORPHANS for i, _ in kept) < ORPHANS // 2
    assert len(full.img) > len(mutual.img)


def test_ranks_follow_similarity_and_skip_own_caption(planted) -> None:
    img, text, home = planted
    result = nearest_pairs(img, text, PseudoOptions(neighbours=3))
    sel = result.direction == "i2t"
    sims = exact_cosine(img, text, result.img[sel], result.cap[sel])
    by_image: dict[int, list[tuple[int, float, int]]] = {}
    for i, r, s, c in zip(result.img[sel].tolist(), result.rank[sel].tolist(), sims.tolist(), result.cap[sel].tolist()):
        by_image.setdefault(i, []).append((r, s, c))
    assert all(sorted(r for r, _, _ in rows) == [0, 1, 2] for rows in by_image.values())
    for rows in by_image.values():
        ordered = [s for _, s, _ in sorted(rows)]
        assert ordered == sorted(ordered, reverse=True) or np.allclose(ordered, sorted(ordered, reverse=True), atol=1e-3)
    assert all(c != i for i, rows in by_image.items() for _, _, c in rows)  # own caption excluded


def test_deterministic_for_a_seed(planted) -> None:
    import faiss

    img, text, _ = planted
    a = nearest_pairs(img, text, PseudoOptions(index="ivf", neighbours=2), seed=3)
    b = nearest_pairs(img, text, PseudoOptions(index="ivf", neighbours=2), seed=3)
    for field in ("img", "cap", "rank", "direction", "mutual"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    for kind in ("ivf", "ivfpq"):
        # The trained index itself, byte for byte; another seed trains another one.
        plan = ann.choose_index(N, DIM, kind, seed=3)
        same = [faiss.serialize_index(ann.build_index(plan, text)[0]).tobytes() for _ in range(2)]
        other = faiss.serialize_index(ann.build_index(ann.choose_index(N, DIM, kind, seed=4), text)[0]).tobytes()
        assert same[0] == same[1] and other != same[0], kind


def test_drop_self() -> None:
    ids = np.array([[0, 5, 6], [4, 1, 7], [2, -1, 3]])
    assert _drop_self(ids, 2).tolist() == [[5, 6], [4, 7], [3, -1]]


def test_index_choice_by_size() -> None:
    assert ann.choose_index(1000, 512).kind == "flat"
    ivf = ann.choose_index(50_000, 512)
    assert (ivf.kind, ivf.nlist, ivf.nprobe) == ("ivf", 512, 8)
    pq = ann.choose_index(1_000_000, 512)
    assert (pq.kind, pq.nlist, pq.nprobe, pq.pq_m, pq.pq_bits, pq.refine_k) == ("ivfpq", 2048, 32, 128, 4, 16)
    assert ann.choose_index(100, 512, "ivf").nlist == 2  # never more lists than the data allows
    assert ann.choose_index(71, 512, "ivfpq").kind == "ivf"  # PQ codebooks cannot train on 71 (FAISS warned 250 times)
    assert ann.choose_index(ann.PQ_MIN_TRAIN, 512, "ivfpq").kind == "ivfpq"
    with pytest.raises(InputError, match="unknown index"):
        ann.choose_index(10, 8, "hnsw")
    with pytest.raises(InputError, match="empty pool"):
        ann.choose_index(0, 8)


def test_chunked_search_equals_one_shot(planted) -> None:
    img, text, _ = planted
    plan = ann.choose_index(N, DIM, "flat")
    index, _, _ = ann.build_index(plan, text, chunk=333)
    d1, i1 = ann.search(index, img, 2, chunk=257)
    d2, i2 = ann.search(index, img, 2, chunk=N)
    assert np.array_equal(i1, i2) and np.allclose(d1, d2)


def test_search_takes_its_chunks_from_anywhere_in_any_order(planted) -> None:
    """The contract a remote executor (a Ray pool) relies on: FAISS results of the chunks
    ``search`` asks for, in any order, give the local answer; a missing chunk is an error."""
    img, text, _ = planted
    plan = ann.choose_index(N, DIM, "ivfpq")
    index, plan, _ = ann.build_index(plan, text)
    want = ann.search(index, img, 3, chunk=300, data=text, refine_k=plan.refine_k)
    local = ann.local_raw_search(index, img)
    asked = []

    def reversed_chunks(fetch: int, chunk: int) -> list:
        asked.append((fetch, chunk))
        return list(local(fetch, chunk))[::-1]

    got = ann.search(index, img, 3, chunk=300, data=text, refine_k=plan.refine_k, raw=reversed_chunks)
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0])
    assert asked == [(plan.refine_k, 300)]  # candidates for re-ranking, in the caller's chunks
    assert ann.query_chunks(N, 300)[-1] == (1800, 2000) and len(ann.query_chunks(N, 300)) == 7
    with pytest.raises(RuntimeError, match="query rows"):
        ann.search(index, img, 3, chunk=300, raw=lambda fetch, chunk: list(local(fetch, chunk))[1:])


def test_pool_segments_map_rows_to_sidecars() -> None:
    from pairclean.pseudo.pairing import Pool

    shard_of = np.array([0, 0, 1, 1, 1, 3], dtype=np.int32)
    side_rows = np.array([2, 5, 0, 1, 7, 4], dtype=np.int64)
    empty = np.empty((6, 2), dtype=np.float16)
    pool = Pool(["a", "b", "c", "d"], ["a.tar", "b.tar", "c.tar", "d.tar"], shard_of, list("uvwxyz"), empty, empty,
                sidecars=["_emb/a.parquet", "_emb/b.parquet", "_emb/c.parquet", "_emb/d.parquet"], side_rows=side_rows)
    got = [(name, rows.tolist()) for name, rows in pool.segments(1, 6)]
    assert got == [("_emb/a.parquet", [5]), ("_emb/b.parquet", [0, 1, 7]), ("_emb/d.parquet", [4])]
    assert [(n, r.tolist()) for n, r in pool.segments(2, 4)] == [("_emb/b.parquet", [0, 1])]
