"""Parallel decoding: a thread pool gives the results of one thread; the batched JPEG path
(run here on the CPU, as it would on a GPU) keeps the CPU path's per-sample statuses.

Built from the bundled demo shard's photos, so it runs without ../shared.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from pairclean import schema
from pairclean.read.decode import (
    DEFAULT_MAX_PIXELS,
    DecodeFailure,
    _batch_decodable,
    decode_and_preprocess,
    decode_image,
    decode_jpeg_batch,
    decode_pixels,
    split_preprocess_of,
    tensor_preprocess_of,
)
from pairclean.errors import InputError, ShardReadError
from pairclean.embed.estimators import EstimatorSpec, load_estimator
from pairclean.lite.evaldata import write_shard
from pairclean.embed.shard import ScoreOptions, _prepared_batches, score_shard
from pairclean.read.shards import iter_raw_samples

TINY = "pairclean-tiny-test"
DEMO = Path(__file__).resolve().parents[3] / "pipelines" / "data" / "sample" / "demo-000000.tar"


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_estimator(EstimatorSpec(TINY, precision="fp32", device="cpu"))


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """The ten JPEG photos of the demo shard, in tar order."""
    return [sample.files["jpg"] for sample in iter_raw_samples(str(DEMO))]


def _reencode(jpg: bytes, fmt: str, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(jpg)).convert(mode).save(out, format=fmt)
    return out.getvalue()


def _undefined_quant_table(jpg: bytes) -> bytes:
    """A JPEG whose header parses (size, mode) but whose first component names an
    undefined quantisation table: every decoder fails it, only at decode time."""
    data = bytearray(jpg)
    sof = data.index(b"\xff\xc0")
    data[sof + 12] = 3  # FF C0, length(2), precision, height(2), width(2), Nf, then C, HV, Tq
    return bytes(data)


def _threads(before: set[threading.Thread]) -> list[str]:
    """Reader and decode threads alive now that were not alive at ``before``."""
    return [t.name for t in threading.enumerate() if t.name.startswith("pairclean-") and t not in before]


@pytest.fixture
def mixed_shard(tmp_path: Path, photos: list[bytes]) -> Path:
    """27 pairs: the photos three times over, plus a broken image, a PNG, a WebP, a
    truncated JPEG and a missing caption scattered between them."""
    samples: list[dict[str, Any]] = []
    for i in range(27):
        samples.append({"__key__": f"s{i:03d}", "jpg": photos[i % len(photos)], "txt": f"caption number {i}"})
    samples[3]["jpg"] = b"broken"
    samples[8] = {"__key__": "s008", "png": _reencode(photos[1], "PNG"), "txt": "a png"}
    samples[13] = {"__key__": "s013", "webp": _reencode(photos[2], "WEBP"), "txt": "a webp"}
    samples[17]["jpg"] = photos[4][: len(photos[4]) // 3]
    del samples[22]["txt"]
    return write_shard(tmp_path / "mixed-00000.tar", samples)


def test_decode_pool_gives_the_single_thread_results_bit_for_bit(tiny: Any, mixed_shard: Path) -> None:
    before = set(threading.enumerate())
    # batch_size 4 over 27 rows: many batches, a short last one, the pool running ahead.
    one = score_shard(str(mixed_shard), tiny, ScoreOptions(batch_size=4, decode_workers=1))
    four = score_shard(str(mixed_shard), tiny, ScoreOptions(batch_size=4, decode_workers=4))
    assert one.keys == four.keys == [f"s{i:03d}" for i in range(27)]
    np.testing.assert_array_equal(one.idx, four.idx)
    assert one.status == four.status
    assert one.error == four.error
    assert one.status[3] == one.status[17] == schema.STATUS_DECODE_ERROR
    assert one.status[22] == schema.STATUS_MISSING_TEXT
    assert one.status[8] == one.status[13] == schema.STATUS_OK
    assert one.status.count(schema.STATUS_OK) == 24
    np.testing.assert_array_equal(one.similarity, four.similarity)  # NaNs in the same rows
    np.testing.assert_array_equal(one.image_emb, four.image_emb)
    np.testing.assert_array_equal(one.text_emb, four.text_emb)
    assert _threads(before) == []


def test_no_thread_outlives_an_early_stop_a_consumer_error_or_a_bad_shard(tiny: Any, mixed_shard: Path, tmp_path: Path) -> None:
    before = set(threading.enumerate())
    opts = ScoreOptions(batch_size=2, prefetch=1, decode_workers=4)
    batches = _prepared_batches(str(mixed_shard), tiny, opts)
    first = next(batches)
    assert [r.key for r in first.rows] == ["s000", "s001"]
    assert _threads(before)  # the reader and the pool are running
    batches.close()
    assert _threads(before) == []

    def consume_then_fail() -> None:
        for _ in _prepared_batches(str(mixed_shard), tiny, opts):
            raise RuntimeError("the model failed")

    with pytest.raises(RuntimeError, match="the model failed"):
        consume_then_fail()
    assert _threads(before) == []

    truncated = tmp_path / "cut.tar"
    truncated.write_bytes(mixed_shard.read_bytes()[:30_000])
    with pytest.raises(ShardReadError, match="cut.tar"):
        score_shard(str(truncated), tiny, opts)
    assert _threads(before) == []


def test_decode_options_are_checked() -> None:
    with pytest.raises(InputError, match="decode_workers"):
        ScoreOptions(decode_workers=0)
    with pytest.raises(InputError, match="decode_device"):
        ScoreOptions(decode_device="gpu")
    assert ScoreOptions(decode_device="cuda:1").decode_device == "cuda:1"


def test_tensor_preprocess_is_derived_from_open_clip_transforms_or_refused(tiny: Any) -> None:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    derived = tensor_preprocess_of(tiny.preprocess)
    assert derived is not None
    assert derived.image_size == tiny.image_size == 32
    assert derived.mean == pytest.approx(tiny.info.preprocess["mean"])
    assert derived.std == pytest.approx(tiny.info.preprocess["std"])
    assert derived.interpolation == "bicubic"
    # Other resize modes are not a resize + square centre crop: the CPU path keeps them.
    for mode in ("squash", "longest"):
        assert tensor_preprocess_of(image_transform_v2(PreprocessCfg(size=32, resize_mode=mode), is_train=False)) is None
    assert tensor_preprocess_of(lambda img: img) is None


@pytest.mark.parametrize("norm", [((0.5,) * 3, (0.5,) * 3), ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
def test_split_preprocess_gives_the_whole_preprocess_bit_for_bit(photos: list[bytes], norm: Any) -> None:
    """Decode threads stop at uint8 pixels; the batched finish equals the estimator's own
    transform on every image (pairclean-lite's and CLIP's normalisation, grey and RGB)."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    preprocess = image_transform_v2(PreprocessCfg(size=224, mean=norm[0], std=norm[1]), is_train=False)
    split = split_preprocess_of(preprocess)
    assert split is not None
    datas = photos + [_reencode(photos[0], "JPEG", "L"), _reencode(photos[1], "PNG")]
    pixels = [decode_pixels(d, DEFAULT_MAX_PIXELS, split, draft_size=224) for d in datas]
    assert all(p.dtype == np.uint8 and p.shape == (224, 224, 3) for p in pixels)
    batch = split.finish(np.stack(pixels))
    whole = torch.stack([decode_and_preprocess(d, DEFAULT_MAX_PIXELS, preprocess, draft_size=224) for d in datas])
    assert batch.dtype == torch.float32 and batch.shape == whole.shape
    assert torch.equal(batch, whole)
    assert batch.is_contiguous(memory_format=torch.channels_last)  # what the model takes, no copy
    for mode in ("squash", "longest"):
        assert split_preprocess_of(image_transform_v2(PreprocessCfg(size=32, resize_mode=mode), is_train=False)) is None


def test_cpu_decode_threads_run_no_torch_op(tiny: Any, mixed_shard: Path, photos: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch op in a decode thread would start a second OpenMP team beside the model's."""
    model_thread = threading.current_thread()
    foreign: list[str] = []
    real_div = torch.Tensor.div

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread() is not model_thread:
            foreign.append(threading.current_thread().name)
        return real_div(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "div", spy)
    result = score_shard(str(mixed_shard), tiny, ScoreOptions(batch_size=4, decode_workers=2))
    assert result.status.count(schema.STATUS_OK) == 24
    assert foreign == []
    # The spy sees the whole preprocess's ToTensor (x.div(255)) when a thread runs it.
    worker = threading.Thread(target=decode_and_preprocess, args=(photos[0], DEFAULT_MAX_PIXELS, tiny.preprocess), name="probe")
    worker.start()
    worker.join()
    assert foreign == ["probe"]


def test_batched_jpeg_decode_keeps_the_cpu_statuses_and_pixels(photos: list[bytes]) -> None:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    cfg = PreprocessCfg(size=64, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    preprocess = image_transform_v2(cfg, is_train=False)
    params = tensor_preprocess_of(preprocess)
    assert params is not None and params.image_size == 64
    bad_quant = _undefined_quant_table(photos[0])
    assert _batch_decodable(bad_quant, DEFAULT_MAX_PIXELS)  # so the batched call itself fails
    inputs = {
        "jpg0": photos[0],
        "png": _reencode(photos[1], "PNG"),
        "webp": _reencode(photos[2], "WEBP"),
        "broken": b"broken",
        "garbage_jpeg": b"\xff\xd8\xff garbage",
        "truncated": photos[3][: len(photos[3]) // 3],
        "bad_quant": bad_quant,
        "grey_jpg": _reencode(photos[5], "JPEG", "L"),
        "cmyk_jpg": _reencode(photos[6], "JPEG", "CMYK"),
        "jpg7": photos[7],
    }
    datas = list(inputs.values())
    # Complete RGB/grey JPEGs go to decode_jpeg; CMYK, PNG and WebP to PIL.
    batched = {name for name, data in inputs.items() if _batch_decodable(data, DEFAULT_MAX_PIXELS)}
    assert batched == {"jpg0", "grey_jpg", "jpg7", "bad_quant"}
    out = decode_jpeg_batch(datas, DEFAULT_MAX_PIXELS, params.image_size, params.mean, params.std, "cpu", params.interpolation)
    assert len(out) == len(datas)
    for name, data, got in zip(inputs, datas, out):
        cpu = decode_image(data, DEFAULT_MAX_PIXELS, draft_size=params.image_size)
        if isinstance(cpu, DecodeFailure):
            assert got == cpu, name  # same status, same message
            continue
        assert isinstance(got, torch.Tensor), name
        assert got.shape == (3, 64, 64) and got.dtype == torch.float32 and got.device.type == "cpu"
        # The batched decoder decodes at full scale, while PIL (the fallback, and the CPU
        # path) may draft() a JPEG down first: compare each with PIL doing the same.
        draft = None if name in batched else params.image_size
        reference = decode_and_preprocess(data, DEFAULT_MAX_PIXELS, preprocess, draft_size=draft)
        assert float((got - reference).abs().mean()) < 0.01, name
    failed = {name: got.status for name, got in zip(inputs, out) if isinstance(got, DecodeFailure)}
    assert failed == {name: schema.STATUS_DECODE_ERROR for name in ("broken", "garbage_jpeg", "truncated", "bad_quant")}


def test_batched_jpeg_decode_refuses_large_images_from_the_header(photos: list[bytes]) -> None:
    sizes = [Image.open(io.BytesIO(p)).size for p in photos]
    limit = 320 * 240  # some demo photos are 320x320, others 320x213
    out = decode_jpeg_batch(photos, limit, 32, (0.5,) * 3, (0.5,) * 3, "cpu")
    for (w, h), data, got in zip(sizes, photos, out, strict=True):  # one result per input
        if w * h > limit:
            assert isinstance(got, DecodeFailure) and got.status == schema.STATUS_TOO_LARGE
            assert got == decode_image(data, limit, draft_size=32)
        else:
            assert isinstance(got, torch.Tensor) and got.shape == (3, 32, 32)
    assert any(w * h > limit for w, h in sizes) and any(w * h <= limit for w, h in sizes)
