"""Reading WebDataset shards: tar members grouped into samples, then into image-caption pairs.

Grouping follows WebDataset's key rule: a member ``dir/name.ext1.ext2`` belongs to the
sample with ``__key__`` ``dir/name`` (everything up to the first dot of the file name)
and carries the field ``ext1.ext2`` (lower-cased). Consecutive members with the same key
form one sample. Keys are kept exactly as written in the tar.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import schema
from .errors import ShardReadError
from .uris import open_shard

__all__ = [
    "IMAGE_EXTS",
    "RawSample",
    "PairSample",
    "ReadOptions",
    "split_member_name",
    "iter_raw_samples",
    "to_pair",
    "iter_pairs",
]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
# WebDataset's base_plus_ext rule: key = dirname + basename up to the first dot.
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)\.([^/]*)$")
# Tar members like __index__.json are WebDataset metadata, not samples.
_META_RE = re.compile(r"(^|/)__[^/]*__($|\.)")


@dataclass(frozen=True)
class RawSample:
    """One WebDataset sample: its key, position in the shard and raw member bytes by field."""

    key: str
    idx: int
    files: dict[str, bytes]


@dataclass(frozen=True)
class ReadOptions:
    """How a sample becomes a pair.

    ``caption_field``: when set, the caption is this field of the ``json`` member;
    otherwise the ``txt`` member is used, falling back to ``json["caption"]``.
    """

    caption_field: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PairSample:
    """An image-caption pair before decoding; ``status`` is ``ok`` or a sample-level failure."""

    key: str
    idx: int
    image: bytes | None
    text: str | None
    status: str
    error: str | None = None
    uid: str | None = None
    url: str | None = None


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/b.c.jpg" -> ("a/b", "c.jpg")``; None for names without an extension or meta files."""
    if _META_RE.search(name):
        return None
    match = _KEY_RE.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _iter_members(fh: BinaryIO, uri: str) -> Iterator[tuple[str, bytes]]:
    try:
        # "r|*": forward-only stream (works on HTTP streams), transparent gzip.
        with tarfile.open(fileobj=fh, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                extracted = tar.extractfile(member)
                if extracted is None:
                    continue
                yield member.name, extracted.read()
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise ShardReadError(f"unreadable tar {uri!r}: {exc}", uri=uri) from exc


def iter_raw_samples(uri: str, options: ReadOptions | None = None) -> Iterator[RawSample]:
    """Yield the samples of one shard in tar order.

    Raises ``ShardNotFoundError`` / ``ShardReadError`` naming ``uri`` when the shard is
    missing, not a tar, or truncated (a truncated shard is a shard-level failure: its
    output must be complete or absent).
    """
    opts = options or ReadOptions()
    current_key: str | None = None
    files: dict[str, bytes] = {}
    idx = 0
    with open_shard(uri, opts.storage_options) as fh:
        for name, data in _iter_members(fh, uri):
            parts = split_member_name(name)
            if parts is None:
                continue
            key, ext = parts
            if key != current_key:
                if current_key is not None:
                    yield RawSample(current_key, idx, files)
                    idx += 1
                current_key, files = key, {}
            files[ext] = data
    if current_key is not None:
        yield RawSample(current_key, idx, files)


def _parse_json(sample: RawSample) -> tuple[dict[str, Any], str | None]:
    raw = sample.files.get("json")
    if raw is None:
        return {}, None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, f"unreadable json member: {exc}"
    if not isinstance(meta, dict):
        return {}, "json member is not an object"
    return meta, None


def _caption(sample: RawSample, meta: dict[str, Any], caption_field: str | None) -> str | None:
    if caption_field is not None:
        value = meta.get(caption_field)
        return None if value is None else str(value)
    raw = sample.files.get("txt")
    if raw is not None:
        return raw.decode("utf-8", errors="replace")
    value = meta.get("caption")
    return None if value is None else str(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def to_pair(sample: RawSample, caption_field: str | None = None) -> PairSample:
    """Pick the image and caption of a sample; problems become a status, never an exception."""
    meta, json_error = _parse_json(sample)
    uid, url = _opt_str(meta.get("uid")), _opt_str(meta.get("url"))
    image = next((sample.files[e] for e in IMAGE_EXTS if e in sample.files), None)
    text = _caption(sample, meta, caption_field)

    def row(status: str, error: str | None) -> PairSample:
        return PairSample(sample.key, sample.idx, image, text, status, error, uid, url)

    if image is None:
        return row(schema.STATUS_MISSING_IMAGE, "no jpg/jpeg/png/webp member")
    if text is None:
        where = f"json field {caption_field!r}" if caption_field else "txt member or json caption"
        return row(schema.STATUS_MISSING_TEXT, json_error or f"no {where}")
    if not text.strip():
        return row(schema.STATUS_EMPTY_TEXT, "caption is empty")
    return row(schema.STATUS_OK, None)


def iter_pairs(uri: str, options: ReadOptions | None = None) -> Iterator[PairSample]:
    """The pairs of one shard in tar order (see ``iter_raw_samples`` for the errors)."""
    opts = options or ReadOptions()
    for sample in iter_raw_samples(uri, opts):
        yield to_pair(sample, opts.caption_field)
