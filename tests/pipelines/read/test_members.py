"""Member spans (where each pair's image and caption lie in the tar) and ranged reads of them."""

from __future__ import annotations

import gzip
import json
from functools import partial
from http.server import SimpleHTTPRequestHandler
from pathlib import Path

import pytest

from pairclean import schema
from pairclean.errors import InputError, ShardNotFoundError, ShardReadError
from pairclean.lite.evaldata import write_shard
from pairclean.read.members import MemberTooLarge, read_member
from pairclean.read.shards import ReadOptions, iter_pairs


def _image(colour: tuple[int, int, int], fmt: str = "JPEG") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 40), colour).save(buf, format=fmt)
    return buf.getvalue()


IMAGE_0 = _image((200, 30, 30))


def _samples() -> list[dict]:
    return [
        {"__key__": "a/0", "jpg": IMAGE_0, "txt": "first caption", "json": {"uid": "0", "alt": "json caption 0"}},
        # a long member name goes through a PAX/GNU header: the span still points at the data
        {"__key__": "b/" + "x" * 150, "png": _image((30, 200, 30), "PNG"), "txt": "second", "json": {"alt": "json caption 1"}},
        {"__key__": "c/2", "jpg": _image((30, 30, 200)), "json": {"caption": "only in json"}},  # json-fallback caption
        {"__key__": "d/3", "txt": "no image"},
    ]


def test_spans_point_at_the_member_bytes(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "s.tar", _samples())
    raw = shard.read_bytes()
    pairs = list(iter_pairs(str(shard)))
    for pair in pairs:
        if pair.image is not None:
            offset, size = pair.image_span
            assert raw[offset : offset + size] == pair.image
        else:
            assert pair.image_span is None
    assert [p.caption_span is not None for p in pairs] == [True, True, False, True]
    offset, size = pairs[1].caption_span
    assert raw[offset : offset + size] == b"second"
    # With a caption_field the caption's member is the json
    with_field = list(iter_pairs(str(shard), ReadOptions(caption_field="alt")))
    offset, size = with_field[0].caption_span
    assert json.loads(raw[offset : offset + size])["alt"] == "json caption 0"


def test_a_caption_field_with_a_leading_dot_reads_that_member(tmp_path: Path) -> None:
    """Writers that keep captions in ``KEY.caption`` (or ``KEY.en.txt``) members: ``--caption-field
    .caption`` reads the member as text, its span points at it; a sample without it is
    ``missing_text`` naming its fields; a dot alone or an image member is refused up front."""
    samples = [
        {"__key__": "a/0", "jpg": IMAGE_0, "caption": "caf\xe9 caption".encode("latin-1"), "txt": "not this one"},
        {"__key__": "a/1", "jpg": IMAGE_0, "en.txt": "english", "txt": "nor this"},
        {"__key__": "a/2", "jpg": IMAGE_0, "txt": "no caption member"},
    ]
    shard = write_shard(tmp_path / "s.tar", samples)
    raw = shard.read_bytes()
    pairs = list(iter_pairs(str(shard), ReadOptions(caption_field=".caption")))
    assert [p.status for p in pairs] == ["ok", schema.STATUS_MISSING_TEXT, schema.STATUS_MISSING_TEXT]
    assert pairs[0].text == "caf\xe9 caption"  # decoded as a txt member is (Windows-1252 byte kept)
    offset, size = pairs[0].caption_span
    assert raw[offset : offset + size] == "caf\xe9 caption".encode("latin-1")
    assert pairs[2].error == "no caption member (its fields: jpg, txt)"
    assert [p.text for p in iter_pairs(str(shard), ReadOptions(caption_field=".EN.txt"))][1] == "english"
    for bad in (".", ".jpg", ".json"):
        with pytest.raises(InputError, match="a leading dot names a text member"):
            ReadOptions(caption_field=bad)


def test_compressed_tars_have_no_spans(tmp_path: Path) -> None:
    plain = write_shard(tmp_path / "s.tar", _samples())
    packed = tmp_path / "s.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    pairs = list(iter_pairs(str(packed)))
    assert pairs[0].image == IMAGE_0
    assert all(p.image_span is None and p.caption_span is None for p in pairs)


def test_read_member_local_bounds(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "s.tar", _samples())
    first = next(iter(iter_pairs(str(shard))))
    assert read_member(str(shard), *first.image_span, max_bytes=1024) == first.image
    assert read_member(f"file://{shard}", *first.image_span, max_bytes=1024) == first.image
    with pytest.raises(MemberTooLarge):
        read_member(str(shard), first.image_span[0], first.image_span[1], max_bytes=first.image_span[1] - 1)
    with pytest.raises(ShardReadError, match="ends before"):
        read_member(str(shard), shard.stat().st_size - 4, 100, max_bytes=1024)
    with pytest.raises(InputError):
        read_member(str(shard), -1, 4, max_bytes=1024)
    with pytest.raises(ShardNotFoundError):
        read_member(str(tmp_path / "gone.tar"), 0, 4, max_bytes=1024)


def test_a_member_is_read_only_at_a_tar_header_of_its_size_and_inside_the_roots_as_opened(tmp_path: Path) -> None:
    """The pages read members at offsets from a job's own tables, which their owner can edit:
    a shard path swapped for a link to another file (another tenant's job.json, /etc/passwd)
    had its bytes shown as a caption."""
    import os

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shard = write_shard(inputs / "s.tar", _samples())
    pairs = list(iter_pairs(str(shard)))
    for pair in pairs:  # every recorded span, long PAX names included, has its header before it
        for span, member in ((pair.image_span, pair.image), (pair.caption_span, None)):
            if span is not None:
                got = read_member(str(shard), *span, max_bytes=1 << 20, tar_header=True, local_roots=[str(inputs)])
                assert member is None or got == member
    secret = tmp_path / "inputs" / "job.json"
    secret.write_text('{"shards": ["s3://team-a/private"]}' + " " * 20000)
    offset, size = pairs[0].caption_span
    link = inputs / "swapped.tar"
    link.symlink_to(secret)
    with pytest.raises(ShardReadError, match="no tar member header|not the one scored"):
        read_member(str(link), offset, size, max_bytes=1 << 20, tar_header=True)
    with pytest.raises(ShardReadError, match="not the one scored"):  # a header there, of another size
        read_member(str(shard), offset, size + 1, max_bytes=1 << 20, tar_header=True)
    with pytest.raises(ShardReadError, match="no tar header before"):
        read_member(str(shard), 100, 4, max_bytes=1 << 20, tar_header=True)
    outside = tmp_path / "outside.tar"
    os.replace(write_shard(tmp_path / "o.tar", _samples()), outside)
    (inputs / "out.tar").symlink_to(outside)  # resolves outside the roots as opened
    with pytest.raises(InputError, match="outside the locations"):
        read_member(str(inputs / "out.tar"), offset, size, max_bytes=1 << 20, tar_header=True, local_roots=[str(inputs)])


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_read_member_over_http_needs_range_support_and_the_allow_list(tmp_path: Path, loopback_http) -> None:
    shard = write_shard(tmp_path / "s.tar", _samples())
    first = next(iter(iter_pairs(str(shard))))
    base = loopback_http(partial(_Quiet, directory=str(tmp_path)))
    # Python's SimpleHTTPRequestHandler ignores Range (answers 200): refused, not downloaded whole
    with pytest.raises(ShardReadError, match="range requests"):
        read_member(f"{base}/s.tar", *first.image_span, max_bytes=1024)
    with pytest.raises(ShardReadError, match="outside the allowed"):
        read_member(f"{base}/s.tar", *first.image_span, max_bytes=1024, http_allowed=["http://other.example/"])


def test_score_tables_carry_the_member_columns(tmp_path: Path) -> None:
    from pairclean_workers.cli import main

    import pyarrow.parquet as pq

    shard = write_shard(tmp_path / "s.tar", _samples())
    out = tmp_path / "out"
    assert main(["score", str(shard), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    table = pq.read_table(out / "s.parquet")
    assert table.column_names[-4:] == list(schema.MEMBER_COLUMNS)
    raw = shard.read_bytes()
    rows = table.to_pylist()
    offset, size = rows[0]["image_offset"], rows[0]["image_size"]
    assert raw[offset : offset + size] == IMAGE_0
    assert rows[2]["caption_offset"] is None and rows[3]["image_offset"] is None
    # rescoring keeps them
    assert main(["rescore", str(out), "--beta-recipe", "shuffled", "--weighting", "reference"]) == 0
    assert pq.read_table(out / "s.parquet").select(list(schema.MEMBER_COLUMNS)).equals(table.select(list(schema.MEMBER_COLUMNS)))
