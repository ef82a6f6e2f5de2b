"""Reading WebDataset shards: key rule, captions, metadata, broken tars."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from pairclean import schema
from pairclean.decode import DecodeFailure, decode_image
from pairclean.errors import ShardReadError
from pairclean.evaldata import write_shard
from pairclean.shards import ReadOptions, iter_pairs, split_member_name


def test_key_rule_matches_webdataset() -> None:
    assert split_member_name("a/b.c/img001.seg.png") == ("a/b.c/img001", "seg.png")
    assert split_member_name("x.JPG") == ("x", "jpg")
    assert split_member_name("noext") is None
    assert split_member_name("__index__.json") is None


def test_pairs_keep_keys_order_uid_url_and_caption_sources(tmp_path: Path, dev_images: list) -> None:
    jpg = dev_images[0].path.read_bytes()
    shard = write_shard(
        tmp_path / "s.tar",
        [
            {"__key__": "dir.v1/000", "jpg": jpg, "txt": "a caption", "json": {"uid": "u0", "url": "http://a/0"}},
            {"__key__": "dir.v1/001", "png": jpg, "json": {"caption": "from json", "alt": "alt text"}},
            {"__key__": "dir.v1/002", "webp": jpg, "txt": "   "},
            {"__key__": "dir.v1/003", "txt": "no image"},
            {"__key__": "dir.v1/004", "jpg": jpg},
        ],
    )
    pairs = list(iter_pairs(str(shard)))
    assert [p.key for p in pairs] == [f"dir.v1/00{i}" for i in range(5)]
    assert [p.idx for p in pairs] == list(range(5))
    assert [p.status for p in pairs] == ["ok", "ok", "empty_text", "missing_image", "missing_text"]
    assert (pairs[0].uid, pairs[0].url, pairs[0].text) == ("u0", "http://a/0", "a caption")
    assert pairs[1].text == "from json"
    alt = list(iter_pairs(str(shard), ReadOptions(caption_field="alt")))
    assert alt[1].text == "alt text" and alt[0].status == "missing_text"


def test_truncated_and_non_tar_shards_raise_naming_the_uri(tmp_path: Path, dev_images: list) -> None:
    good = write_shard(tmp_path / "g.tar", [{"__key__": f"{i}", "jpg": dev_images[i].path.read_bytes(), "txt": "x"} for i in range(4)])
    truncated = tmp_path / "t.tar"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2 + 100])
    with pytest.raises(ShardReadError, match="t.tar"):
        list(iter_pairs(str(truncated)))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar archive" * 100)
    with pytest.raises(ShardReadError, match="junk.tar"):
        list(iter_pairs(str(junk)))


def test_gzipped_shards_are_read(tmp_path: Path, dev_images: list) -> None:
    plain = write_shard(tmp_path / "p.tar", [{"__key__": "k", "jpg": dev_images[0].path.read_bytes(), "txt": "x"}])
    gz = tmp_path / "p2.tar.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert [p.key for p in iter_pairs(str(gz))] == ["k"]


def test_decode_refuses_large_images_from_the_header_and_reports_corruption(dev_images: list) -> None:
    jpg = dev_images[0].path.read_bytes()
    ok = decode_image(jpg)
    assert not isinstance(ok, DecodeFailure) and ok.mode == "RGB"
    big = decode_image(jpg, max_pixels=1000)
    assert isinstance(big, DecodeFailure) and big.status == schema.STATUS_TOO_LARGE
    bad = decode_image(b"\xff\xd8\xff garbage")
    assert isinstance(bad, DecodeFailure) and bad.status == schema.STATUS_DECODE_ERROR
    cut = decode_image(jpg[: len(jpg) // 3])
    assert isinstance(cut, DecodeFailure) and cut.status == schema.STATUS_DECODE_ERROR


def test_pixel_bomb_is_refused_without_decoding() -> None:
    from PIL import Image

    # A 1-bit 30000x30000 PNG is tiny on disk but 900 megapixels when decoded.
    buf = io.BytesIO()
    Image.new("1", (30000, 30000)).save(buf, format="PNG")
    result = decode_image(buf.getvalue(), max_pixels=64_000_000)
    assert isinstance(result, DecodeFailure) and result.status == schema.STATUS_TOO_LARGE
