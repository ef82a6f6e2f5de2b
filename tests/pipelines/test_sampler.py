"""The trainer-facing pieces: weight stage, weighted sampler, losses, exports."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pairclean import schema
from pairclean.sampler import WeightedSampler, WeightStage, weight_stage


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory, dev_images: list) -> tuple[Path, list[Path]]:
    """A real job output over two shards (tiny model), with 32-hex uids."""
    from pairclean.lite.evaldata import write_shard
    from pairclean_workers.cli import main

    root = tmp_path_factory.mktemp("scored")
    shards = []
    for s in range(2):
        samples = [
            {"__key__": f"k{s}-{i:03d}", "jpg": dev_images[s * 10 + i].path.read_bytes(), "txt": dev_images[s * 10 + i].captions[0],
             "json": {"uid": f"{s * 10 + i:032x}"}}
            for i in range(10)
        ]
        shards.append(write_shard(root / "shards" / f"sh-{s:05d}.tar", samples))
    out = root / "out"
    assert main(["score", *map(str, shards), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    return out, shards


def _samples(shards: list[Path]) -> list[dict]:
    return [{"__key__": f"k{s}-{i:03d}", "__url__": str(path)} for s, path in enumerate(shards) for i in range(10)]


def test_stage_modes_join_by_key(scored) -> None:
    import pyarrow.parquet as pq

    out, shards = scored
    table = {r["key"]: r for p in out.glob("sh-*[0-9].parquet") for r in pq.read_table(p).to_pylist()}
    with_w = list(weight_stage(out, "loss")(_samples(shards)))
    assert [s["weight"] for s in with_w] == pytest.approx([table[s["__key__"]]["weight"] for s in with_w])
    kept = [s["__key__"] for s in weight_stage(out, "keep")(_samples(shards))]
    assert kept == [k for k in sorted(table) if not table[k]["noisy"]]
    sampled1 = [s["__key__"] for s in weight_stage(out, "sample", w_cap=0.05, seed=1)(_samples(shards))]
    sampled2 = [s["__key__"] for s in weight_stage(out, "sample", w_cap=0.05, seed=1)(reversed(_samples(shards)))]
    assert sorted(sampled1) == sorted(sampled2)  # order-independent, seeded
    assert all(table[k]["weight"] > 0 for k in sampled1)


def test_sample_mode_draws_again_each_epoch_and_set_epoch_reproduces_one(scored) -> None:
    """A pair of weight 0.3 is seen in about 30% of the epochs, not in all of them or none
    (each epoch used to keep the same pairs: a fixed random filter, not a weighting)."""
    import pyarrow.parquet as pq

    out, shards = scored
    table = {r["key"]: r for p in out.glob("sh-*[0-9].parquet") for r in pq.read_table(p).to_pylist()}
    samples = _samples(shards)
    w_cap = 2 * float(np.median([r["weight"] for r in table.values()]))
    stage = WeightStage(out, "sample", w_cap=w_cap, seed=4)
    epochs = [{s["__key__"] for s in stage(samples)} for _ in range(60)]  # one pass per epoch
    assert len({frozenset(e) for e in epochs}) > 1
    seen = np.array([np.mean([k in e for e in epochs]) for k in sorted(table)])
    expected = np.array([min(1.0, table[k]["weight"] / w_cap) for k in sorted(table)])
    assert np.abs(seen - expected).mean() < 0.1
    # epoch 0 keeps what releases before epochs kept; set_epoch(e) gives the e-th pass again
    assert epochs[0] == {s["__key__"] for s in weight_stage(out, "sample", w_cap=w_cap, seed=4)(samples)}
    fresh = WeightStage(out, "sample", w_cap=w_cap, seed=4)
    fresh.set_epoch(7)
    assert {s["__key__"] for s in fresh(samples)} == epochs[7]


def test_stage_missing_policies(scored) -> None:
    out, shards = scored
    extra = [{"__key__": "nope", "__url__": str(shards[0])}]
    with pytest.raises(KeyError, match="nope"):
        list(weight_stage(out, "loss")(extra))
    assert list(weight_stage(out, "loss", missing="skip")(extra)) == []
    assert list(weight_stage(out, "loss", missing="default", default=0.5)(extra))[0]["weight"] == 0.5


def test_a_key_its_table_lacks_is_said_once_per_shard_under_default_and_skip(scored, caplog) -> None:
    """A shard that gained samples since it was scored (or a table that lost rows) trained
    the new pairs at the default weight without a word."""
    import logging

    out, shards = scored
    extra = [{"__key__": f"new-{i}", "__url__": str(shards[0])} for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="pairclean.sampler"):
        assert [s["weight"] for s in weight_stage(out, "loss", missing="default", default=1.0)(extra)] == [1.0] * 3
    said = [m for m in caplog.messages if "has no row in" in m]
    assert len(said) == 1 and "'new-0'" in said[0] and "missing='default'" in said[0] and "changed since it was scored" in said[0]


def test_a_key_that_is_not_utf8_finds_the_row_score_wrote_for_it(tmp_path: Path, dev_images: list) -> None:
    """webdataset hands such a key over with lone surrogates ('caf\\udce9'); the table holds it
    escaped ('caf\\\\xe9'): the pair matched no row (weight 1 under missing='default')."""
    import pyarrow.parquet as pq

    from pairclean.lite.evaldata import write_shard
    from pairclean_workers.cli import main

    raw = b"caf\xe9".decode("utf-8", "surrogateescape")
    shard = write_shard(tmp_path / "s-00000.tar", [{"__key__": raw, "jpg": dev_images[0].path.read_bytes(), "txt": "a dog"},
                                                   {"__key__": "plain", "jpg": dev_images[1].path.read_bytes(), "txt": "a cat"}])
    out = tmp_path / "out"
    assert main(["score", str(shard), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    row = {r["key"]: r for r in pq.read_table(out / "s-00000.parquet").to_pylist()}["caf\\xe9"]
    got = list(weight_stage(out, "loss")([{"__key__": raw, "__url__": str(shard)}]))
    assert got[0]["weight"] == pytest.approx(row["weight"])


def test_a_rewrite_begun_after_the_stage_was_built_stops_its_next_shard(scored, tmp_path: Path) -> None:
    """The refusal ran once, when the stage was built: copies pickled into DataLoader workers
    for later epochs read a half-rewritten folder."""
    import pickle
    import shutil

    from pairclean.errors import InputError

    out, shards = scored
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.copytree(out.parent / f"{out.name}.pairclean", copy.parent / f"{copy.name}.pairclean")
    stage = WeightStage(copy, "loss", max_cached_shards=1)
    assert list(stage(_samples(shards)[:1]))
    Path(schema.local_side_path(copy, schema.REWRITE_FILE)).write_text("{}")
    with pytest.raises(InputError, match="interrupted while rewriting the tables"):
        list(pickle.loads(pickle.dumps(stage))(_samples(shards)[10:11]))  # a worker's copy, another shard
    with pytest.raises(ValueError, match="max_cached_shards"):
        WeightStage(out, "loss", max_cached_shards=0)


def test_a_fifo_in_place_of_a_table_is_one_line_not_a_hung_worker(scored, tmp_path: Path) -> None:
    import os
    import shutil
    import threading

    from pairclean.errors import InputError

    out, shards = scored
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shutil.copytree(out.parent / f"{out.name}.pairclean", copy.parent / f"{copy.name}.pairclean")
    (copy / "sh-00000.parquet").unlink()
    os.mkfifo(copy / "sh-00000.parquet")
    caught: list[BaseException] = []

    def read() -> None:
        try:
            list(weight_stage(copy, "loss")(_samples(shards)[:1]))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            caught.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the stage hung on a FIFO"
    assert len(caught) == 1 and isinstance(caught[0], InputError) and "not a regular file" in str(caught[0])


def test_the_stage_takes_only_an_output_folder_and_says_why_a_shard_has_no_table(
        scored, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Round 7: any folder that existed was taken, so with ``missing="default"`` a typo (the
    shards' folder, the side folder, an empty one) trained every sample at the default weight;
    a shard whose scoring failed did the same without a word; ``file://`` folders were "not found"."""
    from pairclean.errors import InputError
    from pairclean_workers.cli import main

    out, shards = scored
    for wrong in (shards[0].parent, Path(f"{out}{schema.SIDE_SUFFIX}"), tmp_path):
        with pytest.raises(InputError, match="is not a pairclean output folder"):
            WeightStage(wrong, "loss", missing="default")
    with pytest.raises(InputError, match="reads a local output folder, not s3://"):
        WeightStage("s3://bucket/out", "loss")
    assert len(list(WeightStage(f"file://{out}", "loss")(_samples(shards)))) == 20
    import os

    import shutil

    shutil.copytree(out, tmp_path / "weights:v2")  # a folder name with a colon is a path, as before
    shutil.copytree(f"{out}{schema.SIDE_SUFFIX}", tmp_path / f"weights:v2{schema.SIDE_SUFFIX}")
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert len(list(WeightStage("weights:v2", "loss")(_samples(shards)))) == 20
    finally:
        os.chdir(here)
    junk = tmp_path / "sh-00002.tar"
    junk.write_bytes(b"not a tar" * 100)
    part = tmp_path / "part"
    assert main(["score", *map(str, shards), str(junk), "--out", str(part), "--model", "pairclean-tiny-test",
                 "--executor", "local", "--no-progress", "--max-failed-fraction", "0.5"]) == 4
    lost = [{"__key__": "k2-000", "__url__": str(junk)}]
    with pytest.raises(KeyError, match="its scoring failed"):
        list(WeightStage(part, "loss")(lost))
    assert list(WeightStage(part, "loss", missing="default", default=0.5)(lost))[0][schema_weight_key()] == 0.5
    assert "no pairclean table for shard 'sh-00002'" in caplog.text and "its scoring failed" in caplog.text


def schema_weight_key() -> str:
    from pairclean.sampler import WEIGHT_KEY

    return WEIGHT_KEY


def test_sampler_frequencies_follow_weights() -> None:
    weights = np.array([0.0, 1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    sampler = WeightedSampler(weights, num_samples=200_000, seed=3)
    counts = np.bincount(np.fromiter(iter(sampler), dtype=np.int64), minlength=5)
    expected = weights / weights.sum() * 200_000
    assert counts[0] == 0
    chi2 = ((counts[1:] - expected[1:]) ** 2 / expected[1:]).sum()
    assert chi2 < 16.3  # 3 dof, p = 0.001


def test_sampler_ranks_epochs_and_no_replacement() -> None:
    weights = np.random.default_rng(0).random(1000).astype(np.float32)
    ranks = [WeightedSampler(weights, 1000, replacement=False, rank=r, world_size=4, seed=1) for r in range(4)]
    parts = [list(s) for s in ranks]
    assert sum(len(p) for p in parts) == 1000 and len(set().union(*parts)) == 1000
    s = WeightedSampler(weights, 100, seed=1)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first
    with pytest.raises(ValueError, match="without replacement"):
        WeightedSampler(np.array([1.0, 0.0]), 2, replacement=False)


@pytest.mark.parametrize("replacement", [True, False])
def test_every_rank_gets_as_many_indices_when_the_draw_does_not_divide(replacement: bool) -> None:
    # 1025 over 4 ranks gave 257, 256, 256, 256: one rank ran a batch more, and DDP waits for it.
    weights = np.random.default_rng(0).random(1025).astype(np.float32) + 0.1
    parts = [list(WeightedSampler(weights, replacement=replacement, rank=r, world_size=4, seed=2)) for r in range(4)]
    assert [len(p) for p in parts] == [257] * 4
    assert all(len(WeightedSampler(weights, replacement=replacement, rank=r, world_size=4)) == 257 for r in range(4))
    if not replacement:
        drawn = [i for p in parts for i in p]
        assert set(drawn) == set(range(1025)) and len(drawn) - len(set(drawn)) == 3  # 3 dealt again to fill the round


def test_a_zero_weight_is_never_drawn_beside_a_tiny_one() -> None:
    # E / 1e-39 overflowed float32 to inf and tied with the zero weights' keys.
    weights = np.array([0.0, 0.0, 0.0, 0.0, 1e-39], dtype=np.float32)
    for seed in range(20):
        assert list(WeightedSampler(weights, 1, replacement=False, seed=seed)) == [4]


def test_weights_are_taken_in_their_own_precision_and_seeds_checked() -> None:
    """Round 6: float64 weights were cast to float32 first: 1e-60s became "no positive weight",
    1e39 "not finite", and two 1e-50s beside a 1 could not be drawn without replacement."""
    assert sorted(WeightedSampler(np.array([1e-60, 2e-60, 3e-60]), 3, replacement=False)) == [0, 1, 2]
    assert list(WeightedSampler(np.array([0.0, 1e39]), 2)) == [1, 1]
    assert sorted(WeightedSampler([1e-50, 1.0, 1e-50], 3, replacement=False)) == [0, 1, 2]
    if np.finfo(np.longdouble).max > 1e400:  # x86's 80-bit long double
        huge = np.array(["1e400", "3e400"], dtype=np.longdouble)
        assert sorted(WeightedSampler(huge, 2, replacement=False)) == [0, 1]
    for bad in ({"seed": -1}, {"seed": 1.5}):
        with pytest.raises(ValueError, match="whole number >= 0"):
            WeightedSampler([1.0], **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="epoch must be"):
        WeightedSampler([1.0]).set_epoch(-1)


@pytest.mark.slow
def test_sampler_handles_50_million_weights_in_bounded_memory() -> None:
    code = """
import resource, numpy as np
from pairclean.sampler import WeightedSampler
w = np.ones(50_000_000, dtype=np.float32); w[-1] = 1e6  # the last index is far heavier
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
s = WeightedSampler(w, num_samples=1_000_000, rank=1, world_size=2, seed=0)
idx = np.fromiter(iter(s), dtype=np.int64)
extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(len(idx), int(idx.max()), round(float((idx == 49_999_999).mean()), 3), round(extra))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600).stdout.split()
    n, biggest, heavy_share, extra_mb = int(out[0]), int(out[1]), float(out[2]), float(out[3])
    assert n == 500_000 and biggest == 49_999_999  # beyond torch's 2^24 limit
    assert heavy_share == pytest.approx(1e6 / (1e6 + 5e7 - 1), abs=0.003)
    assert extra_mb < 150  # no O(N) float64 copies on top of the 200 MB of weights


def test_weighted_clip_loss_and_rcm_loss() -> None:
    torch = pytest.importorskip("torch")
    from pairclean.losses import rcm_loss, weighted_clip_loss

    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(8, 16, generator=g), dim=-1)
    ones = weighted_clip_loss(img, txt, torch.ones(8), 10.0)
    logits = 10.0 * img @ txt.T
    ref = (torch.nn.functional.cross_entropy(logits, torch.arange(8)) + torch.nn.functional.cross_entropy(logits.T, torch.arange(8))) / 2
    assert torch.isclose(ones, ref)
    half = torch.tensor([1.0] * 4 + [0.0] * 4)
    assert weighted_clip_loss(img, txt, half, 10.0) < ones  # zero-weight pairs drop out, mean still over B
    assert torch.isclose(weighted_clip_loss(img, txt, torch.zeros(8), 10.0), torch.tensor(0.0))
    perfect = rcm_loss(img, img)
    assert 0 <= perfect < rcm_loss(img, txt) <= 1
    assert torch.isclose(rcm_loss(img, txt, weights=torch.ones(8)), rcm_loss(img, txt))
    assert torch.isclose(rcm_loss(img, txt, weights=torch.zeros(8)), torch.tensor(0.0))
    # pair i's term times w_i, the mean still over B: half the pairs at weight 0 give
    # the unweighted terms of the other half summed over B
    sims = img @ txt.T / 0.03
    terms = (1 - torch.softmax(sims, 1).diagonal()) + (1 - torch.softmax(sims, 0).diagonal())
    assert torch.isclose(rcm_loss(img, txt, weights=half), 0.5 * terms[:4].sum() / 8)


def test_exports(scored) -> None:
    from pairclean.output.exports import UID_DTYPE, write_exports
    from pairclean.output.folder import OutputDir
    import pyarrow.parquet as pq

    out, _ = scored
    written = write_exports(OutputDir(str(out)))
    sizes = json.loads(Path(written["sizes.json"]).read_text())
    assert sizes == {"sh-00000.tar": 10, "sh-00001.tar": 10}
    sums = json.loads(Path(written["shard_weights.json"]).read_text())
    assert sums["sh-00000.tar"] == pytest.approx(float(pq.read_table(out / "sh-00000.parquet").column("weight").to_numpy().sum()), rel=1e-6)
    keep = np.load(written["datacomp_keep.npy"])
    assert keep.dtype == UID_DTYPE
    rows = [r for p in sorted(out.glob("sh-*[0-9].parquet")) for r in pq.read_table(p).to_pylist()]
    expected = sorted(int(r["uid"], 16) for r in rows if r["status"] == "ok" and not r["noisy"])
    assert [int(a) << 64 | int(b) for a, b in keep.tolist()] == expected  # sorted, as DataComp needs


def test_stage_in_a_real_webdataset_pipeline(scored) -> None:
    wds = pytest.importorskip("webdataset")
    out, shards = scored
    pipeline = wds.DataPipeline(
        wds.SimpleShardList([str(s) for s in shards]),
        wds.tarfile_to_samples(),
        weight_stage(out, "loss"),
        wds.to_tuple("__key__", "txt", "weight"),
    )
    rows = list(pipeline)
    assert len(rows) == 20 and all(0.0 <= w <= 1.0 for _, _, w in rows)
    assert rows[0][0] == "k0-000"


@pytest.mark.slow
def test_training_guide_example_runs() -> None:
    example = Path(__file__).resolve().parents[2] / "workers" / "examples" / "train_with_weights.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(line.split("weighted loss ")[1].split(",")[0]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_weights_of_another_shard_of_the_same_name_are_refused_not_joined(scored, tmp_path: Path, dev_images: list) -> None:
    """img2dataset names every folder's shards 00000.tar, ... and their keys 000000000, ...:
    the same name and keys with other photos must not take this job's weights."""
    wds = pytest.importorskip("webdataset")
    from pairclean.errors import InputError
    from pairclean.lite.evaldata import write_shard

    out, shards = scored
    other = write_shard(tmp_path / "other" / shards[0].name, [
        {"__key__": f"k0-{i:03d}", "jpg": dev_images[100 + i].path.read_bytes(), "txt": dev_images[100 + i].captions[0]} for i in range(10)])

    def pipeline(shard: Path, *stages: object) -> list:
        return list(wds.DataPipeline(wds.SimpleShardList([str(shard)]), wds.tarfile_to_samples(), *stages))

    with pytest.raises(InputError, match="weights of another shard of the same name"):
        pipeline(other, weight_stage(out, "loss"))
    assert len(pipeline(shards[0], weight_stage(out, "loss"))) == 10  # its own shard joins
    # after decode the bytes are gone: nothing to compare, the join stands as before
    assert len(pipeline(other, wds.decode("pil"), weight_stage(out, "loss"))) == 10


def _copy_job(out: Path, to: Path) -> Path:
    """A copy of the job ``out`` (its tables and its side folder) at ``to``."""
    shutil.copytree(out, to)
    shutil.copytree(f"{out}{schema.SIDE_SUFFIX}", f"{to}{schema.SIDE_SUFFIX}")
    return to


def test_captions_rewritten_in_place_are_refused_before_decode(scored, tmp_path: Path, dev_images: list,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Re-captioning shards while keeping their images and keys is common: the old weights
    (which judged the old captions) were served to the new ones; only the image's size was
    compared. After decode nothing can be compared: said once."""
    wds = pytest.importorskip("webdataset")
    from pairclean.errors import InputError
    from pairclean.lite.evaldata import write_shard

    out, shards = scored
    recaptioned = write_shard(tmp_path / "recaptioned" / shards[0].name, [
        {"__key__": f"k0-{i:03d}", "jpg": dev_images[i].path.read_bytes(), "txt": dev_images[50 + i].captions[0],
         "json": {"uid": f"{i:032x}"}} for i in range(10)])

    def pipeline(*stages: object) -> list:
        return list(wds.DataPipeline(wds.SimpleShardList([str(recaptioned)]), wds.tarfile_to_samples(), *stages))

    with pytest.raises(InputError, match="its txt member has .* bytes, the caption scored for this key .* had"):
        pipeline(weight_stage(out, "loss"))
    assert len(pipeline(wds.decode("pil"), weight_stage(out, "loss"))) == 10
    assert caplog.text.count("WeightStage sees decoded samples") == 1


def test_only_committed_tables_are_served_and_each_as_pairclean_wrote_it(scored, tmp_path: Path) -> None:
    """A table edited in place was served (and exported) as the job's weights while a rerun
    called it someone else's; a table no run recorded (a killed run's, a failed rerun's) was
    served as if it were committed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pairclean.errors import InputError
    from pairclean.output.exports import export
    from pairclean.output.folder import OutputDir

    out, shards = scored
    edited = _copy_job(out, tmp_path / "edited")
    table = pq.read_table(edited / "sh-00000.parquet")
    flipped = pa.array(1 - table.column("weight").to_numpy(), pa.float32())
    pq.write_table(table.set_column(table.schema.get_field_index("weight"), "weight", flipped), edited / "sh-00000.parquet")
    with pytest.raises(InputError, match="sh-00000.parquet changed since pairclean wrote it"):
        list(WeightStage(edited, "loss")(_samples(shards)[:1]))
    assert len(list(WeightStage(edited, "loss")(_samples(shards)[10:]))) == 10  # the other shard is as written
    with pytest.raises(InputError, match="sh-00000.parquet changed since pairclean wrote it .* not exported"):
        export(OutputDir(str(edited)))
    # an edit that keeps the file's size (one weight byte changed) is refused by both alike
    same = _copy_job(out, tmp_path / "same-size")
    path = same / "sh-00000.parquet"
    data = bytearray(path.read_bytes())
    at = data.find(np.float32(table.column("weight")[0].as_py()).tobytes())
    assert at > 0
    data[at] ^= 0x01  # the lowest bit of the first weight: same size, other bytes
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"sh-00000.parquet changed since pairclean wrote it \(the same size, other bytes;"):
        export(OutputDir(str(same)))
    with pytest.raises(InputError, match="sh-00000.parquet changed since pairclean wrote it"):
        list(WeightStage(same, "loss")(_samples(shards)[:1]))
    unrecorded = _copy_job(out, tmp_path / "unrecorded")
    side = Path(f"{unrecorded}{schema.SIDE_SUFFIX}")
    for folder in (side / "state" / "manifest", side / "state" / "completions"):
        shutil.rmtree(folder, ignore_errors=True)  # as a run killed before it recorded anything left it
    with pytest.raises(KeyError, match="its table is not recorded as committed"):
        list(WeightStage(unrecorded, "loss")(_samples(shards)[:1]))
    assert [s[schema_weight_key()] for s in WeightStage(unrecorded, "loss", missing="default", default=0.25)(_samples(shards))] == [0.25] * 20


def test_a_store_that_lives_through_a_rescore_serves_the_new_tables(scored, tmp_path: Path) -> None:
    """Persistent workers keep one store for the whole run: a shard read again after a
    rescore finished was compared with the records read before it and called edited."""
    import pyarrow.parquet as pq

    from pairclean_workers.cli import main

    out, shards = scored
    job = _copy_job(out, tmp_path / "job")
    stage = WeightStage(job, "loss", max_cached_shards=1)
    assert len(list(stage(_samples(shards)))) == 20  # shard 1 evicts shard 0
    assert main(["rescore", str(job), "--beta-recipe", "gmm", "--weighting", "paper"]) == 0
    table = {r["key"]: r["weight"] for r in pq.read_table(job / "sh-00000.parquet").to_pylist()}
    got = {s["__key__"]: s[schema_weight_key()] for s in stage(_samples(shards)[:10])}
    assert got == pytest.approx(table)


def test_a_shard_the_job_has_not_reached_is_said_so(scored, tmp_path: Path) -> None:
    """A live job's shards not scored yet were "no shard of that name (another folder's?)"."""
    out, shards = scored
    job = _copy_job(out, tmp_path / "job")
    side = Path(f"{job}{schema.SIDE_SUFFIX}")
    for folder in (side / "state" / "manifest", side / "state" / "completions"):
        shutil.rmtree(folder, ignore_errors=True)
    (job / "sh-00001.parquet").unlink()
    with pytest.raises(KeyError, match="the job has not scored it yet"):
        list(WeightStage(job, "loss")(_samples(shards)[10:11]))
    with pytest.raises(KeyError, match="scored no shard of that name"):
        list(WeightStage(job, "loss")([{"__key__": "k0-000", "__url__": "/elsewhere/sh-00009.tar"}]))


def test_export_sizes_where_open_clip_looks_and_never_over_foreign_files(scored, tmp_path: Path, capsys) -> None:
    """open_clip reads sizes.json from the first shard's folder: written there only when asked."""
    import pyarrow.parquet as pq

    from pairclean.errors import InputError
    from pairclean.output.exports import export
    from pairclean.output.folder import OutputDir
    from pairclean_workers.cli import main

    out, shards = scored
    beside = shards[0].parent / "sizes.json"
    report = export(OutputDir(str(out)))
    assert not beside.exists() and any(str(shards[0].parent) in n for n in report.notes)  # says where to copy it
    # kept counts beside the shards would mislead DataComp's resharder and open_clip (issue 23)
    rows = {p.stem: pq.read_table(p).to_pylist() for p in out.glob("sh-*[0-9].parquet")}
    kept = sum(r["status"] == "ok" and not r["noisy"] for rs in rows.values() for r in rs)
    with pytest.raises(InputError, match=f"--train-num-samples {kept} "):
        export(OutputDir(str(out)), sizes_of="kept", sizes_beside_shards=True)
    assert not beside.exists()
    link = tmp_path / "shards-link"  # the shards' folder named through a link is that folder (it wrote kept counts there)
    link.symlink_to(shards[0].parent, target_is_directory=True)
    with pytest.raises(InputError, match=f"--train-num-samples {kept} "):
        export(OutputDir(str(out)), sizes_of="kept", sizes_dirs=[str(link)])
    assert not beside.exists()
    report = export(OutputDir(str(out)), sizes_of="kept", sizes_dirs=[str(tmp_path)])
    assert sum(json.loads((tmp_path / "sizes.json").read_text()).values()) == kept == report.kept
    (tmp_path / "sizes.json").unlink()
    assert main(["export", str(out), "--sizes-beside-shards"]) == 0  # ours: replaced
    assert json.loads(beside.read_text()) == {"sh-00000.tar": 10, "sh-00001.tar": 10}
    foreign = tmp_path / "sizes.json"
    foreign.write_text('{"mine": 1}')
    exported = schema.local_side_path(out, "_export/sizes.json")
    exported.unlink()
    with pytest.raises(InputError, match="did not write"):
        export(OutputDir(str(out)), sizes_dirs=[str(tmp_path)])
    assert foreign.read_text() == '{"mine": 1}' and not exported.exists()  # nothing written
    beside.unlink()
    with pytest.raises(InputError, match="--sizes-dir s3://b/sizes: copies of sizes.json are written to local folders only"):
        export(OutputDir(str(out)), sizes_dirs=["s3://b/sizes"])  # was "cannot write into '/here/s3:/b/sizes'" (round 7)
    for inside in (out, out / "sub"):  # the tables' own folder: pyarrow, pandas and polars then failed to read OUT
        inside.mkdir(exist_ok=True)
        with pytest.raises(InputError, match="inside the output folder"):
            export(OutputDir(str(out)), sizes_dirs=[str(inside)])
        assert not (inside / "sizes.json").exists()
    (out / "sub").rmdir()
    # nor into another job's tables (that job's OUT then failed in pyarrow and pandas)
    other = tmp_path / "other-job"
    shutil.copytree(out, other)
    shutil.copytree(f"{out}{schema.SIDE_SUFFIX}", f"{other}{schema.SIDE_SUFFIX}")
    with pytest.raises(InputError, match="inside another pairclean job's output folder"):
        export(OutputDir(str(out)), sizes_dirs=[str(other)])
    assert not (other / "sizes.json").exists()


def test_read_scores_for_notebooks(scored) -> None:
    import pyarrow.parquet as pq

    import pairclean

    out, _ = scored
    table = pairclean.read_scores(out)
    expected = [r for p in sorted(out.glob("sh-*[0-9].parquet")) for r in pq.read_table(p).to_pylist()]
    assert table.num_rows == 20 and table.column("key").to_pylist() == [r["key"] for r in expected]
    frame = pairclean.read_scores(str(out), columns=["key", "weight"]).to_pandas()
    assert list(frame.columns) == ["key", "weight"] and frame["weight"].tolist() == pytest.approx([r["weight"] for r in expected])


def test_export_on_the_demo_job_without_datacomp_uids(tmp_path: Path, capsys) -> None:
    """The demo (10 pairs) has uids that are names ('astronaut'): no keep list, a note, and the rest written."""
    from pairclean_workers.cli import main, sample_shard

    out = tmp_path / "demo-out"
    assert main(["score", sample_shard(), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["export", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "datacomp_keep.npy not written" in printed and "'astronaut'" in printed
    assert "open_clip reads sizes.json from the folder of the first training shard" in printed
    export_dir = schema.local_side_path(out, schema.EXPORT_DIR)
    assert json.loads((export_dir / "sizes.json").read_text()) == {"demo-000000.tar": 10}
    assert (export_dir / "shard_weights.json").exists() and not (export_dir / "datacomp_keep.npy").exists()


def test_export_names_a_bad_uid_and_writes_nothing_unless_told_to_skip(dev_images: list, tmp_path: Path, capsys) -> None:
    from pairclean.lite.evaldata import write_shard
    from pairclean_workers.cli import main

    samples = [
        {"__key__": f"k-{i:03d}", "jpg": dev_images[i].path.read_bytes(), "txt": dev_images[i].captions[0],
         "json": {"uid": f"{i:032x}" if i % 2 == 0 else f"not-a-datacomp-uid-{i}"}}
        for i in range(12)
    ]
    shard = write_shard(tmp_path / "shards" / "bad-00000.tar", samples)
    out = tmp_path / "out"
    assert main(["score", str(shard), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    kept = [r["uid"] for r in pairclean_read(out) if r["status"] == "ok" and not r["noisy"]]
    bad = [u for u in kept if u.startswith("not-")]
    assert bad and len(bad) < len(kept), "the fixture needs kept pairs with good and with bad uids"
    capsys.readouterr()
    assert main(["export", str(out)]) == 1
    err = capsys.readouterr().err
    assert "not-a-datacomp-uid-" in err and "k-0" in err and "bad-00000.tar" in err and "Traceback" not in err
    assert not schema.local_side_path(out, schema.EXPORT_DIR).exists()  # nothing written
    assert main(["export", str(out), "--skip-bad-uids"]) == 0
    keep = np.load(schema.local_side_path(out, "_export/datacomp_keep.npy"))
    assert len(keep) == len(kept) - len(bad)


def test_a_datacomp_uid_is_exactly_32_hex_digits() -> None:
    from pairclean.output.exports import _is_datacomp_uid

    assert _is_datacomp_uid("0123456789abcdef0123456789ABCDEF")
    # int(uid, 16) took these: a sign overflowed uint64 (a traceback), an underscore named another pair
    for bad in ("-" + "f" * 31, "0123456789abcdef01234567_9abcdef", " " + "a" * 31, "0x" + "a" * 30, "a" * 31):
        assert not _is_datacomp_uid(bad), bad


def pairclean_read(out: Path) -> list[dict]:
    import pairclean

    return pairclean.read_scores(out, columns=["uid", "status", "noisy"]).to_pylist()
