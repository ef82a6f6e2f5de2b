"""The pages read a pair's caption from the member its job read it from: the txt member, a
json field (``--caption-field alt``) or another text member (``--caption-field .caption``)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from pairclean.lite.evaldata import write_shard
from pairclean.read.shards import ReadOptions, iter_pairs
from pairclean_service.browse import Browser
from pairclean_service.settings import ServiceSettings


def test_captions_are_read_where_the_job_read_them(tmp_path: Path) -> None:
    sample = {"__key__": "a/0", "jpg": b"\xff\xd8 not decoded here", "txt": "the txt caption", "caption": '{"not": "json"} a member',
              "json": {"alt": "the json field"}}
    shard = str(write_shard(tmp_path / "s.tar", [sample]))
    browser = Browser(ServiceSettings(allowed_inputs=[str(tmp_path)]))
    record = SimpleNamespace(shard=shard)
    for field, expected in ((None, "the txt caption"), ("alt", "the json field"), (".caption", '{"not": "json"} a member')):
        pair = next(iter_pairs(shard, ReadOptions(caption_field=field)))
        assert pair.text == expected
        offset, size = pair.caption_span
        shown = browser._caption(record, offset, size, field, time.monotonic() + 10)  # type: ignore[arg-type]
        assert shown == expected


def test_two_jobs_reading_two_fields_of_one_json_each_see_their_own(tmp_path: Path) -> None:
    """The caption cache was keyed by the member alone: bob's job reading ``alt`` of a shard
    that alice's job reads ``caption`` of put bob's text on alice's pages and in her audit
    queue, whichever page was opened first."""
    sample = {"__key__": "a/0", "jpg": b"\xff\xd8 not decoded here", "json": {"caption": "alice's field", "alt": "BOB-CHOSEN TEXT"}}
    shard = str(write_shard(tmp_path / "s.tar", [sample]))
    browser = Browser(ServiceSettings(allowed_inputs=[str(tmp_path)]))
    record = SimpleNamespace(shard=shard)
    for field in ("alt", "caption", "alt"):
        offset, size = next(iter_pairs(shard, ReadOptions(caption_field=field))).caption_span
        shown = browser._caption(record, offset, size, field, time.monotonic() + 10)  # type: ignore[arg-type]
        assert shown == ("BOB-CHOSEN TEXT" if field == "alt" else "alice's field")


def test_a_progressive_jpeg_over_the_pixel_limit_is_a_placeholder_whatever_its_decode_scale() -> None:
    """libjpeg keeps a progressive JPEG's coefficients at full size however small draft()
    decodes it: a 1 MB 13000 x 13000 one took the API process from 221 to 1200 MiB."""
    import io
    import time

    from PIL import Image

    from pairclean_service.browse import _downscale

    def jpeg(progressive: bool) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (1200, 1000), (90, 140, 200)).save(buf, format="JPEG", progressive=progressive, quality=70)
        return buf.getvalue()

    later = time.monotonic() + 30
    assert _downscale(jpeg(True), 500_000, later) == "image over the thumbnail pixel limit"
    assert isinstance(_downscale(jpeg(False), 500_000, later), bytes)  # baseline: decoded at 1/8, under the limit
    assert isinstance(_downscale(jpeg(True), 2_000_000, later), bytes)  # under the limit at full size


def test_a_json_caption_nested_past_the_parser_is_unreadable_not_a_500(tmp_path: Path) -> None:
    """A json member nested 5,000 deep (10 kB) is its row's error when scored, but its span
    stays the caption's: the shard page parsed it again and answered 500 (RecursionError)
    for every page holding that row."""
    import io
    import tarfile

    nested = b'{"caption": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("a.jpg", b"\xff\xd8 not decoded here"), ("a.json", nested)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        offset = tar.getmember("a.json").offset_data
    browser = Browser(ServiceSettings(allowed_inputs=[str(tmp_path)]))
    shown = browser._caption(SimpleNamespace(shard=str(path)), offset, len(nested), "caption",  # type: ignore[arg-type]
                             time.monotonic() + 10)
    assert shown is None


def test_thumbnails_refuse_scan_bombs_and_formats_not_read_before_decoding() -> None:
    """A 95 kB progressive JPEG of 2,000 scans held a decode slot for 12 s, past the 10 s
    thumbnail deadline; an ICO decoded its 13000 x 13000 picture inside Image.open."""
    import io

    from PIL import Image

    from pairclean_service.browse import _downscale

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 200)).save(buf, format="JPEG", progressive=True)
    progressive = buf.getvalue()
    last = progressive.rindex(b"\xff\xda")
    bomb = progressive[:last] + progressive[last:-2] * 300 + b"\xff\xd9"
    ico = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(ico, format="ICO")
    later = time.monotonic() + 30
    assert isinstance(_downscale(progressive, 500_000, later), bytes)
    started = time.perf_counter()
    assert _downscale(bomb, 500_000, later) == "image cannot be decoded"
    assert _downscale(ico.getvalue(), 500_000, later) == "image cannot be decoded"
    assert time.perf_counter() - started < 1.0
