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
from pairclean.output.folder import OutputDir
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "8", "--executor", "local"]
COLUMNS = ["image_shard", "image_key", "caption_shard", "caption_key", "caption", "similarity", "weight", "mutual", "rank", "direction"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, dev_images: list) -> tuple[Path, list[Path], dict[str, str]]:
    """A scored job over two shards of 12 real pairs, half of them shuffled; returns
    (OUT, shards, caption by key)."""
    from pairclean.lite.evaldata import noisy_pairing, write_shard

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


def _pseudo(out: Path) -> Path:
    """Where the pseudo-pairs of the job in ``out`` lie (``OUT.pairclean/pseudo/``)."""
    return Path(schema.local_side_path(out, "_pseudo"))


def _read_all(out: Path) -> dict[str, object]:
    return {p.name: pq.read_table(p) for p in sorted(_pseudo(out).glob("*.parquet"))}


def test_pseudo_pair_writes_scored_pairs_beside_an_unchanged_dataset(job, capsys) -> None:
    import pyarrow.dataset as ds

    from pairclean.pseudo.pairing import weigh
    from pairclean.output.tables import read_embeddings

    out, shards, captions = job
    names_before = ds.dataset(str(out)).schema.names
    assert main(["pseudo-pair", str(out), "--pool", "all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pool_size"] == 24 and report["pairs"] >= 24
    assert report["files"] and all(Path(f).is_file() for f in report["files"])  # where they are, not store names
    assert ds.dataset(str(out)).schema.names == names_before  # OUT still reads as the score tables
    assert not schema.local_side_path(out, schema.LOCK_FILE).exists()  # lock released
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
    # Weighted on the scale the calibration was fitted on: the job's corpus contrast is on
    # (the default), so the cosine is adjusted by it first, as a scored pair's is.
    contrast = folder.read_contrast(cal)
    assert contrast is not None
    pair_img = np.stack([emb[r["image_key"]][0] for r in rows])
    pair_txt = np.stack([emb[r["caption_key"]][1] for r in rows])
    adjusted = contrast.adjust(sims, pair_img, pair_txt)
    assert not np.allclose(adjusted, sims, atol=1e-3)
    assert np.allclose(weigh(adjusted, cal), [r["weight"] for r in rows], atol=1e-4)
    meta = json.loads(next(iter(tables.values())).schema.metadata[schema.META_KEY])
    assert meta["weighted_on"].startswith("adjusted_similarity")
    assert meta["pool"] == "all" and meta["index"]["i2t"]["kind"] == "flat" and meta["calibration"]["beta"] == cal.beta
    assert meta["seed"] == 0 and meta["job"] == folder.read_job_doc()["spec_sha256"]


def test_deterministic_and_mutual_filter(job) -> None:
    out, _, _ = job
    assert main(["pseudo-pair", str(out), "--pool", "all", "--index", "ivf"]) == 0
    first = {n: (_pseudo(out) / n).read_bytes() for n in sorted(p.name for p in _pseudo(out).iterdir())}
    assert main(["pseudo-pair", str(out), "--pool", "all", "--index", "ivf"]) == 0
    assert {n: (_pseudo(out) / n).read_bytes() for n in first} == first
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
    from pairclean.pseudo.pairing import PseudoCaptions
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


def test_a_rescore_makes_trainers_refuse_the_earlier_pseudo_pairs_until_they_are_made_again(job, tmp_path: Path, caplog) -> None:
    import shutil

    from pairclean.output.folder import OutputDir
    from pairclean.pseudo.pairing import PseudoCaptions

    out = tmp_path / "out"
    shutil.copytree(job[0], out)
    shutil.copytree(f"{job[0]}{schema.SIDE_SUFFIX}", f"{out}{schema.SIDE_SUFFIX}")
    assert main(["pseudo-pair", str(out), "--pool", "noisy"]) == 0
    PseudoCaptions(out)
    # a rescore with the job's own recipe leaves every table as it was: the pseudo-pairs stay current
    tables = {p.name: p.read_bytes() for p in out.glob("*.parquet")}
    spec = OutputDir(str(out)).read_spec()
    assert spec is not None
    assert main(["rescore", str(out), "--beta-recipe", spec.beta_recipe, "--weighting", spec.weighting]) == 0
    assert {p.name: p.read_bytes() for p in out.glob("*.parquet")} == tables
    assert "made from the earlier weights" not in caplog.text
    PseudoCaptions(out)
    assert main(["rescore", str(out), "--beta-recipe", "gmm", "--weighting", "paper"]) == 0
    assert "pseudo-pairs" in caplog.text and "made from the earlier weights" in caplog.text
    with pytest.raises(FileNotFoundError, match="made from weights the job has replaced since"):
        PseudoCaptions(out)
    assert main(["pseudo-pair", str(out), "--pool", "noisy"]) == 0
    PseudoCaptions(out)  # made from today's tables


def test_a_shard_committed_later_or_overwrite_leaves_no_pseudo_pairs_that_look_current(job, tmp_path: Path, caplog) -> None:
    import shutil

    from pairclean.pseudo.pairing import PseudoCaptions

    _, shards, _ = job
    # a job whose second shard is cut short: quarantined, then repaired and committed by a rerun
    broken = tmp_path / "shards"
    broken.mkdir()
    good = [broken / s.name for s in shards]
    shutil.copy(shards[0], good[0])
    good[1].write_bytes(shards[1].read_bytes()[:3000])
    out = tmp_path / "out"
    command = ["score", *map(str, good), "--out", str(out), *TINY, "--calibration-pairs", "12"]
    assert main(command) != 0
    assert main(["pseudo-pair", str(out), "--pool", "all"]) == 0 and main(["export", str(out)]) == 0
    PseudoCaptions(out)
    shutil.copy(shards[1], good[1])
    caplog.clear()
    assert main(command) == 0
    # the pseudo-pairs say they are stale; the exports were written again with the shard counted
    assert "made from the earlier weights" in caplog.text and "hold the earlier weights" not in caplog.text
    sizes = json.loads((Path(f"{out}{schema.SIDE_SUFFIX}") / "export" / "sizes.json").read_text())
    assert sizes == {s.name: 12 for s in shards}
    with pytest.raises(FileNotFoundError, match="made from weights the job has replaced since"):
        PseudoCaptions(out)
    # --overwrite starts over: no pseudo-pairs of the old job stay to be read
    assert any(_pseudo(out).glob("*.parquet"))
    (_pseudo(out) / "mine.txt").write_text("a file pairclean did not write")
    assert main([*command, "--overwrite"]) == 0
    assert sorted(p.name for p in _pseudo(out).iterdir()) == ["mine.txt"]
    with pytest.raises(FileNotFoundError):
        PseudoCaptions(out)


def test_files_of_someone_else_in_the_pseudo_folder_are_neither_replaced_nor_deleted(job, tmp_path: Path, capsys) -> None:
    """A foreign ``_run.json`` was deleted unchecked, and a foreign table at a shard's name
    stopped the run after it had written the tables before it; ``--overwrite`` deleted the
    record files whoever wrote them."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(job[0], out)
    shutil.copytree(f"{job[0]}{schema.SIDE_SUFFIX}", f"{out}{schema.SIDE_SUFFIX}")
    folder = _pseudo(out)
    shutil.rmtree(folder, ignore_errors=True)  # the module's job may hold an earlier test's run
    folder.mkdir(parents=True)
    for name, data in (("_run.json", b"my notes"), ("part-00001.parquet", b"not pairclean's")):
        (folder / name).write_bytes(data)
        capsys.readouterr()
        assert main(["pseudo-pair", str(out), "--pool", "all"]) == 1
        err = capsys.readouterr().err
        assert f"{name} was not written by pairclean" in err and "Traceback" not in err
        assert sorted(p.name for p in folder.iterdir()) == [name] and (folder / name).read_bytes() == data
        (folder / name).unlink()
    assert main(["pseudo-pair", str(out), "--pool", "all"]) == 0  # nothing in the way: written
    (folder / "_stale.json").write_text('["mine"]')
    command = ["score", *map(str, job[1]), "--out", str(out), *TINY, "--overwrite"]
    assert main(command) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["_stale.json"]  # ours gone, theirs kept


def test_clear_errors(job, tmp_path: Path, dev_images: list, capsys) -> None:
    from pairclean.lite.evaldata import write_shard

    # not a job
    (tmp_path / "plain").mkdir()
    assert main(["pseudo-pair", str(tmp_path / "plain")]) == 1
    err = capsys.readouterr().err.strip()
    assert "not a pairclean output folder" in err and "\n" not in err
    assert not (tmp_path / "plain" / "_pairclean").exists() and not (tmp_path / "plain.pairclean").exists()  # no lock written
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


# -- crash safety, executors, object stores ---------------------------------------------------
def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file under OUT/_pseudo (record included), by name."""
    return {p.name: p.read_bytes() for p in sorted(_pseudo(out).iterdir())}


#: Runs the CLI and SIGKILLs itself (a real kill -9: no cleanup, no finally) inside the
#: rename of the Nth file written into _pseudo/, after its temporary is complete.
_KILL_ON_NTH_WRITE = """
import os, signal, sys
nth, seen, replace = int(sys.argv[1]), [0], os.replace
def killing_replace(src, dst, *a, **kw):
    fd = kw.get("dst_dir_fd")  # writes rename within the folder they opened
    where = os.path.join(os.readlink(f"/proc/self/fd/{fd}"), str(dst)) if fd is not None else str(dst)
    if "/pseudo/" in where and where.endswith(".parquet"):
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst, *a, **kw)
os.replace = killing_replace
from pairclean_workers.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_resume_after_kill_9_writes_what_an_uncrashed_run_writes(job, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from pairclean.pseudo.pairing import RECORD, PseudoCaptions

    out, _, _ = job
    args = ["pseudo-pair", str(out), "--pool", "all", "--index", "ivf", "--neighbours", "2", "--executor", "local"]
    assert main(args) == 0
    uncrashed = _snapshot(out)
    assert "_run.json" in uncrashed and len(uncrashed) == 3
    record = json.loads(uncrashed["_run.json"])
    assert record["files"] == {f"_pseudo/{n}": __import__("hashlib").sha256(b).hexdigest() for n, b in uncrashed.items() if n != "_run.json"}
    # An older, different, complete run: the crash below leaves a mix of its files and new ones.
    assert main(["pseudo-pair", str(out), "--pool", "all", "--mutual", "--executor", "local"]) == 0
    older = _snapshot(out)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    crashed = subprocess.run([sys.executable, "-c", _KILL_ON_NTH_WRITE, "2", *args], env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    after = {p.name for p in _pseudo(out).iterdir()}
    temporaries = [n for n in after if ".tmp-" in n]
    assert len(temporaries) == 1 and "_run.json" not in after  # killed mid-write: no record
    assert _snapshot(out)["part-00000.parquet"] == uncrashed["part-00000.parquet"]  # the first file is new,
    assert _snapshot(out)["part-00001.parquet"] == older["part-00001.parquet"]  # the second still the older run's
    with pytest.raises(FileNotFoundError, match="incomplete"):
        PseudoCaptions(out)  # trainers refuse the mix
    assert list(scratch.iterdir()) == []  # the pool's scratch files died with the process
    assert schema.local_side_path(out, schema.LOCK_FILE).exists()  # the dead run's lock: taken over below (same host, pid gone)
    rerun = subprocess.run([sys.executable, "-m", "pairclean_workers.cli", *args], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _snapshot(out) == uncrashed  # byte for byte, temporaries gone, record back
    assert not schema.local_side_path(out, schema.LOCK_FILE).exists() and list(scratch.iterdir()) == []
    assert schema.local_side_path(out, RECORD).exists() and PseudoCaptions(out).get(str(job[1][0]), "s0/000") is not None


def test_query_searcher_reads_its_rows_from_the_sidecars(job, tmp_path: Path) -> None:
    """The Ray actor's logic without Ray: query rows read from the sidecars by
    ``Pool.segments`` search exactly like the driver's copy of them."""
    import faiss

    from pairclean.pseudo import ann
    from pairclean.pseudo.pairing import load_pool
    from pairclean_workers.pseudo_exec import QuerySearcher

    out, _, _ = job
    folder = OutputDir(str(out))
    pool = load_pool(folder, "all", tmp_path)
    assert len(pool.segments(0, pool.size)) == 2  # both shards
    for modality, data, queries in (("image", pool.text, pool.image), ("text", pool.image, pool.text)):
        index, _, _ = ann.build_index(ann.choose_index(pool.size, data.shape[1], "flat"), data)
        actor = QuerySearcher(folder, threads=1)
        actor.load("i", faiss.serialize_index(index))
        for start, stop in ann.query_chunks(pool.size, 7):  # chunks across the shard boundary
            d, i = actor.search("i", [None], pool.segments(start, stop), modality, 3, None)
            d0, i0 = index.search(np.ascontiguousarray(queries[start:stop], dtype=np.float32), 3)
            assert np.array_equal(i, i0) and np.array_equal(d, d0), (modality, start)
    assert list(tmp_path.iterdir()) == []  # the pool's scratch files are unlinked once mapped


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for this module's Ray tests (2 CPUs), shut down after them unless it
    was already up."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.ray
def test_ray_executor_writes_what_the_local_one_writes(job, ray_session, capsys) -> None:
    out, _, _ = job
    for index in ("flat", "ivfpq"):  # ivfpq: candidates from the actors, re-ranked by the driver
        common = ["pseudo-pair", str(out), "--pool", "all", "--index", index, "--neighbours", "2", "--chunk", "5", "--json"]
        assert main([*common, "--executor", "local"]) == 0
        assert json.loads(capsys.readouterr().out)["executor"] == "local"
        local = _snapshot(out)
        # 24 queries in chunks of 5: 5 tasks a direction over 2 actors, chunks spanning both shards
        assert main([*common, "--executor", "ray", "--ray-min-pool", "0", "--num-actors", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["executor"] == "ray"
        assert _snapshot(out) == local, index
    # Below --ray-min-pool the queries stay in this process.
    assert main(["pseudo-pair", str(out), "--pool", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["executor"] == "local"


@pytest.mark.ray
@pytest.mark.slow
def test_a_pool_in_the_loopback_s3_store(job, ray_session, s3_endpoint: str, tmp_path: Path) -> None:
    """Shards, sidecars and output on S3: captions read from the S3 shards, the Ray actors
    read their query rows from the S3 sidecars; both executors write the same objects, and
    the pairs are those of the same job scored into a local folder."""
    import hashlib

    import s3fs

    out, shards, captions = job
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing")
    # buckets of its own: the loopback server is shared by the whole session
    fs.mkdir("pseudo-shards")
    fs.mkdir("pseudo-weights")
    for i, path in enumerate(shards):
        fs.put(str(path), f"pseudo-shards/part-{i:05d}.tar")
    # Credentials as storage options, not only the environment: Ray workers get them with the OutputDir.
    storage = ["--storage-option", f"endpoint_url={s3_endpoint}", "--storage-option", "key=testing", "--storage-option", "secret=testing"]
    s3_shards = [f"s3://pseudo-shards/part-{i:05d}.tar" for i in range(len(shards))]
    assert main(["score", *s3_shards, "--out", "s3://pseudo-weights/job", *TINY, *storage]) == 0
    common = ["pseudo-pair", "s3://pseudo-weights/job", "--pool", "all", "--neighbours", "2", "--chunk", "7", *storage]

    def objects() -> dict[str, bytes]:
        return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in sorted(fs.find("pseudo-weights/job.pairclean/pseudo"))}

    assert main([*common, "--executor", "local"]) == 0
    on_s3 = objects()
    assert sorted(on_s3) == ["_run.json", "part-00000.parquet", "part-00001.parquet"]
    record = json.loads(on_s3["_run.json"])
    assert record["files"] == {f"_pseudo/{n}": hashlib.sha256(b).hexdigest() for n, b in on_s3.items() if n != "_run.json"}
    assert not fs.exists("pseudo-weights/job.pairclean/state/lock.json")
    assert main([*common, "--executor", "ray", "--ray-min-pool", "0", "--num-actors", "2"]) == 0
    assert objects() == on_s3
    # The same pairs as the local folder's job (the same shards, scored the same way).
    assert main(["pseudo-pair", str(out), "--pool", "all", "--neighbours", "2", "--executor", "local"]) == 0
    import io

    def rows(tables: dict[str, bytes]) -> list[tuple]:
        got = []
        for name in sorted(n for n in tables if n.endswith(".parquet")):
            for r in pq.read_table(io.BytesIO(tables[name])).to_pylist():
                got.append((r["image_key"], r["caption_key"], r["caption"], round(r["similarity"], 5), r["direction"], r["rank"]))
        return got

    s3_rows = rows(on_s3)
    assert s3_rows == rows(_snapshot(out)) and len(s3_rows) >= 24
    assert all(caption == captions[key] for _, key, caption, *_ in s3_rows)  # text read from the S3 shards
    first = pq.read_table(io.BytesIO(on_s3["part-00000.parquet"])).to_pylist()
    assert {r["image_shard"] for r in first} == {s3_shards[0]}


def test_damaged_pseudo_tables_are_one_line_and_the_cache_stays_with_the_parent(job, tmp_path: Path) -> None:
    """Pseudo-pair tables got none of the score tables' checks: NaN or 7.5 weights reached the
    loss, a file that is not Parquet gave pyarrow's own traceback, a FIFO hung the reader;
    and each pickled copy (a DataLoader worker) carried the parent's cache."""
    import os
    import shutil
    import threading

    import pyarrow as pa

    from pairclean.errors import InputError
    from pairclean.pseudo.pairing import PseudoCaptions

    out = tmp_path / "out"
    shutil.copytree(job[0], out)
    shutil.copytree(f"{job[0]}{schema.SIDE_SUFFIX}", f"{out}{schema.SIDE_SUFFIX}")
    assert main(["pseudo-pair", str(out), "--pool", "all"]) == 0
    tables = sorted(_pseudo(out).glob("*.parquet"))
    assert tables, "the fixture made no pseudo-pairs"
    path, stem = tables[0], tables[0].stem
    good = pq.read_table(path)
    url = f"/x/{stem}.tar"
    loaded = PseudoCaptions(out)
    loaded.get(url, "any")
    assert loaded._cache and pickle.loads(pickle.dumps(loaded))._cache == {}
    for weight in (float("nan"), 7.5):
        pq.write_table(good.set_column(good.schema.get_field_index("weight"), "weight",
                                       pa.array([weight] * good.num_rows, pa.float32())), path)
        with pytest.raises(InputError, match=str(path)):
            PseudoCaptions(out).get(url, "any")
    path.write_bytes(b"not parquet")
    with pytest.raises(InputError, match="is not a readable pseudo-pair table") as err:
        PseudoCaptions(out).get(url, "any")
    assert "\n" not in str(err.value)
    path.unlink()
    os.mkfifo(path)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            PseudoCaptions(out).get(url, "any")
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            caught.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive() and len(caught) == 1 and "not a regular file" in str(caught[0])
