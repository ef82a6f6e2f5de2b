"""Reading WebDataset shards: tar members grouped into samples, then into image-caption pairs.

Grouping follows WebDataset's key rule: a member ``dir/name.ext1.ext2`` belongs to the
sample with ``__key__`` ``dir/name`` (everything up to the first dot of the file name)
and carries the field ``ext1.ext2`` (lower-cased). Consecutive members with the same key
form one sample. Keys are kept exactly as written in the tar.

A shard is read whole or not at all: a truncated shard, a corrupt header after the first
member (which Python's ``tarfile`` would take as the end of the archive), or a stream that
ends before the object's known size raises ``ShardReadError``. Members over
``ReadOptions.max_member_bytes`` are skipped without being read (a ``too_large`` row);
link members, keys seen earlier in the shard and fields written twice become rows with
a status instead of being dropped or overwritten.

Each member read from an uncompressed tar also gets its *span*, ``(offset, size)``: the
byte offset of its data in the tar file and its length (wids-style random access). The
score tables record the image's and caption's spans, so a viewer reads just those bytes
(``pairclean.read.members.read_member``) instead of rescanning the shard. A compressed tar
(``.tar.gz``) has no spans: offsets into the decompressed stream are of no use for a
ranged read.
"""

from __future__ import annotations

import asyncio
import bz2
import codecs
import gzip
import json
import sys
import lzma
import os
import re
import stat
import tarfile
import time
import unicodedata
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from pairclean import schema
from pairclean.errors import ShardReadError, ShardTimeoutError, first_line
from pairclean.uris import open_shard

__all__ = [
    "caption_text",
    "decode_caption",
    "IMAGE_EXTS",
    "RawSample",
    "PairSample",
    "ReadStats",
    "Deadline",
    "ReadOptions",
    "DEFAULT_MAX_MEMBER_BYTES",
    "MAX_CAPTION_CHARS",
    "MAX_KEY_CHARS",
    "iter_raw_samples_from",
    "iter_pairs_from",
    "split_member_name",
    "iter_raw_samples",
    "to_pair",
    "iter_pairs",
]

IMAGE_EXTS = schema.IMAGE_EXTS
# WebDataset's base_plus_ext rule: key = dirname + basename up to the first dot.
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)\.([^/]*)$")
# Tar members like __index__.json are WebDataset metadata, not samples.
# WebDataset's own rule (``tariterators.tar_file_iterator``): a name that begins with a
# ``__x__`` part (alone, or as a folder) and a top-level name that begins and ends with
# ``__``. A broader rule dropped samples keyed ``__0001__`` that trainers read: no weight row.
_META_RE = re.compile(r"__[^/]*__($|/)")
#: Members above this many bytes are never read into memory (a ``too_large`` row).
DEFAULT_MAX_MEMBER_BYTES = 64 * 2**20
_BLOCK = tarfile.BLOCKSIZE
#: The most bytes one member's headers may take (pax headers and GNU long names are read whole).
_MAX_HEADER_READ = 1 << 20
#: The most extended headers (pax, GNU long name / link) chained on one member.
_MAX_HEADER_CHAIN = 8
# Bytes after the end-of-archive marker are drained to compare the total with the
# object's size; tar writers pad to a 10 KiB record, so more than this is not padding.
_MAX_TRAILER = 1 << 16
#: The most bytes of one pax extended header: real ones hold a path and a few numbers (under
#: 4 KiB). CPython before 3.11.10 / 3.12.6 parses a pax header of digits in quadratic time
#: holding the GIL (CVE-2024-6232): 1 MiB of it, 1.7 kB gzipped, stalled the process ~10 min.
_MAX_PAX_BYTES = 1 << 14
#: The most bytes a member may declare (64 GiB): a pax size of 10**30 had tarfile "skip" the
#: member by ~10**25 reads of the ended stream (a run spinning for good). Members this large
#: are no image-text pair; below it a gzip bomb of zeros is the shard time limit's to stop.
_MAX_DECLARED_BYTES = 1 << 36
#: Characters a sample key may have (PATH_MAX; WebDataset keys are file paths less extensions).
MAX_KEY_CHARS = 4096
#: Characters of a json ``uid`` or ``url`` kept in the table (a URL is at most a few kB).
MAX_FIELD_CHARS = 8192
#: Characters of a field name shown in a row's error.
_MAX_SHOWN_FIELD = 64
#: Characters of a caption kept for scoring (the text towers read at most 77 tokens).
MAX_CAPTION_CHARS = 8192


@dataclass(frozen=True)
class RawSample:
    """One WebDataset sample: its key, position in the shard and raw member bytes by field."""

    key: str
    idx: int
    files: dict[str, bytes]
    issue: tuple[str, str] | None = None  # (status, message) of a sample-level problem
    #: field -> (offset, size) of the member's data in the tar (uncompressed tars only)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadOptions:
    """How a sample becomes a pair.

    ``caption_field``: when set, the caption is this field of the ``json`` member, or,
    written with a leading dot (``".caption"``), the sample's member of that extension read
    as text (``schema.caption_member``); otherwise the ``txt`` member is used, falling back to
    ``json["caption"]``.
    ``max_member_bytes``: members larger than this are skipped unread (``too_large``);
    None reads members of any size.
    """

    caption_field: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    max_member_bytes: int | None = DEFAULT_MAX_MEMBER_BYTES

    def __post_init__(self) -> None:
        schema.caption_member(self.caption_field)  # a dot alone or an image member: InputError here, not per sample


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
    #: (offset, size) in the tar of the image member's data, and of the member the caption
    #: was read from (the ``txt`` member, or the ``json`` member when the job reads a
    #: ``caption_field``); None when unknown (compressed tar, or a json-fallback caption).
    image_span: tuple[int, int] | None = None
    caption_span: tuple[int, int] | None = None


def split_member_name(name: str) -> tuple[str, str] | None:
    """``"a/b.c.jpg" -> ("a/b", "c.jpg")``; None for names without an extension or meta files."""
    if _META_RE.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    match = _KEY_RE.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


@dataclass(frozen=True)
class _Member:
    name: str
    data: bytes | None  # None when the member was not read (see ``issue``)
    issue: tuple[str, str] | None = None
    span: tuple[int, int] | None = None  # (offset, size) of the data in an uncompressed tar


class _Counting:
    """A read-only stream that counts the object's bytes (before any gunzip) and, given a
    ``deadline`` (``time.monotonic()`` seconds), refuses reads after it (``ShardTimeoutError``).

    The deadline is checked here, on the compressed bytes, because that is where a shard's
    time goes that no batch boundary sees: a 1 GB ``.tar.gz`` of zeros expands to about 1 TB
    that the tar stream must decompress to skip, in one member, before any pair is yielded."""

    def __init__(self, fh: BinaryIO, uri: str = "", deadline: Deadline | None = None) -> None:
        self.fh, self.count, self.uri, self.deadline = fh, 0, uri, deadline

    def read(self, n: int = -1) -> bytes:
        if self.deadline is not None:
            self.deadline.check(self.uri)
        data = self.fh.read(n)
        self.count += len(data)
        return data


@dataclass(frozen=True)
class Deadline:
    """When a shard's time is up: ``at`` in ``time.monotonic()`` seconds, ``limit_s`` the
    limit it came from (for the message)."""

    at: float
    limit_s: float

    @classmethod
    def after(cls, limit_s: float) -> Deadline:
        """The deadline ``limit_s`` seconds from now."""
        return cls(time.monotonic() + limit_s, limit_s)

    def check(self, uri: str) -> None:
        """Raise ``ShardTimeoutError`` naming ``uri`` once the deadline has passed."""
        if time.monotonic() > self.at:
            raise ShardTimeoutError(f"shard {uri!r} took longer than its {self.limit_s:g} s limit (--shard-timeout)", uri=uri)


class _FirstRead:
    """A stream proxy that keeps the bytes of its first ``read`` (a header block), and
    refuses reads past ``_MAX_HEADER_READ`` bytes in all (``ShardReadError``): headers are
    read whole by ``tarfile`` (a pax header or a GNU long name of 800 MiB would be held in
    memory at once), a header's extended headers are read through the same proxy (a chain
    of 1 MiB pax headers counts whole), and member data is never read through it."""

    def __init__(self, inner: Any, uri: str) -> None:
        self.inner, self.block, self.uri = inner, b"", uri
        self._seen = False
        self.total = 0

    def read(self, n: int = -1) -> bytes:
        self.total += _MAX_HEADER_READ + 1 if n is None or n < 0 else n
        if self.total > _MAX_HEADER_READ:
            raise ShardReadError(f"unreadable tar {self.uri!r}: a member header (pax or long name) of over "
                                 f"{_MAX_HEADER_READ} bytes", uri=self.uri)
        data: bytes = self.inner.read(n)
        if not self._seen:
            self._seen, self.block = True, bytes(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _header_recorder(uri: str) -> tuple[type[tarfile.TarInfo], list[bytes]]:
    """A TarInfo class that remembers the block its last header read started with.

    ``tarfile`` ends iteration silently on an empty, short or corrupt header after the
    first member; the last block tells a real end-of-archive marker (512 zero bytes) from
    a truncated or damaged shard. Why ``fromtarfile`` and a stream proxy: it is the public
    hook ``TarFile.next`` calls on every Python; the parser under it moved (``frombuf`` to
    ``_frombuf`` with the 2025 tarfile security fixes; seen in a Python 3.12.3 build), and
    a hook on the old name saw no header at all there, so every shard read as truncated.
    """
    last = [b""]
    depth = [0]  # extended headers (pax, long names) call fromtarfile again for the header they extend

    class _Info(tarfile.TarInfo):
        def _proc_member(self, tar: tarfile.TarFile) -> Any:
            # Before tarfile reads and parses an extended header (a private hook, the one
            # place that sees the header's declared size first): see _MAX_PAX_BYTES.
            if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) and self.size > _MAX_PAX_BYTES:
                raise ShardReadError(f"unreadable tar {uri!r}: a pax header of {self.size} bytes (at most {_MAX_PAX_BYTES})",
                                     uri=uri)
            member = super()._proc_member(tar)  # type: ignore[misc]  # private; see above
            if member.size > _MAX_DECLARED_BYTES or member.size < 0:
                raise ShardReadError(f"unreadable tar {uri!r}: member {member.name[:200]!r} declares {member.size} bytes",
                                     uri=uri)
            return member

        @classmethod
        def fromtarfile(cls, tar: tarfile.TarFile) -> _Info:
            if depth[0] >= _MAX_HEADER_CHAIN:
                raise ShardReadError(f"unreadable tar {uri!r}: over {_MAX_HEADER_CHAIN} extended headers chained on one member",
                                     uri=uri)
            stream = tar.fileobj
            probe = _FirstRead(stream, uri)
            tar.fileobj = probe
            depth[0] += 1
            try:
                return super().fromtarfile(tar)
            finally:
                depth[0] -= 1
                tar.fileobj = stream
                last[0] = probe.block

    return _Info, last


def _regular_stat(fh: Any) -> os.stat_result | None:
    """``os.fstat`` of the stream's file when it is a regular local file, else None."""
    try:
        st = os.fstat(fh.fileno())
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _known_size(fh: Any) -> int | None:
    """The object's size when the stream knows it (local file, fsspec file), else None."""
    st = _regular_stat(fh)
    if st is not None:
        return st.st_size
    size = getattr(fh, "size", None)
    return size if isinstance(size, int) else None


def _known_mtime_ns(fh: Any) -> int | None:
    """A local file's modification time in ns (``os.fstat`` of what was opened), else None."""
    st = _regular_stat(fh)
    return None if st is None else st.st_mtime_ns


def _check_trailer(tar: tarfile.TarFile, uri: str) -> None:
    """Raise ``ShardReadError`` unless what follows the end-of-archive marker is zero padding.

    ``tarfile`` stops at the first zero block, so a header zeroed by damage, two tars
    concatenated (``cat a.tar b.tar``) or bytes appended to a shard would otherwise end the
    shard early and silently. Reads the (decompressed) rest of the archive, at most
    ``_MAX_TRAILER`` bytes: tar writers pad to a 10 KiB record, never more.
    """
    end = tar.offset
    seen = 0
    while True:
        chunk = tar.fileobj.read(1 << 16)
        if not chunk:
            return
        if chunk.count(0) != len(chunk):
            at = end + seen + next(i for i, b in enumerate(chunk) if b)
            raise ShardReadError(f"unreadable tar {uri!r}: data after its end-of-archive marker at byte {at} "
                                 "(a damaged header, or tars joined end to end); the shard is not read short", uri=uri)
        seen += len(chunk)
        if seen > _MAX_TRAILER:
            raise ShardReadError(f"unreadable tar {uri!r}: over {_MAX_TRAILER} bytes after its end-of-archive marker", uri=uri)


class _Peeked:
    """A read-only stream whose first bytes were read ahead (``head``) and are read again."""

    def __init__(self, fh: Any, head: bytes) -> None:
        self.fh, self.head = fh, head

    def read(self, n: int = -1) -> bytes:
        if self.head:
            data = self.head if n is None or n < 0 else self.head[:n]
            self.head = self.head[len(data):]
            return data
        return bytes(self.fh.read(n))


def _decompressed(counted: _Counting) -> tuple[Any, bool]:
    """(the tar stream, whether it is compressed: gzip, bzip2 or xz) of a shard's bytes.

    Gzip goes through ``gzip.GzipFile`` rather than ``tarfile``'s own "r|gz": that reads
    only the first gzip member and checks no CRC, so two ``.tar.gz`` joined with ``cat``
    were read short without a word, a genuine multi-member gzip of one tar failed as
    truncated, and corrupted compressed data was scored. ``GzipFile`` reads every member
    (the tar's end-of-archive check then sees a second tar), checks each member's CRC and
    length, and refuses bytes after the last member that are not gzip."""
    head = b""
    while len(head) < 10:  # a short first read is not the end of the stream
        more = counted.read(10 - len(head))
        if not more:
            break
        head += more
    stream = _Peeked(counted, head)
    # Whole magic numbers: a plain tar starts with its first member's name ("BZhang_0001.jpg")
    if head.startswith(b"\x1f\x8b\x08"):
        return gzip.GzipFile(fileobj=stream, mode="rb"), True  # type: ignore[call-overload]
    # bzip2, xz and legacy .lzma, as tarfile's "r|*" read them (each checked and read whole alike)
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return bz2.BZ2File(stream), True  # type: ignore[call-overload]
    if head.startswith((b"\xfd7zXZ\x00", b"\x5d\x00\x00\x80")):
        return lzma.LZMAFile(stream), True  # type: ignore[arg-type]
    return stream, False


def _iter_members(fh: BinaryIO, uri: str, max_member_bytes: int | None,
                  wanted: Callable[[str], bool] | None = None, deadline: Deadline | None = None) -> Iterator[_Member]:
    """The members of a shard in tar order; ``wanted(name)`` False: the member's data is not
    read (``data`` is ``b""``: its name still counts). ``deadline``: ``ShardTimeoutError``
    once it has passed (checked at every read of the shard's bytes)."""
    size = _known_size(fh)
    counted = _Counting(fh, uri, deadline)
    info_cls, last_header = _header_recorder(uri)
    try:
        stream, compressed = _decompressed(counted)
        # "r|": forward-only stream (works on HTTP streams), of the decompressed tar.
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=info_cls) as tar:
            # Offsets are file offsets only when the stream is not compressed.
            plain = not compressed
            for member in tar:
                if wanted is not None and not wanted(member.name) and not member.isdir():
                    # Not extracted (skipped block by block, as below): a sample's fields that
                    # the pair does not use cannot make it hold gigabytes, nor fail it for size
                    # or for being a link, FIFO or device (never followed, never read).
                    yield _Member(member.name, b"")
                    continue
                if member.issym() or member.islnk():
                    yield _Member(member.name, None, (schema.STATUS_LINK_MEMBER, f"member {member.name!r} is a link; links are not followed"))
                    continue
                if member.isdir():
                    continue  # a folder entry holds no data (tar writes one per folder)
                if not member.isfile():
                    # A FIFO or device member: never opened. It still makes its sample a row
                    # (a sample of such members alone had none: the shard was silently short).
                    # The link status, not a new one, so readers that list the statuses hold.
                    kind = "a FIFO" if member.isfifo() else "a device" if member.isdev() else "not a regular file"
                    yield _Member(member.name, None, (schema.STATUS_LINK_MEMBER, f"member {member.name!r} is {kind}; not read"))
                    continue
                if max_member_bytes is not None and member.size > max_member_bytes:
                    # Not extracted: the stream skips its bytes block by block when the
                    # next header is read, so a 1 GiB member never sits in memory.
                    message = f"member {member.name!r} is {member.size} bytes, over the {max_member_bytes}-byte limit"
                    yield _Member(member.name, None, (schema.STATUS_TOO_LARGE, message))
                    continue
                extracted = tar.extractfile(member)
                if extracted is None:
                    continue
                yield _Member(member.name, extracted.read(), span=(member.offset_data, member.size) if plain else None)
            if last_header[0] != bytes(_BLOCK):
                what = "ends without an end-of-archive marker (truncated)" if len(last_header[0]) < _BLOCK else "has a corrupt header"
                raise ShardReadError(f"unreadable tar {uri!r}: it {what} after {tar.offset} bytes", uri=uri)
            _check_trailer(tar, uri)
        if size is not None:
            while counted.count < size and counted.count <= size + _MAX_TRAILER:
                if not counted.read(min(1 << 16, size - counted.count + 1)):
                    break
            if counted.count != size:
                raise ShardReadError(f"unreadable tar {uri!r}: read {counted.count} of its {size} bytes", uri=uri)
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError, RecursionError) as exc:
        if deadline is not None and isinstance(exc, TimeoutError):  # fsspec's read timeout (an OSError)
            deadline.check(uri)  # a read cut by the shard's own time limit says so
        detail = (f"the connection timed out ({type(exc).__name__})" if isinstance(exc, TimeoutError)
                  else type(exc).__name__ if isinstance(exc, RecursionError) else str(exc) or type(exc).__name__)
        raise ShardReadError(f"unreadable tar {uri!r}: {detail}", uri=uri) from exc
    except Exception as exc:
        # fsspec's HTTP raises aiohttp's errors as they are: a server that dropped the
        # connection mid-body (ClientPayloadError, no OSError) ended the whole job with a
        # traceback. Only those are taken here, without importing aiohttp for local shards.
        aiohttp = sys.modules.get("aiohttp")
        if aiohttp is None or not isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError)):
            raise
        raise ShardReadError(f"unreadable tar {uri!r}: the connection failed mid-shard ({type(exc).__name__}: "
                             f"{first_line(exc) or 'no reason given'})", uri=uri) from exc


def iter_raw_samples(uri: str, options: ReadOptions | None = None) -> Iterator[RawSample]:
    """Yield the samples of one shard in tar order.

    Raises ``ShardNotFoundError`` / ``ShardReadError`` naming ``uri`` when the shard is
    missing, not a tar, or truncated (a truncated shard is a shard-level failure: its
    output must be complete or absent).
    """
    opts = options or ReadOptions()
    with open_shard(uri, opts.storage_options) as fh:
        yield from iter_raw_samples_from(fh, uri, opts)


def iter_raw_samples_from(fh: BinaryIO, uri: str, options: ReadOptions | None = None,
                          fields: Callable[[str], bool] | None = None, deadline: Deadline | None = None) -> Iterator[RawSample]:
    """``iter_raw_samples`` over a stream the caller opened (``uri`` names it in errors).

    ``fields(field)`` False: that field's bytes are not read (it is in ``files`` as ``b""``).
    ``deadline``: ``ShardTimeoutError`` once it has passed."""
    opts = options or ReadOptions()

    def wanted(name: str) -> bool:
        parts = split_member_name(name)
        return fields is None or parts is None or fields(parts[1])

    current_key: str | None = None
    files: dict[str, bytes] = {}
    spans: dict[str, tuple[int, int]] = {}
    issue: tuple[str, str] | None = None
    seen: set[str] = set()
    idx = 0
    for member in _iter_members(fh, uri, opts.max_member_bytes, wanted if fields is not None else None, deadline):
        parts = split_member_name(member.name)
        if parts is None:
            continue
        key, ext = parts
        if len(key) > MAX_KEY_CHARS:
            # A key is the row's identity (trainers join on it): a cut one would join nothing,
            # and 400 keys of a million characters (a 0.5 MB .tar.gz) took 3.4 GB into the table.
            raise ShardReadError(f"unreadable tar {uri!r}: a sample key of {len(key)} characters, over the "
                                 f"{MAX_KEY_CHARS}-character limit", uri=uri)
        key, utf8 = schema.utf8_text(key)
        ext = schema.utf8_text(ext)[0]  # shown in rows' errors ("its fields: ..."), which are written too
        if key != current_key:
            if current_key is not None:
                yield RawSample(current_key, idx, files, issue, spans)
                idx += 1
            current_key, files, spans, issue = key, {}, {}, None
            if key in seen:
                issue = (schema.STATUS_DUPLICATE_KEY, f"key {key!r} appeared earlier in the shard")
            elif not utf8:
                issue = (schema.STATUS_BAD_KEY, "the sample's key is not UTF-8 (its bytes are shown escaped)")
            seen.add(key)
        if member.issue is not None or member.data is None:
            issue = issue or member.issue
        elif ext in files:
            issue = issue or (schema.STATUS_DUPLICATE_KEY, f"member {member.name!r} appears twice")
        else:
            files[ext] = member.data
            if member.span is not None:
                spans[ext] = member.span
    if current_key is not None:
        yield RawSample(current_key, idx, files, issue, spans)


def _parse_json(sample: RawSample) -> tuple[dict[str, Any], str | None]:
    raw = sample.files.get("json")
    if raw is None:
        return {}, None
    try:
        # decoded as a txt caption is (UTF-8, else a byte-order mark's UTF-16/32, else
        # Windows-1252 byte by byte): a Latin-1 json member lost its caption, a txt one did not
        meta = json.loads(decode_caption(raw))
    except ValueError as exc:  # bad JSON, and an integer of over 4,300 digits (the job died on it, at every rerun)
        return {}, f"unreadable json member: {str(exc)[:200]}"
    except RecursionError:  # ~1,000 nested '[' in one 2 KB member crashed the job (and every rerun)
        return {}, "unreadable json member: nested too deeply"
    if not isinstance(meta, dict):
        return {}, "json member is not an object"
    return meta, None


def _caption(sample: RawSample, meta: dict[str, Any], caption_field: str | None) -> str | None:
    """The caption as read (not yet bounded: see ``_bounded``); None when there is none."""
    member = schema.caption_member(caption_field)
    if member is not None:
        raw = sample.files.get(member)
        return None if raw is None else decode_caption(raw[: 4 * MAX_CAPTION_CHARS])
    if caption_field is not None:
        return _caption_value(meta.get(caption_field))
    raw = sample.files.get("txt")
    if raw is not None:
        return decode_caption(raw[: 4 * MAX_CAPTION_CHARS])  # 4: bytes per UTF-8 character at most
    return _caption_value(meta.get("caption"))


def decode_caption(raw: bytes) -> str:
    """A ``.txt`` caption's bytes as text.

    UTF-8 (a leading byte-order mark dropped), where each byte that is not part of a valid
    UTF-8 sequence is read as Windows-1252 and a sequence cut off at the end is dropped; text
    with a UTF-16/32 byte-order mark, or UTF-16 without one (every other byte zero), as that.

    Why: alt-text scraped from pages that declared a legacy encoding reaches shards as
    Windows-1252/Latin-1 bytes ("caf\\xe9"), and captions are cut to byte limits by other
    tools; UTF-8 with replacement made "caf\\ufffd" of the first (a word the text tower has
    never seen), and reading the whole caption as Windows-1252 when one byte was not UTF-8
    made "cafÃ©" of the rest. A valid UTF-8 sequence is almost never meant as Windows-1252, so
    UTF-8 wins byte by byte. Windows-1252's five undefined bytes become U+FFFD.
    """
    for bom, codec, unit in ((codecs.BOM_UTF32_LE, "utf-32", 4), (codecs.BOM_UTF32_BE, "utf-32", 4),
                             (codecs.BOM_UTF16_LE, "utf-16", 2), (codecs.BOM_UTF16_BE, "utf-16", 2)):
        if raw.startswith(bom):
            cut = (len(raw) - len(bom)) % unit  # a code unit cut off at the end is dropped
            return raw[: len(raw) - cut].decode(codec, errors="replace")
    guessed = _utf16_without_bom(raw)
    if guessed is not None:
        return raw[: len(raw) - len(raw) % 2].decode(guessed, errors="replace").rstrip("\x00")
    # NUL padding (fixed-width exports) is no text; it made UTF-8 captions read as UTF-16
    return raw.rstrip(b"\x00").decode("utf-8-sig", errors=_LEGACY_BYTES)


def _utf16_without_bom(raw: bytes) -> str | None:
    """"utf-16-le"/"utf-16-be" when ``raw`` looks like UTF-16 text without a byte-order mark
    (at least 4 bytes, and 9 in 10 of the odd or of the even bytes zero: ASCII-range text); else None.
    Trailing NULs are padding, not text: counted, they made "a dog on grass" + 200 NULs UTF-16."""
    raw = raw.rstrip(b"\x00")
    if len(raw) < 3 or b"\x00" not in raw:
        return None
    odd, even = raw[1::2], raw[0::2]
    if odd.count(0) >= 0.9 * len(odd):
        return "utf-16-le"
    if even.count(0) >= 0.9 * len(even):
        return "utf-16-be"
    return None


def _legacy_bytes(exc: UnicodeError) -> tuple[str, int]:
    """``decode_caption``'s error handler: a UTF-8 sequence cut off at the end is dropped, any
    other byte that is not UTF-8 is read as Windows-1252.

    Cut off: two or more bytes of a sequence ("\\xe2\\x82" of "€"), or one lead byte after
    text that is UTF-8 with non-ASCII characters; a lone last byte after plain ASCII is
    Windows-1252 ("caf\\xe9" is "café")."""
    assert isinstance(exc, UnicodeDecodeError)
    raw = exc.object
    if exc.reason == "unexpected end of data" and (exc.end - exc.start >= 2 or _utf8_beyond_ascii(raw[: exc.start])):
        return "", exc.end
    return bytes(raw[exc.start : exc.end]).decode("cp1252", errors="replace"), exc.end


def _utf8_beyond_ascii(prefix: bytes) -> bool:
    """Whether ``prefix`` is valid UTF-8 holding at least one multi-byte character."""
    try:
        return not prefix.decode("utf-8").isascii()
    except UnicodeDecodeError:
        return False


_LEGACY_BYTES = "pairclean.legacy-bytes"
codecs.register_error(_LEGACY_BYTES, _legacy_bytes)


def _caption_value(value: Any) -> str | None:
    """A json caption: strings as they are, numbers as text; None for absent or null.

    A list or object is not a caption (``str`` would make "['a', 'b']" of it): ``ValueError``.
    """
    if value is None:
        return None
    if isinstance(value, (list, dict, bool)):
        raise ValueError(f"json caption is a{'n object' if isinstance(value, dict) else ' ' + type(value).__name__}, not text")
    return schema.utf8_text(str(value))[0]


def caption_text(caption: str) -> str:
    """A caption given as text (the notebook API's) as a shard's is read: cut to
    ``MAX_CAPTION_CHARS``; "" when it has no visible character (the ``empty_text`` status)."""
    text = _bounded(caption)
    return "" if _blank(text) else text


def _bounded(text: str) -> str:
    """``text`` cut to ``MAX_CAPTION_CHARS``: the text towers read its first few dozen
    tokens only, and tokenising a 16 MiB caption whole took gigabytes."""
    return text if len(text) <= MAX_CAPTION_CHARS else text[:MAX_CAPTION_CHARS]


#: Letters and symbols that show nothing (Hangul fillers, the Braille blank, the
#: replacement character): a caption of them tokenises as the empty one does.
_INVISIBLE = frozenset("\u115f\u1160\u3164\uffa0\u2800\ufffd")


def _blank(text: str) -> bool:
    """No letter, digit or symbol (emoji included) that shows: spaces, format and control
    characters such as a zero-width space (which ``str.strip`` keeps), combining marks with
    nothing to combine with, punctuation alone ("!!!???"), and ``_INVISIBLE``. Such captions
    describe nothing; scored as text, the corpus contrast lifted some to weights of 0.5-0.6,
    while "" is ``empty_text`` with weight 0."""
    return not any(unicodedata.category(c)[0] in "LNS" and c not in _INVISIBLE for c in text)


def _opt_str(value: Any) -> str | None:
    """A json ``uid``/``url`` as text; a lone surrogate (``"\\udcff"`` is valid JSON) escaped,
    as a key's bytes are (``schema.utf8_text``): no Parquet writer takes it, and the job died.
    At most ``MAX_FIELD_CHARS`` characters (2 MB ones were carried into every table row)."""
    return None if value is None else schema.utf8_text(str(value)[:MAX_FIELD_CHARS])[0]


def to_pair(sample: RawSample, caption_field: str | None = None) -> PairSample:
    """Pick the image and caption of a sample; problems become a status, never an exception."""
    meta, json_error = _parse_json(sample)
    uid, url = _opt_str(meta.get("uid")), _opt_str(meta.get("url"))
    image_ext = next((e for e in IMAGE_EXTS if e in sample.files), None)
    image = sample.files[image_ext] if image_ext else None
    try:
        text = _caption(sample, meta, caption_field)
    except ValueError as exc:
        text, json_error = None, str(exc)
    text = None if text is None else _bounded(text)
    # The caption's member as _caption picks it; a json-fallback caption (no caption_field,
    # no txt) gets no span, so a viewer never has to guess which member it reads.
    caption_ext = schema.caption_member(caption_field) or ("json" if caption_field is not None else "txt")
    spans = (sample.spans.get(image_ext) if image_ext else None, sample.spans.get(caption_ext))

    def row(status: str, error: str | None) -> PairSample:
        return PairSample(sample.key, sample.idx, image, text, status, error, uid, url, *spans)

    if sample.issue is not None:
        return row(*sample.issue)
    # The fields found say why: "a.v1.jpg" is field "v1.jpg" of key "a" (WebDataset's key rule).
    found = ", ".join(name[:_MAX_SHOWN_FIELD] for name in sorted(sample.files)[:5]) or "none"  # 1 MB field names: 5 MB a row
    if image is None:
        return row(schema.STATUS_MISSING_IMAGE, f"no jpg/jpeg/png/webp member (its fields: {found})")
    if text is None:
        member = schema.caption_member(caption_field)
        where = (f"{member} member" if member else f"json field {caption_field!r}") if caption_field else "txt member or json caption"
        return row(schema.STATUS_MISSING_TEXT, json_error or f"no {where} (its fields: {found})")
    if _blank(text):
        return row(schema.STATUS_EMPTY_TEXT, "caption is empty (no letter, digit or symbol)")
    return row(schema.STATUS_OK, None)


def pair_fields(caption_field: str | None) -> Callable[[str], bool]:
    """Which fields ``to_pair`` reads: images, ``txt``, ``json`` and a caption member."""
    member = schema.caption_member(caption_field)
    used = frozenset(IMAGE_EXTS) | {"txt", "json"} | ({member} if member else set())
    return used.__contains__


@dataclass
class ReadStats:
    """What reading one shard saw. ``bytes``: the size of the object actually opened (what a
    completion records: a file replaced while it was read keeps the size of the bytes read,
    so a resume sees the new one as changed); None where the stream does not say.
    ``mtime_ns``: a local file's modification time as opened (a file replaced by another of
    the same size, common for tars padded to 10 KiB records, is told apart by it)."""

    bytes: int | None = None
    mtime_ns: int | None = None


def iter_pairs(uri: str, options: ReadOptions | None = None, stats: ReadStats | None = None,
               deadline: Deadline | None = None) -> Iterator[PairSample]:
    """The pairs of one shard in tar order (see ``iter_raw_samples`` for the errors); fields
    no pair uses are not read (``pair_fields``). ``stats`` is filled in as the shard is opened.
    ``deadline``: ``ShardTimeoutError`` once it has passed (checked at every read)."""
    opts = options or ReadOptions()
    with open_shard(uri, opts.storage_options, read_timeout_s=None if deadline is None else deadline.limit_s) as fh:
        if stats is not None:
            stats.bytes = _known_size(fh)
            stats.mtime_ns = _known_mtime_ns(fh)
        yield from iter_pairs_from(fh, uri, opts, deadline)


def iter_pairs_from(fh: BinaryIO, uri: str, options: ReadOptions | None = None,
                    deadline: Deadline | None = None) -> Iterator[PairSample]:
    """``iter_pairs`` over a stream the caller opened (e.g. one bounded in bytes and time)."""
    opts = options or ReadOptions()
    for sample in iter_raw_samples_from(fh, uri, opts, fields=pair_fields(opts.caption_field), deadline=deadline):
        yield to_pair(sample, opts.caption_field)
