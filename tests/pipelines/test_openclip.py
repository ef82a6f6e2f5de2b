"""pairclean's WebDataset stage in real loaders: open_clip-shaped pipelines and open_clip's own
``get_wds_dataset``, DataLoader workers under the fork, forkserver and spawn start methods,
resampled and not; every sample's weight must equal its row in the Parquet score table.

The open_clip test needs ``open_clip_torch[training]`` with the webdataset it pins
(<=0.2.86; under webdataset 1.x open_clip's own ``tarfile_to_samples_nothrow`` fails), so
it skips in the main virtualenv (webdataset 1.x) and runs in one made for it:

    python -m venv /tmp/venv-oc && /tmp/venv-oc/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/venv-oc/bin/pip install -e . 'open_clip_torch[training]' pytest
    /tmp/venv-oc/bin/python -m pytest -q --noconftest tests/pipelines/test_openclip.py
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairclean.lite.evaldata import write_shard
from pairclean.sampler import PSEUDO_KEY, WEIGHT_KEY, WeightStage, weight_stage
from pairclean.uris import shard_stem

wds = pytest.importorskip("webdataset")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

N_SHARDS, PER_SHARD = 4, 8
METHODS = [m for m in ("fork", "forkserver", "spawn") if m in multiprocessing.get_all_start_methods()]


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


@pytest.fixture(scope="module")
def weighted(tmp_path_factory: pytest.TempPathFactory,
             committed: Callable[[Path], Path]) -> tuple[list[str], Path, dict[tuple[str, str], tuple[float, bool]]]:
    """Four real shards (32 px JPEGs, captions) and their score tables, distinct weights, committed."""
    root = tmp_path_factory.mktemp("oc")
    out = root / "out"
    out.mkdir()
    job = Path(f"{out}.pairclean/state/job.json")  # WeightStage takes only a job's output folder
    job.parent.mkdir(parents=True)
    job.write_text("{}")
    rng = np.random.default_rng(0)
    urls, rows = [], {}
    for s in range(N_SHARDS):
        samples = []
        for i in range(PER_SHARD):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, format="JPEG")
            samples.append({"__key__": f"s{s}-{i:03d}", "jpg": buf.getvalue(), "txt": f"photo {i} of shard {s}"})
        path = write_shard(root / "shards" / f"sh-{s:05d}.tar", samples)
        urls.append(str(path))
        weights = rng.random(PER_SHARD).astype(np.float32)
        keys = [x["__key__"] for x in samples]
        pq.write_table(
            pa.table({
                "key": keys, "shard": [str(path)] * PER_SHARD, "idx": pa.array(range(PER_SHARD), pa.int64()),
                "status": ["ok"] * PER_SHARD, "weight": pa.array(weights), "noisy": pa.array(weights < 0.3),
            }),
            out / f"{shard_stem(str(path))}.parquet",
        )
        rows.update({(shard_stem(str(path)), k): (float(w), bool(w < 0.3)) for k, w in zip(keys, weights)})
    return urls, committed(out), rows


def _check(got: list[tuple[str, str, float]], rows: dict) -> None:
    assert got, "the loader yielded nothing"
    for key, url, weight in got:
        assert weight == pytest.approx(rows[(shard_stem(url), key)][0], abs=1e-7), (url, key)


def test_stage_is_a_picklable_class_without_its_cache(weighted) -> None:
    urls, out, rows = weighted
    stage = WeightStage(out, "loss")
    list(stage([{"__key__": "s0-000", "__url__": urls[0]}]))
    assert stage.store._cache  # loaded one shard
    clone = pickle.loads(pickle.dumps(stage))
    assert clone.store._cache == {} and clone.mode == "loss"
    assert isinstance(weight_stage(out, "keep"), WeightStage)  # the old factory, same class
    got = clone.apply({"__key__": "s1-003", "__url__": "pipe:cat " + urls[1]})  # URL forms join alike
    assert got[WEIGHT_KEY] == pytest.approx(rows[("sh-00001", "s1-003")][0])


def test_stage_before_decode_with_rename_keep_false(weighted) -> None:
    urls, out, rows = weighted
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.tarfile_to_samples(),
        WeightStage(out, "keep"),  # before decode: the "__" key passes the decoder
        wds.decode("pilrgb"),
        wds.rename(keep=False, image="jpg", text="txt", weight=WEIGHT_KEY, key="__key__", url="__url__"),
        wds.to_tuple("key", "url", "weight", "image"),
    )
    got = list(pipeline)
    assert {k for k, *_ in got} == {k for (_, k), (_, noisy) in rows.items() if not noisy}
    _check([g[:3] for g in got], rows)
    assert all(img.size == (32, 32) for *_, img in got)


def test_stage_after_to_tuple_says_where_it_belongs(weighted) -> None:
    urls, out, _ = weighted
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls[:1]), wds.tarfile_to_samples(), wds.to_tuple("txt"), WeightStage(out))
    with pytest.raises(TypeError, match="before rename"):
        list(pipeline)


def test_modes_sample_and_pseudo_flag_keys(weighted) -> None:
    urls, out, rows = weighted
    samples = [{"__key__": k, "__url__": u} for u in urls for (st, k) in rows if st == shard_stem(u)]
    a = [s["__key__"] for s in WeightStage(out, "sample", w_cap=0.5, seed=3)([dict(s) for s in samples])]
    b = [s["__key__"] for s in WeightStage(out, "sample", w_cap=0.5, seed=3)([{**s, "__url__": "file://" + s["__url__"]} for s in samples])]
    assert a == b and 0 < len(a) < len(samples)  # the URL form does not change decisions
    assert PSEUDO_KEY.startswith("__") and WEIGHT_KEY.startswith("__")


@pytest.mark.parametrize("resampled", [False, True], ids=["shards", "resampled"])
@pytest.mark.parametrize("method", METHODS)
def test_open_clip_shaped_loader_under_each_start_method(weighted, method: str, resampled: bool) -> None:
    """open_clip's stage order with this webdataset: shards, split, samples, stage, decode, rename."""
    urls, out, rows = weighted
    if resampled:
        head = [wds.ResampledShards(urls, deterministic=True)]
    else:
        head = [wds.SimpleShardList(urls), wds.split_by_worker]
    pipeline = wds.DataPipeline(
        *head,
        wds.tarfile_to_samples(),
        wds.shuffle(8),
        WeightStage(out, "loss"),
        wds.decode("pilrgb"),
        wds.rename(image="jpg", text="txt", weight=WEIGHT_KEY),
        wds.to_tuple("__key__", "__url__", "weight"),
    )
    if resampled:
        pipeline = pipeline.with_epoch(20)  # per worker
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=2, multiprocessing_context=method)
    got = list(loader)
    _check(got, rows)
    if resampled:
        assert len(got) == 40
    else:
        assert sorted(k for k, _, _ in got) == sorted(k for _, k in rows)  # each sample once


def _open_clip_ready() -> str | None:
    try:
        import open_clip  # noqa: F401
        import open_clip_train.data  # noqa: F401
    except ImportError as exc:
        return f"open_clip_torch's open_clip_train is not installed ({exc})"
    if _version(wds.__version__) > (0, 2, 86):
        return (f"open_clip 3.3's get_wds_dataset needs webdataset<=0.2.86 (its training extra's pin; "
                f"this environment has {wds.__version__}): run this file in a venv with open_clip_torch[training]")
    return None


@pytest.mark.parametrize("resampled", [False, True], ids=["shards", "resampled"])
@pytest.mark.parametrize("method", METHODS)
def test_open_clip_get_wds_dataset_with_weights(weighted, method: str, resampled: bool) -> None:
    reason = _open_clip_ready()
    if reason:
        pytest.skip(reason)
    import open_clip

    from pairclean.openclip import get_wds_dataset

    urls, out, rows = weighted
    args = Namespace(
        train_data=str(Path(urls[0]).parent / "sh-{00000..00003}.tar"),  # a brace list, as users pass it
        val_data=None, train_num_samples=N_SHARDS * PER_SHARD, dataset_resampled=resampled,
        train_data_upsampling_factors=None, seed=0, batch_size=4, world_size=1, rank=0, workers=2,
    )
    preprocess = open_clip.image_transform(32, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    info = get_wds_dataset(args, preprocess, True, tokenizer=tokenizer, weights=out, with_keys=True,
                           multiprocessing_context=method)
    got = []
    for images, texts, weights, keys, batch_urls in info.dataloader:
        assert images.shape == (len(keys), 3, 32, 32) and texts.shape == (len(keys), 77)
        got.extend(zip(keys, batch_urls, np.asarray(weights, dtype=np.float64).tolist()))
    _check(got, rows)
    assert len(got) == info.dataloader.num_samples
    if not resampled:
        assert sorted(k for k, _, _ in got) == sorted(k for _, k in rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_open_clip_sample_mode_draws_with_the_training_epoch(weighted, workers: int) -> None:
    """open_clip_train resumes with get_data(..., epoch=start_epoch) and sets the epoch on
    its SharedEpoch: a run resumed at epoch 2 must draw epoch 2's pairs (it drew epoch 0's),
    and open_clip's with_epoch restarting passes inside an epoch must not move the draw."""
    reason = _open_clip_ready()
    if reason:
        pytest.skip(reason)
    import open_clip

    from pairclean.openclip import get_wds_dataset

    urls, out, rows = weighted
    samples = [{"__key__": k, "__url__": u} for u in urls for (stem, k) in rows if stem == shard_stem(u)]

    def draw(epoch: int) -> set[tuple[str, str]]:
        stage = WeightStage(out, "sample", seed=0, rank=0)
        stage.set_epoch(epoch)
        return {(shard_stem(x["__url__"]), x["__key__"]) for x in stage(samples)}

    def one_epoch(start: int, epoch: int) -> set[tuple[str, str]]:
        args = Namespace(train_data=str(Path(urls[0]).parent / "sh-{00000..00003}.tar"), val_data=None,
                         train_num_samples=N_SHARDS * PER_SHARD // 2, dataset_resampled=False,
                         train_data_upsampling_factors=None, seed=0, batch_size=4, world_size=1, rank=0, workers=workers)
        info = get_wds_dataset(args, open_clip.image_transform(32, is_train=True), True, epoch=start,
                               tokenizer=open_clip.get_tokenizer("ViT-B-32"), weights=out, mode="sample", with_keys=True)
        got: set[tuple[str, str]] = set()
        for e in range(start, epoch + 1):
            info.set_epoch(e)  # what open_clip_train's loop does at each epoch
            got = {(shard_stem(u), k) for *_, keys, batch_urls in info.dataloader for k, u in zip(keys, batch_urls)}
        return got

    assert draw(0) != draw(2)
    assert one_epoch(2, 2) <= draw(2)  # resumed at 2
    assert one_epoch(0, 2) <= draw(2)  # the uninterrupted run's epoch 2


def test_open_clip_test_skips_with_a_reason_here() -> None:
    """Documents the environment rule: in the main venv the reason names the webdataset pin."""
    reason = _open_clip_ready()
    if reason is None:
        pytest.skip("open_clip's loader can run here; the real test above ran")
    assert "open_clip" in reason


def test_no_pairclean_requirement_excludes_open_clip_training() -> None:
    """pairclean and open_clip_torch[training] (webdataset<=0.2.86) must install together."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra if not r.startswith("pairclean")]
    for req in reqs:
        if req.name.lower() == "webdataset":
            assert req.specifier.contains("0.2.86", prereleases=True), f"{req} excludes open_clip_torch[training]'s webdataset"
