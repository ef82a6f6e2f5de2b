"""Reading WebDataset shards: key rule, captions, metadata, broken tars."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from pairclean import schema
from pairclean.read.decode import DecodeFailure, decode_image
from pairclean.errors import ShardReadError
from pairclean.lite.evaldata import write_shard
from pairclean.read.shards import ReadOptions, iter_pairs, iter_raw_samples_from, split_member_name


def test_key_rule_matches_webdataset() -> None:
    assert split_member_name("a/b.c/img001.seg.png") == ("a/b.c/img001", "seg.png")
    assert split_member_name("x.JPG") == ("x", "jpg")
    assert split_member_name("noext") is None
    # WebDataset's own rule for meta members: "__x__" alone or as a top folder, and top-level
    # names that begin and end with "__"; "__0001__.jpg" is a sample it yields (no weight row before)
    assert split_member_name("__index__") is None and split_member_name("__meta__/x.jpg") is None
    assert split_member_name("__0001__.jpg") == ("__0001__", "jpg")
    assert split_member_name("dir/__x__.txt") == ("dir/__x__", "txt")
    import re as _re

    from webdataset.tariterators import meta_prefix, meta_suffix

    for name in ("__index__", "__meta__/x.jpg", "__0001__.jpg", "dir/__x__.txt", "a/__b__c__.txt", "__init__", "__a__.json"):
        skipped = bool(_re.match(r"__[^/]*__($|/)", name)) or ("/" not in name and name.startswith(meta_prefix)
                                                               and name.endswith(meta_suffix))
        assert (split_member_name(name) is None) == skipped, name


def test_hostile_json_and_text_become_rows_never_a_dead_job() -> None:
    """Round 3 of the text attack: a json integer of 5,000 digits (ValueError) and a lone high
    surrogate in ``uid`` (valid JSON; UnicodeEncodeError) killed the job at every rerun; a
    UTF-8 caption padded with NULs was read as UTF-16; a Latin-1 json lost its caption; a
    caption of punctuation or invisible letters was scored as text."""
    from pairclean import schema
    from pairclean.read.shards import RawSample, decode_caption, to_pair

    jpg = b"\xff\xd8 not decoded here"

    def pair(**files: bytes) -> tuple[str, str | None, str | None]:
        got = to_pair(RawSample("k", 0, {"jpg": jpg, **files}))
        return got.status, got.text, got.uid

    status, _, _ = pair(json=b'{"uid": ' + b"9" * 5000 + b', "caption": "a dog"}')
    assert status == schema.STATUS_MISSING_TEXT
    assert pair(txt=b"a dog", json=b'{"uid": "\\ud800x", "url": "\\udfff"}') == (schema.STATUS_OK, "a dog", "\\ud800x")
    assert pair(json=b'{"caption": "a dog \\ud800"}') == (schema.STATUS_OK, "a dog \\ud800", None)
    assert decode_caption(b"a dog on grass" + b"\x00" * 200) == "a dog on grass"
    assert decode_caption("a dog".encode("utf-16-le") + b"\x00" * 4) == "a dog"
    assert pair(json='{"caption": "caf\u00e9 au lait"}'.encode("latin-1"))[:2] == (schema.STATUS_OK, "caf\u00e9 au lait")
    for junk in ("!!!???...,,,;;;", "\u0301", "\ufffd", "\u3164\uffa0", "\u2800", "\u034f\ufe0f"):
        assert pair(txt=junk.encode())[0] == schema.STATUS_EMPTY_TEXT, junk
    for text in ("\U0001f436", "42", "a", "\u72ac"):
        assert pair(txt=text.encode())[0] == schema.STATUS_OK, text


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


def test_a_thin_strip_of_an_image_is_refused_before_it_is_resized() -> None:
    from PIL import Image

    from pairclean.read.decode import MAX_ASPECT

    # A 200-byte 40000x1 PNG: its short side resized to 224 px would be 224 x 9 million pixels.
    buf = io.BytesIO()
    Image.new("RGB", (40000, 1)).save(buf, format="PNG")
    result = decode_image(buf.getvalue())
    assert isinstance(result, DecodeFailure) and result.status == schema.STATUS_TOO_LARGE and "40000x1" in result.error
    buf = io.BytesIO()
    Image.new("RGB", (MAX_ASPECT * 10, 10)).save(buf, format="PNG")  # a panorama at the limit still decodes
    assert not isinstance(decode_image(buf.getvalue()), DecodeFailure)


def test_a_transform_that_fails_on_one_image_gives_that_row_a_status() -> None:
    from PIL import Image

    from pairclean.read.decode import decode_and_preprocess

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")

    def broken(img: object) -> object:
        raise MemoryError("cannot allocate")

    result = decode_and_preprocess(buf.getvalue(), 10_000, broken)
    assert isinstance(result, DecodeFailure) and result.status == schema.STATUS_DECODE_ERROR
    assert result.error == "preprocess failed: MemoryError: cannot allocate"


# -- hostile and broken tars (issue 10) ---------------------------------------------------

def _tar(path: Path, members: list[tuple[str, bytes]], links: tuple[str, ...] = ()) -> Path:
    import tarfile

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


def test_member_over_the_limit_is_a_too_large_row_and_the_rest_still_reads(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "big.tar", [("a.jpg", b"\xff" * 100), ("a.txt", b"ok"), ("b.jpg", b"\xff" * 5000), ("b.txt", b"big"),
                                        ("c.jpg", b"\xff" * 10), ("c.txt", b"after")])
    pairs = list(iter_pairs(str(shard), ReadOptions(max_member_bytes=1000)))
    assert [(p.key, p.status) for p in pairs] == [("a", "ok"), ("b", "too_large"), ("c", "ok")]
    assert pairs[1].image is None and "5000 bytes" in (pairs[1].error or "")
    assert pairs[2].text == "after"  # the skipped member's bytes were stepped over, not misread


def test_shard_cut_at_a_member_boundary_is_an_error_not_a_shorter_shard(tmp_path: Path) -> None:
    members = [(f"{i}.{ext}", b"x" * 600) for i in range(4) for ext in ("jpg", "txt")]
    good = _tar(tmp_path / "g.tar", members)
    data = good.read_bytes()
    # Each member is one 512-byte header plus 1024 bytes of data: cut after the 4th member,
    # exactly where the 5th header would start (tarfile alone reads this as 2 clean samples).
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: 4 * 1536])
    with pytest.raises(ShardReadError, match="cut.tar.*truncated"):
        list(iter_pairs(str(cut)))
    # A corrupt header after the first member: tarfile would end the archive silently.
    bad = bytearray(data)
    bad[2 * 1536 + 148 : 2 * 1536 + 156] = b"9999999\0"  # the 3rd header's checksum field
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(ShardReadError, match="corrupt header"):
        list(iter_pairs(str(corrupt)))
    assert len(list(iter_pairs(str(good)))) == 4


def _parser_of_2025_security_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tarfile`` parse headers as CPython builds with the 2025 tarfile security fixes
    do: ``fromtarfile`` reads the block and parses it without calling ``frombuf``, so a
    subclass's ``frombuf`` never sees it."""
    import tarfile

    parse = tarfile.TarInfo.frombuf.__func__  # type: ignore[attr-defined]

    def fromtarfile(cls: type[tarfile.TarInfo], tar: tarfile.TarFile) -> tarfile.TarInfo:
        buf = tar.fileobj.read(tarfile.BLOCKSIZE)  # type: ignore[union-attr]
        obj = parse(cls, buf, tar.encoding, tar.errors)  # the base parser, never a subclass's frombuf
        obj.offset = tar.fileobj.tell() - tarfile.BLOCKSIZE  # type: ignore[union-attr]
        return obj._proc_member(tar)  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(tarfile.TarInfo, "fromtarfile", classmethod(fromtarfile))


def test_whole_and_broken_shards_are_told_apart_on_pythons_whose_tarfile_parses_headers_privately(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an up-to-date Python every whole shard read as truncated when the end-of-archive
    check hooked ``TarInfo.frombuf`` (found on a GPU machine's Python 3.12)."""
    _parser_of_2025_security_releases(monkeypatch)
    members = [(f"{i}.{ext}", b"x" * 600) for i in range(4) for ext in ("jpg", "txt")]
    good = _tar(tmp_path / "g.tar", members)
    data = good.read_bytes()
    assert [p.key for p in iter_pairs(str(good))] == ["0", "1", "2", "3"]
    gz = tmp_path / "g.tar.gz"
    gz.write_bytes(gzip.compress(data))
    assert len(list(iter_pairs(str(gz)))) == 4
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: 4 * 1536])
    with pytest.raises(ShardReadError, match="cut.tar.*truncated"):
        list(iter_pairs(str(cut)))
    bad = bytearray(data)
    bad[2 * 1536 + 148 : 2 * 1536 + 156] = b"9999999\0"
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(ShardReadError, match="corrupt header"):
        list(iter_pairs(str(corrupt)))


@pytest.mark.parametrize("compress", [False, True])
def test_data_after_the_end_marker_is_an_error_not_a_shorter_shard(tmp_path: Path, compress: bool) -> None:
    members = [(f"{i}.{ext}", b"x" * 600) for i in range(4) for ext in ("jpg", "txt")]
    good = _tar(tmp_path / "g.tar", members).read_bytes()
    other = _tar(tmp_path / "o.tar", [("z.jpg", b"y" * 10), ("z.txt", b"other")]).read_bytes()
    zeroed = bytearray(good)
    zeroed[4 * 1536 : 4 * 1536 + 512] = bytes(512)  # the 5th header wiped, as by a disk hole
    cases = {"joined": good + other, "zeroed": bytes(zeroed), "appended": good + b"junk" * 10}
    for name, data in {"good": good, **cases}.items():
        path = tmp_path / f"{name}.tar{'.gz' if compress else ''}"
        path.write_bytes(gzip.compress(data) if compress else data)
        if name == "good":
            assert len(list(iter_pairs(str(path)))) == 4  # zero padding after the marker is fine
            continue
        # tarfile alone stops at the first zero block: 4 (or 2) samples, and no error
        with pytest.raises(ShardReadError, match=f"{name}.tar.*after its end-of-archive marker"):
            list(iter_pairs(str(path)))


def test_duplicate_keys_fields_and_link_members_become_status_rows(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "d.tar", [("a.jpg", b"1"), ("a.txt", b"first"), ("b.jpg", b"2"), ("b.txt", b"x"), ("b.txt", b"again"),
                                      ("a.jpg", b"3"), ("a.txt", b"second")], links=("c.jpg",))
    pairs = list(iter_pairs(str(shard)))
    assert [(p.key, p.status) for p in pairs] == [("a", "ok"), ("b", "duplicate_key"), ("a", "duplicate_key"), ("c", "link_member")]
    assert pairs[0].text == "first"  # never overwritten by the later duplicate


def test_captions_are_bounded_and_blank_or_non_text_captions_are_rows_with_a_status(tmp_path: Path) -> None:
    import json

    from pairclean.read.shards import MAX_CAPTION_CHARS

    shard = _tar(tmp_path / "c.tar", [
        ("long.jpg", b"1"), ("long.txt", b"a dog " * 1_000_000),
        ("zw.jpg", b"2"), ("zw.txt", "\u200b\u00a0 \ufeff".encode()),
        ("list.jpg", b"3"), ("list.json", json.dumps({"caption": ["a", "b"]}).encode()),
        ("num.jpg", b"4"), ("num.json", json.dumps({"caption": 12345}).encode()),
    ])
    pairs = {p.key: p for p in iter_pairs(str(shard))}
    assert pairs["long"].status == "ok" and pairs["long"].text == ("a dog " * 2000)[:MAX_CAPTION_CHARS]
    assert pairs["zw"].status == "empty_text"
    assert pairs["list"].status == "missing_text" and pairs["list"].error == "json caption is a list, not text"
    assert (pairs["num"].status, pairs["num"].text) == ("ok", "12345")
    dots = list(iter_pairs(str(_tar(tmp_path / "d.tar", [("a.v1.jpg", b"1"), ("a.v1.txt", b"x")]))))
    assert dots[0].status == "missing_image" and dots[0].error == "no jpg/jpeg/png/webp member (its fields: v1.jpg, v1.txt)"


def test_captions_in_a_legacy_encoding_utf_16_or_with_stray_bytes_are_read_as_meant(tmp_path: Path) -> None:
    from pairclean.read.shards import MAX_CAPTION_CHARS

    long_accents = "é" * (4 * MAX_CAPTION_CHARS)  # 2 bytes each: the byte bound cuts it, maybe mid-character
    shard = _tar(tmp_path / "enc.tar", [
        ("latin.jpg", b"1"), ("latin.txt", "un café crème, 5 € à Zürich".encode("cp1252")),
        ("utf8.jpg", b"2"), ("utf8.txt", "un café crème à Zürich".encode()),
        ("bom.jpg", b"3"), ("bom.txt", "\ufeffa dog on grass".encode()),
        ("long.jpg", b"4"), ("long.txt", ("x" + long_accents).encode()),
        ("undefined.jpg", b"5"), ("undefined.txt", b"a \x81 dog caf\xe9"),
        ("mixed.jpg", b"6"), ("mixed.txt", b"caf\xc3\xa9 cr\xe8me br\xc3\xbbl\xc3\xa9e"),  # one stray Latin-1 byte
        ("cutelse.jpg", b"7"), ("cutelse.txt", ("é" * 5).encode()[:-1]),  # cut mid-character by another tool
        ("utf16.jpg", b"8"), ("utf16.txt", "a dog ü".encode("utf-16")),  # with its byte-order mark
        ("utf16nobom.jpg", b"9"), ("utf16nobom.txt", "a dog on grass".encode("utf-16-le")),
    ])
    pairs = {p.key: p for p in iter_pairs(str(shard))}
    assert pairs["latin"].text == "un café crème, 5 € à Zürich"
    assert pairs["utf8"].text == "un café crème à Zürich"
    assert pairs["bom"].text == "a dog on grass"
    assert pairs["long"].text == ("x" + long_accents)[:MAX_CAPTION_CHARS]  # still UTF-8, not mojibake
    assert pairs["undefined"].text == "a \ufffd dog café"
    assert pairs["mixed"].text == "café crème brûlée" and pairs["cutelse"].text == "éééé"
    assert pairs["utf16"].text == "a dog ü" and pairs["utf16nobom"].text == "a dog on grass"
    assert {p.status for p in pairs.values()} == {"ok"}


def test_sixteen_bit_png_keeps_its_tones_instead_of_clipping() -> None:
    import numpy as np
    from PIL import Image

    ramp = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")
    img = decode_image(buf.getvalue())
    assert not isinstance(img, DecodeFailure) and img.mode == "RGB"
    pixels = np.asarray(img)[..., 0].astype(float)
    expected = ramp / 65535 * 255
    assert abs(pixels.mean() - expected.mean()) < 1.0  # PIL's own convert gives a mean of ~254
    assert pixels.min() == 0 and pixels.max() >= 254


def test_gzip_is_read_whole_checked_and_never_short(tmp_path: Path) -> None:
    """tarfile's own "r|gz" read the first gzip member only and checked no CRC: two .tar.gz
    joined with cat were read short without a word, a multi-member gzip of one tar failed as
    truncated, corrupted compressed data was scored and garbage after the gzip ignored."""
    members = [(f"{i}.{ext}", bytes([65 + i]) * 700) for i in range(4) for ext in ("jpg", "txt")]
    raw = _tar(tmp_path / "g.tar", members).read_bytes()
    other = gzip.compress(_tar(tmp_path / "o.tar", [("z.jpg", b"y" * 10), ("z.txt", b"other")]).read_bytes())
    half = len(raw) // 2
    multi = gzip.compress(raw[:half]) + gzip.compress(raw[half:])  # one tar in two gzip members (pigz, bgzip)
    flipped = bytearray(gzip.compress(raw))
    flipped[len(flipped) // 2] ^= 0x10
    crc = bytearray(gzip.compress(raw))
    crc[-6] ^= 0xFF  # the CRC field damaged, the data intact
    cases = {"multi": (multi, None), "joined": (gzip.compress(raw) + other, "after its end-of-archive marker"),
             "garbage": (gzip.compress(raw) + b"GARBAGE!", "Not a gzipped file"), "flipped": (bytes(flipped), ""),
             "crc": (bytes(crc), "CRC check failed")}
    for name, (data, error) in cases.items():
        path = tmp_path / f"{name}.tar.gz"
        path.write_bytes(data)
        if error is None:
            assert [p.key for p in iter_pairs(str(path))] == ["0", "1", "2", "3"]
            continue
        with pytest.raises(ShardReadError, match=f"{name}.tar.gz.*{error}"):
            list(iter_pairs(str(path)))


def test_a_sample_cannot_make_the_reader_hold_what_it_does_not_use(tmp_path: Path) -> None:
    """Every field of a sample was read into memory, used or not (16 unused 60 MiB fields in
    a 1 MB .tar.gz), and pax headers are read whole by tarfile (one of 800 MiB)."""
    import tarfile
    import tracemalloc

    big = b"\0" * (40 * 2**20)
    path = tmp_path / "fields.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [("a.jpg", b"\xff" * 10), ("a.txt", b"a caption")] + [(f"a.extra{i}", big) for i in range(12)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tracemalloc.start()
    try:
        pairs = list(iter_pairs(str(path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(p.key, p.status, p.text) for p in pairs] == [("a", "ok", "a caption")]
    assert peak < 32 * 2**20  # not the 480 MiB of fields
    pax = tmp_path / "pax.tar"
    with tarfile.open(pax, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("b.txt")
        info.pax_headers = {"comment": "x" * (2 * 2**20)}
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ShardReadError, match="a pax header of .* bytes"):  # refused before tarfile reads it
        list(iter_pairs(str(pax)))


def test_declared_sizes_pax_headers_zero_tails_and_deep_json_are_bounded(tmp_path: Path) -> None:
    """Found attacking the reader: a pax size of 10**30 had tarfile skip the member by ~10**25
    reads of the ended stream (a run spinning for good); a pax header of digits is parsed in
    quadratic time holding the GIL on Pythons before 3.11.10 (CVE-2024-6232); a shard whose
    tail was zeroed (a preallocated download cut short) read as 13 of its 40 samples; a json
    member of 1,000 nested '[' crashed the job."""
    import time

    huge = tmp_path / "huge.tar"
    with tarfile.open(huge, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"cap"))
        info = tarfile.TarInfo("b.jpg")
        info.pax_headers = {"size": str(10**30)}
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    started = time.monotonic()
    with pytest.raises(ShardReadError, match="declares 10{30} bytes"):
        list(iter_pairs(str(huge)))
    assert time.monotonic() - started < 10
    digits = tmp_path / "digits.tar"
    with tarfile.open(digits, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("c.txt")
        info.pax_headers = {"comment": "1" * 20_000}
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ShardReadError, match="a pax header of .* bytes"):
        list(iter_pairs(str(digits)))
    samples = [{"__key__": f"k{i:03d}", "txt": f"caption {i}".encode(), "bin": os.urandom(20_000)} for i in range(40)]
    cut = write_shard(tmp_path / "cut.tar", samples)
    data = bytearray(cut.read_bytes())
    data[len(data) // 3 :] = bytes(len(data) - len(data) // 3)  # the tail zeroed, the size kept
    cut.write_bytes(bytes(data))
    with pytest.raises(ShardReadError, match="bytes after its end-of-archive marker"):
        list(iter_pairs(str(cut)))
    nested = write_shard(tmp_path / "nested.tar", [{"__key__": "n", "txt": b"a caption", "json": b"[" * 1000 + b"]" * 1000},
                                                   {"__key__": "m", "txt": b"another"}])
    assert [p.key for p in iter_pairs(str(nested))] == ["n", "m"]


def test_round_5_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain tar whose first member's name starts like a bzip2 header ("BZhang_0001") was
    refused as bzip2; the size recorded for a shard was its file's after scoring, not that of
    the bytes read (a file replaced meanwhile kept a stale table for good); keys of a million
    characters went into the table; a batch held up to 32 members of 64 MiB."""
    from pairclean.embed.shard import ScoreOptions, _batches
    from pairclean.read.shards import MAX_KEY_CHARS, PairSample, ReadStats

    named = _tar(tmp_path / "bzh.tar", [("BZhang_0001.jpg", b"\xff" * 10), ("BZhang_0001.txt", b"a caption")])
    assert [p.key for p in iter_pairs(str(named))] == ["BZhang_0001"]
    import bz2

    packed = tmp_path / "real.tar.bz2"
    packed.write_bytes(bz2.compress(named.read_bytes()))
    assert [p.key for p in iter_pairs(str(packed))] == ["BZhang_0001"]

    old = _tar(tmp_path / "s.tar", [(f"{i}.{ext}", b"x" * 600) for i in range(6) for ext in ("jpg", "txt")])
    size = old.stat().st_size
    new = _tar(tmp_path / "new.tar", [("n.jpg", b"y"), ("n.txt", b"z")])
    stats = ReadStats()
    pairs = iter_pairs(str(old), stats=stats)
    first = next(pairs)
    new.replace(old)  # a re-download moved over the shard while it is read
    assert [first.key, *(p.key for p in pairs)] == ["0", "1", "2", "3", "4", "5"]
    assert stats.bytes == size != old.stat().st_size

    long_key = _tar(tmp_path / "long.tar", [("k" * (MAX_KEY_CHARS + 1) + ".txt", b"x")])
    with pytest.raises(ShardReadError, match=f"over the {MAX_KEY_CHARS}-character limit"):
        list(iter_pairs(str(long_key)))

    monkeypatch.setattr("pairclean.embed.shard.BATCH_IMAGE_BYTES", 1000)
    rows = [PairSample(f"{i}", i, b"\xff" * 400, "c", "ok") for i in range(7)]
    assert [len(b) for b in _batches("mem", ScoreOptions(batch_size=32), rows)] == [3, 3, 1]


def test_a_shard_past_its_deadline_stops_mid_member_not_after_it(tmp_path: Path) -> None:
    """A .tar.gz of zeros expands a thousandfold, all of it decompressed to be skipped, in one
    member and before any pair is yielded: nothing between pairs or batches sees that time.
    With a deadline the reader stops inside the member (``ShardTimeoutError``, one line naming
    the shard and the limit); without one it reads the shard whole."""
    import tarfile
    import time

    from pairclean.errors import ShardTimeoutError
    from pairclean.read.shards import Deadline

    class _Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.left = n

        def readable(self) -> bool:
            return True

        def readinto(self, b: bytearray) -> int:  # type: ignore[override]
            k = min(len(b), self.left)
            b[:k] = bytes(k)
            self.left -= k
            return k

    path = tmp_path / "bomb.tar.gz"
    size = 512 * 2**20
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in (("a.jpg", b"\xff" * 10), ("a.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("a.npy")  # a field no pair reads: skipped, so decompressed
        info.size = size
        tar.addfile(info, io.BufferedReader(_Zeros(size)))
    assert path.stat().st_size < size // 100
    reads: list[int] = []
    from pairclean.read import shards as shards_mod

    real = shards_mod._Counting.read

    def counted(self: object, n: int = -1) -> bytes:
        data = real(self, n)  # type: ignore[arg-type]
        reads.append(len(data))
        return data

    shards_mod._Counting.read = counted  # type: ignore[method-assign]
    try:
        with pytest.raises(ShardTimeoutError) as caught:
            list(iter_pairs(str(path), deadline=Deadline(time.monotonic() + 0.05, 0.05)))
        cut_at = sum(reads)
        reads.clear()
        assert [p.key for p in iter_pairs(str(path))] == ["a"]
        whole = sum(reads)
    finally:
        shards_mod._Counting.read = real  # type: ignore[method-assign]
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "0.05 s limit" in message
    assert cut_at < whole // 2  # stopped inside the member, not after reading it all
    with pytest.raises(ShardTimeoutError):  # a deadline already past: not a byte of it
        list(iter_pairs(str(path), deadline=Deadline(time.monotonic() - 1, 1)))


def test_a_key_that_is_not_utf8_is_a_row_with_its_bytes_escaped(tmp_path: Path) -> None:
    """Member names are decoded with surrogateescape: one sample named with a stray byte held
    lone surrogates, which no Parquet or JSON writer takes, and failed its whole job with a
    traceback (every time, so a shard author could kill every job that read the shard)."""
    import tarfile

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for name, data in (("k\udcff.jpg", b"\xff"), ("k\udcff.txt", b"a caption"), ("k\udcff.x\udcfe", b"?"),
                           ("fine.jpg", b"\xff"), ("fine.txt", b"fine")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pairs = list(iter_pairs(str(path)))
    assert [(p.key, p.status) for p in pairs] == [("k\\xff", schema.STATUS_BAD_KEY), ("fine", "ok")]
    for p in pairs:
        (p.key + (p.error or "")).encode("utf-8")  # writable as it is


def test_long_json_fields_are_cut_and_a_connection_dropped_mid_shard_is_the_shards_error(tmp_path: Path) -> None:
    """2 MB json urls were carried into every row (GBs for a small shard); a server that
    closed the connection mid-body raised aiohttp's ClientPayloadError, no OSError: a
    traceback that ended the whole job."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pairclean.read.shards import MAX_FIELD_CHARS

    shard = write_shard(tmp_path / "long.tar", [{"__key__": "a", "jpg": b"x", "txt": b"a caption",
                                                 "json": {"url": "http://h/" + "u" * 100_000, "uid": "1" * 50_000}}])
    (pair,) = list(iter_pairs(str(shard)))
    assert len(pair.url) == MAX_FIELD_CHARS and len(pair.uid) == MAX_FIELD_CHARS
    body = shard.read_bytes()

    class Short(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) + 50_000))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Short)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ShardReadError, match="unreadable tar"):
            list(iter_pairs(f"http://127.0.0.1:{server.server_address[1]}/s.tar"))
    finally:
        server.shutdown()


def test_sixteen_bit_png_is_rescaled_without_float_copies_of_the_picture() -> None:
    """A 16-bit picture was rescaled in float64 whole: five 8-byte copies of every pixel
    at once (1.5 GB for a 64-megapixel PNG the pixel cap admits). Now a band of rows at a
    time: numpy's allocations stay near the picture's own array and its 8-bit result."""
    import tracemalloc

    import numpy as np
    from PIL import Image

    width, height = 2000, 1500
    ramp = (np.arange(width * height, dtype=np.uint64).reshape(height, width) % 65536).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG", compress_level=1)
    data = buf.getvalue()
    tracemalloc.start()
    try:
        img = decode_image(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not isinstance(img, DecodeFailure) and img.size == (width, height)
    pixels = width * height
    # 5.7 bytes a pixel (PIL hands numpy its 2-byte pixels through a joined bytes copy); 24 whole in float64
    assert peak < 8 * pixels, f"{peak / pixels:.1f} bytes a pixel"
    got = np.asarray(img)[..., 0].astype(float)
    assert abs(got - ramp / 65535 * 255).max() <= 0.51


def test_a_sample_of_fifo_or_device_members_is_a_row_not_skipped(tmp_path: Path) -> None:
    """FIFO and device members were skipped like folders, so a sample made only of them had
    no row at all: the shard's table was silently one sample short."""
    import tarfile

    path = tmp_path / "special.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        folder = tarfile.TarInfo("sub")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a folder entry: no row
        members: list[tuple[str, bytes]] = [  # FIFOTYPE and CHRTYPE are one-byte type flags
            ("f.jpg", tarfile.FIFOTYPE), ("f.txt", tarfile.FIFOTYPE), ("d.jpg", tarfile.CHRTYPE),
            ("d.txt", b"a device beside me"), ("ok.jpg", b"\xff" * 10), ("ok.txt", b"fine"), ("ok.extra", tarfile.FIFOTYPE)]
        for name, what in members:
            info = tarfile.TarInfo(name)
            if what in (tarfile.FIFOTYPE, tarfile.CHRTYPE):
                info.type = what
                tar.addfile(info)
            else:
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
    pairs = list(iter_pairs(str(path)))
    assert [(p.key, p.status) for p in pairs] == [("f", "link_member"), ("d", "link_member"), ("ok", "ok")]
    assert "is a FIFO; not read" in (pairs[0].error or "") and "is a device; not read" in (pairs[1].error or "")
    with path.open("rb") as fh:  # a field the pair does not read is never judged, as for links
        raw = list(iter_raw_samples_from(fh, str(path), fields=lambda field: field in ("jpg", "txt")))
    assert [(r.key, r.issue is None) for r in raw] == [("f", False), ("d", False), ("ok", True)]


def _jpeg(progressive: bool = False, size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (90, 140, 200)).save(buf, format="JPEG", progressive=progressive, quality=80)
    return buf.getvalue()


def test_jpeg_scan_and_marker_bombs_are_refused_before_decoding() -> None:
    """A progressive JPEG of 2,000 empty refinement scans (319 kB) decoded for 42 s, past
    any shard time limit, and 16 million empty APP5 markers (64 MiB) took 2.2 GB inside
    PIL's open. Both are counted from the marker headers first and refused as rows."""
    import time

    from pairclean.read.decode import MAX_JPEG_SCANS, MAX_JPEG_SEGMENTS, jpeg_structure_problem

    plain, progressive = _jpeg(), _jpeg(progressive=True)
    assert jpeg_structure_problem(plain) is None and jpeg_structure_problem(progressive) is None
    assert not isinstance(decode_image(progressive), DecodeFailure)  # a normal progressive JPEG (about 10 scans) reads
    last_scan = progressive.rindex(b"\xff\xda")
    scans = progressive[:last_scan] + progressive[last_scan:-2] * (MAX_JPEG_SCANS + 50) + b"\xff\xd9"
    markers = plain[:2] + b"\xff\xe5\x00\x02" * (MAX_JPEG_SEGMENTS + 1) + plain[2:]
    few_markers = plain[:2] + b"\xff\xe5\x00\x02" * 20 + plain[2:]
    assert not isinstance(decode_image(few_markers), DecodeFailure)
    for data, words in ((scans, "scans, over the limit"), (markers, "marker segments")):
        started = time.perf_counter()
        failed = decode_image(data)
        assert isinstance(failed, DecodeFailure) and failed.status == "decode_error" and words in failed.error, failed
        assert time.perf_counter() - started < 1.0


def test_only_web_image_formats_are_opened_whatever_the_extension() -> None:
    """An ICO decodes its largest picture inside Image.open, before the pixel cap is read
    (a 657 kB ICO held 169 megapixels); formats outside ``IMAGE_FORMATS`` are refused unread."""
    from PIL import Image

    from pairclean.read.decode import IMAGE_FORMATS

    def saved(fmt: str, **kw: object) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format=fmt, **kw)
        return buf.getvalue()

    for fmt in ("PNG", "GIF", "BMP", "TIFF", "WEBP"):
        assert fmt in IMAGE_FORMATS and not isinstance(decode_image(saved(fmt)), DecodeFailure), fmt
    for fmt in ("ICO", "TGA", "PCX"):
        failed = decode_image(saved(fmt))
        assert isinstance(failed, DecodeFailure) and "cannot identify image file: not JPEG, PNG" in failed.error, fmt
    assert not isinstance(decode_image(saved("PPM")), DecodeFailure)  # api.score_pairs' encoding of decoded arrays


def test_decoder_warnings_never_reach_the_log() -> None:
    """warnings.catch_warnings resets Python's once-per-place registry on every call, so a
    warning PIL raises while decoding printed again for every image (131,070 lines an image
    for a JPEG with 65,535 bad Exif tags). None leaves decode_image now."""
    import struct
    import warnings

    from PIL import Image

    # Exif of 3 tags each declaring more data than the file holds: PIL warns per tag on open
    ifd = struct.pack("<H", 3) + b"".join(struct.pack("<HHLL", 0x10E + i, 1, 10**9, 8) for i in range(3)) + b"\0\0\0\0"
    payload = b"Exif\0\0" + b"II*\x00" + struct.pack("<L", 8) + ifd
    plain = _jpeg()
    data = plain[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + plain[2:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Image.open(io.BytesIO(data)).convert("RGB")
        assert caught, "the fixture no longer makes PIL warn"
        caught.clear()
        assert not isinstance(decode_image(data), DecodeFailure)
    assert not caught, [str(w.message) for w in caught]


def test_png_chunk_and_gif_comment_floods_are_refused_before_opening() -> None:
    """PIL keeps an object per PNG chunk or GIF sub-block while opening: a 64 MiB GIF comment
    of one-byte sub-blocks took 2.85 GB. Counted from block headers first, refused as rows."""
    import struct
    import time
    import zlib

    from PIL import Image

    from pairclean.read.decode import MAX_METADATA_BLOCKS, metadata_problem

    def saved(fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (10, 200, 10)).save(buf, format=fmt)
        return buf.getvalue()

    png, gif = saved("PNG"), saved("GIF")
    chunk = b"tEXt" + b"k\x00v"
    text = struct.pack(">I", 3) + chunk + struct.pack(">I", zlib.crc32(chunk))
    ihdr_end = 8 + 12 + 13
    flood_png = png[:ihdr_end] + text * (MAX_METADATA_BLOCKS + 1) + png[ihdr_end:]
    some_png = png[:ihdr_end] + text * 50 + png[ihdr_end:]
    start = 13 + (3 * (2 << (gif[10] & 7)) if gif[10] & 0x80 else 0)
    comment = b"\x21\xfe" + b"\x01x" * (MAX_METADATA_BLOCKS + 1) + b"\x00"
    flood_gif = gif[:start] + comment + gif[start:]
    some_gif = gif[:start] + b"\x21\xfe" + b"\x01x" * 100 + b"\x00" + gif[start:]
    for data in (png, gif, some_png, some_gif):
        assert metadata_problem(data) is None and not isinstance(decode_image(data), DecodeFailure)
    for data, words in ((flood_png, "chunks before its image data"), (flood_gif, "extension blocks before its first frame")):
        started = time.perf_counter()
        failed = decode_image(data)
        assert isinstance(failed, DecodeFailure) and words in failed.error, failed
        assert time.perf_counter() - started < 1.0


def test_a_stalled_http_read_ends_at_the_shard_time_limit(tmp_path: Path, loopback_http) -> None:
    """An HTTP server that sends part of a shard and then nothing held a reader for the
    fixed 120 s read timeout, whatever ``--shard-timeout`` said. A limit below that now
    bounds one read too, and the failure names the limit."""
    import http.server
    import threading
    import time

    from pairclean.errors import ShardTimeoutError
    from pairclean.read.shards import Deadline

    data = _tar(tmp_path / "s.tar", [(f"{i}.{ext}", b"x" * 3000) for i in range(6) for ext in ("jpg", "txt")]).read_bytes()
    release = threading.Event()

    class Stalling(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:5000])
            self.wfile.flush()
            release.wait(60)

        def log_message(self, *args: object) -> None:
            pass

    url = loopback_http(Stalling) + "/s.tar"
    started = time.monotonic()
    try:
        with pytest.raises(ShardTimeoutError, match="2 s limit"):
            list(iter_pairs(url, deadline=Deadline.after(2.0)))
    finally:
        release.set()
    assert time.monotonic() - started < 15
