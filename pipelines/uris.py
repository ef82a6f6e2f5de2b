"""Shard URIs: expansion (braces, globs, ``@list`` files), validation and streaming opens.

Supported schemes: plain local paths, ``file://``, ``http(s)://`` (streamed, never
downloaded whole) and ``s3://`` / ``gs://`` / ``gcs://`` through fsspec. Remote
credentials and endpoints come from the usual environment (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``) or from ``storage_options``.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import urlparse

from .errors import InputError, ShardNotFoundError, ShardReadError, UnsupportedSchemeError

__all__ = [
    "LOCAL_SCHEMES",
    "REMOTE_SCHEMES",
    "scheme_of",
    "expand_shards",
    "shard_stem",
    "local_path",
    "open_shard",
    "shard_size",
]

LOCAL_SCHEMES = frozenset({"", "file"})
REMOTE_SCHEMES = frozenset({"http", "https", "s3", "gs", "gcs"})
_GLOB_CHARS = frozenset("*?[")
# Suffixes stripped from a shard's file name to get the stem its outputs are named by.
_SHARD_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def scheme_of(uri: str) -> str:
    """The lower-case scheme of ``uri`` ('' for a plain path); raises for unsupported ones."""
    parsed = urlparse(uri)
    # A one-letter "scheme" is a Windows drive letter, i.e. a plain path.
    scheme = parsed.scheme.lower() if len(parsed.scheme) > 1 else ""
    if scheme in LOCAL_SCHEMES or scheme in REMOTE_SCHEMES:
        return scheme
    raise UnsupportedSchemeError(
        f"unsupported URI scheme {scheme!r} in {uri!r}: use a local path, file://, "
        "http(s)://, s3:// or gs://",
        uri=uri,
    )


def local_path(uri: str) -> str:
    """The filesystem path of a local URI (plain path or ``file://``)."""
    if scheme_of(uri) == "file":
        return urlparse(uri).path
    return uri


def shard_stem(uri: str) -> str:
    """The output stem of a shard: its file name without ``.tar`` (``a/b/x-001.tar`` -> ``x-001``)."""
    name = PurePosixPath(urlparse(uri).path if scheme_of(uri) else uri).name
    for suffix in _SHARD_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def expand_shards(
    specs: Sequence[str], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Expand shard specs into a de-duplicated, ordered list of shard URIs.

    Each spec is a URI, a brace range (``shard-{00000..00127}.tar``), a glob
    (``/data/*.tar``, ``s3://b/p/*.tar``) or ``@list.txt`` (one spec a line; ``#`` comments).
    Local shards must exist (checked here, so a typo fails before any work); remote
    shards are checked when opened. Raises ``InputError`` subclasses naming the spec.
    """
    out: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        for uri in _expand_one(spec.strip(), storage_options or {}, depth=0):
            if uri not in seen:
                seen.add(uri)
                out.append(uri)
    if not out:
        raise InputError("no shards given")
    return out


def _expand_one(spec: str, storage_options: Mapping[str, Any], depth: int) -> Iterator[str]:
    if not spec:
        raise InputError("empty shard spec")
    if spec.startswith("@"):
        yield from _expand_list_file(spec[1:], storage_options, depth)
        return
    import braceexpand  # webdataset's own dependency; the same brace syntax users know

    for uri in braceexpand.braceexpand(spec):
        scheme = scheme_of(uri)
        if _GLOB_CHARS & set(uri):
            yield from _expand_glob(uri, scheme, storage_options)
        elif scheme in LOCAL_SCHEMES:
            path = local_path(uri)
            if not os.path.isfile(path):
                raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri)
            yield uri
        else:
            yield uri


def _expand_list_file(path: str, storage_options: Mapping[str, Any], depth: int) -> Iterator[str]:
    if depth > 4:
        raise InputError(f"@list files nested too deeply at {path!r}", uri=path)
    try:
        with _open_any(path, storage_options) as fh:
            text = fh.read().decode("utf-8")
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"shard list not found: {path!r}", uri=path) from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"shard list {path!r} is not UTF-8 text", uri=path) from exc
    base = os.path.dirname(local_path(path)) if scheme_of(path) in LOCAL_SCHEMES else ""
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        # Relative local entries are relative to the list file, like a playlist.
        if base and scheme_of(line) == "" and not os.path.isabs(line) and not line.startswith("@"):
            line = os.path.join(base, line)
        yield from _expand_one(line, storage_options, depth + 1)


def _expand_glob(uri: str, scheme: str, storage_options: Mapping[str, Any]) -> Iterator[str]:
    if scheme in LOCAL_SCHEMES:
        matches = sorted(glob.glob(local_path(uri)))
        matches = [m for m in matches if os.path.isfile(m)]
        prefix = "file://" if scheme == "file" else ""
        found = [prefix + m for m in matches]
    elif scheme in ("http", "https"):
        raise InputError(f"globs are not supported over HTTP: {uri!r}", uri=uri)
    else:
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(uri, **storage_options)
        except ImportError as exc:
            raise UnsupportedSchemeError(f"reading {uri!r} needs an extra package: {exc}", uri=uri) from exc
        found = [f"{scheme}://{p}" for p in sorted(fs.glob(path))]
    if not found:
        raise ShardNotFoundError(f"no shard matches {uri!r}", uri=uri)
    yield from found


@contextlib.contextmanager
def _open_any(uri: str, storage_options: Mapping[str, Any]) -> Iterator[BinaryIO]:
    scheme = scheme_of(uri)
    if scheme in LOCAL_SCHEMES:
        with open(local_path(uri), "rb") as fh:
            yield fh
        return
    import fsspec

    opts = dict(storage_options)
    if scheme in ("http", "https"):
        # block_size=0 gives a forward-only stream: a shard is never downloaded whole and
        # servers without Range support work too.
        opts.setdefault("block_size", 0)
    with fsspec.open(uri, "rb", **opts) as fh:
        yield fh


@contextlib.contextmanager
def open_shard(uri: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[BinaryIO]:
    """Open a shard for sequential reading; translate "not there" into ``ShardNotFoundError``."""
    stack = contextlib.ExitStack()
    try:
        fh = stack.enter_context(_open_any(uri, storage_options or {}))
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri) from exc
    except ImportError as exc:
        raise UnsupportedSchemeError(f"reading {uri!r} needs an extra package: {exc}", uri=uri) from exc
    except PermissionError as exc:
        raise ShardReadError(f"permission denied reading shard {uri!r}", uri=uri) from exc
    except OSError as exc:
        raise ShardReadError(f"cannot open shard {uri!r}: {exc}", uri=uri) from exc
    with stack:
        yield fh


def shard_size(uri: str, storage_options: Mapping[str, Any] | None = None) -> int | None:
    """The size of a shard in bytes, or None when the store does not say."""
    scheme = scheme_of(uri)
    if scheme in LOCAL_SCHEMES:
        return os.path.getsize(local_path(uri))
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        size = fs.size(path)
        return int(size) if size is not None else None
    except Exception:  # noqa: BLE001 - size is informational only
        return None
