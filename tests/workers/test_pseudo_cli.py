"""``pairclean pseudo-pair`` on a real scored job (tiny model, real Flickr8k photos), and the
sampler's ``pseudo`` mode on its output."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pairclean import schema
from pairclean.job import OutputDir
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "8", "--executor", "local"]
COLUMNS = ["image_shard", "image_key", "caption_shard", "caption_key", "caption", "similarity", "weight", "mutual", "rank", "direction"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, dev_images: list) -> tuple[Path, list[Path], dict[str, str]]:
    """A scored job over two shards of 12 real pairs, half of them shuffled; returns
    (OUT, shards, caption by key)."""
    from pairclean.evaldata import noisy_pairing, write_shard

    root = tmp_path_factory.mktemp("pseudo")
    pairs = noisy_pairing(dev_images[:24], 0.5, seed=0)
    shards, captions = [], {}
    for s in range(2):
        samples = []
        for i in range(s * 12, (s + 1) * 12):
            key = f"s{s}/{i:03d}"
            captions[key] = pairs.captions[i]
            samples.append({"__key__": key, "jpg": pairs.images[i].path.read_bytes(), "txt": pairs.captions[i]})
        shards.append(write_shard(root / "shards" / f"part-{s:05d}.tar", samples))
    out = root / "out"
    assert main(["score", *map(str, shards), "--out", str(out), *TINY]) == 0
    return out, shards, captions


def _read_all(out: Path) -> dict[str, object]:
    return {p.name: pq.read_table(p) for p in sorted((out / "_pseudo").glob("*.parquet"))}


def test_pseudo_pair_writes_scored_pairs_beside_an_unchanged_dataset(job, capsys) -> None:
    import pyarrow.dataset as ds

    from pairclean.pseudo import weigh
    from pairclean.rescore import read_embeddings

    out, shards, captions = job
    names_before = ds.dataset(str(out)).schema.names
    assert main(["pseudo-pair", str(out), "--pool", "all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pool_size"] == 24 and report["pairs"] >= 24
    assert ds.dataset(str(out)).schema.names == names_before  # OUT still reads as the score tables
    assert not (out / schema.LOCK_FILE).exists()  # lock released
    tables = _read_all(out)
    assert sorted(tables) == ["part-00000.parquet", "part-00001.parquet"]
    rows = [r for t in tables.values() for r in t.to_pylist()]
    assert list(next(iter(tables.values())).column_names) == COLUMNS
    # One nearest caption per image, never its own; captions are the shards' own text.
    i2t = [r for r in rows if r["direction"] == "i2t"]
    assert sorted(r["image_key"] for r in i2t) == sorted(captions)
    assert all(r["caption_key"] != r["image_key"] and r["caption"] == captions[r["caption_key"]] for r in rows)
    assert all(r["rank"] == 0 for r in rows)
    # Similarity: exact cosine of the stored embeddings; weight: the job's own calibration.
    folder = OutputDir(str(out))
    emb = {}
    for record in folder.iter_committed():
        img, txt = read_embeddings(folder.read_embeddings_table(record))
        keys = folder.read_embeddings_table(record).column("key").to_pylist()
        emb.update({k: (img[i], txt[i]) for i, k in enumerate(keys)})
    sims = np.array([float(emb[r["image_key"]][0] @ emb[r["caption_key"]][1]) for r in rows], dtype=np.float32)
    assert np.allclose(sims, [r["similarity"] for r in rows], atol=1e-4)
    cal = folder.read_calibration()
    assert np.allclose(weigh(sims, cal), [r["weight"] for r in rows], atol=1e-4)
    meta = json.loads(next(iter(tables.values())).schema.metadata[schema.META_KEY])
    assert meta["pool"] == "all" and meta["index"]["i2t"]["kind"] == "flat" and meta["calibration"]["beta"] == cal.beta
    assert meta["seed"] == 0 and meta["job"] == folder.read_job_doc()["spec_sha256"]


def test_deterministic_and_mutual_filter(job) -> None:
    out, _, _ = job
    assert main(["pseudo-pair", str(out), "--pool", "all", "--index", "ivf"]) == 0
    first = {n: (out / "_pseudo" / n).read_bytes() for n in sorted(p.name for p in (out / "_pseudo").iterdir())}
    assert main(["pseudo-pair", str(out), "--pool", "all", "--index", "ivf"]) == 0
    assert {n: (out / "_pseudo" / n).read_bytes() for n in first} == first
    assert main(["pseudo-pair", str(out), "--pool", "all", "--mutual"]) == 0
    rows = [r for t in _read_all(out).values() for r in t.to_pylist()]
    assert rows and all(r["mutual"] and r["direction"] == "i2t" for r in rows)


def test_noisy_pool_and_min_weight(job) -> None:
    out, _, _ = job
    noisy = {r["key"] for p in out.glob("part-*.parquet") for r in pq.read_table(p).to_pylist() if r["noisy"] and r["status"] == "ok"}
    if len(noisy) < 2:
        pytest.skip("the tiny model flagged fewer than 2 pairs noisy")
    assert main(["pseudo-pair", str(out), "--min-weight", "0.01"]) == 0
    rows = [r for t in _read_all(out).values() for r in t.to_pylist()]
    assert all(r["image_key"] in noisy and r["caption_key"] in noisy for r in rows)
    assert all(r["weight"] >= 0.01 for r in rows)


def test_sampler_substitutes_pseudo_captions(job) -> None:
    from pairclean.pseudo import PseudoCaptions
    from pairclean.sampler import weight_stage

    out, shards, captions = job
    assert main(["pseudo-pair", str(out), "--pool", "noisy"]) == 0
    pseudo = pickle.loads(pickle.dumps(PseudoCaptions(out)))  # DataLoader workers pickle it
    flags = {r["key"]: r["noisy"] for p in out.glob("part-*.parquet") for r in pq.read_table(p).to_pylist()}
    samples = [{"__key__": k, "__url__": str(shards[int(k[1])]), "txt": captions[k].encode()} for k in captions]
    got = list(weight_stage(out, "pseudo", pseudo=pseudo)([dict(s) for s in samples]))
    assert len(got) == len(samples)
    substituted = 0
    for before, after in zip(samples, got):
        found = pseudo.get(before["__url__"], before["__key__"])
        if flags[before["__key__"]] and found is not None:
            assert after["pseudo"] and after["txt"] == found[0].encode() and after["weight"] == pytest.approx(found[1])
            substituted += 1
        else:
            assert not after["pseudo"] and after["txt"] == before["txt"]
    assert substituted == sum(1 for k in captions if flags[k] and pseudo.get(str(shards[int(k[1])]), k))


def test_clear_errors(job, tmp_path: Path, dev_images: list, capsys) -> None:
    from pairclean.evaldata import write_shard

    # not a job
    (tmp_path / "plain").mkdir()
    assert main(["pseudo-pair", str(tmp_path / "plain")]) == 1
    err = capsys.readouterr().err.strip()
    assert "not a pairclean output folder" in err and "\n" not in err
    assert not (tmp_path / "plain" / "_pairclean").exists()  # no lock written into it
    # a job scored without sidecars
    shard = write_shard(tmp_path / "a-00000.tar", [{"__key__": f"k{i}", "jpg": dev_images[i].path.read_bytes(), "txt": dev_images[i].captions[0]} for i in range(4)])
    assert main(["score", str(shard), "--out", str(tmp_path / "noemb"), "--no-embeddings", *TINY]) == 0
    assert main(["pseudo-pair", str(tmp_path / "noemb")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no embedding sidecars" in err and "\n" not in err
    # an empty pool: every caption empty, so no ok pair
    shard = write_shard(tmp_path / "b-00000.tar", [{"__key__": f"k{i}", "jpg": dev_images[i].path.read_bytes(), "txt": " "} for i in range(3)])
    assert main(["score", str(shard), "--out", str(tmp_path / "empty"), *TINY]) == 0
    assert main(["pseudo-pair", str(tmp_path / "empty"), "--pool", "all"]) == 1
    err = capsys.readouterr().err.strip()
    assert "pool" in err and "empty" in err and "\n" not in err
