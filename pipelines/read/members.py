"""Random access to one tar member: read ``size`` bytes at ``offset`` of a shard.

The score tables record where each pair's image and caption lie in their tar
(``schema.MEMBER_COLUMNS``, wids-style), so a viewer fetches just those bytes: a local
``seek`` + ``read``, an HTTP ``Range`` request, or a ranged GET on an object store through
fsspec. Nothing else of the shard is read, and a member over ``max_bytes`` is refused
before any byte is.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from pairclean.errors import InputError, ShardNotFoundError, ShardReadError
from pairclean.uris import LOCAL_SCHEMES, SocketWatch, local_path, scheme_of, under_prefix, watched_opener

__all__ = ["MemberTooLarge", "read_member"]


class MemberTooLarge(InputError):
    """A member larger than the caller's limit (refused unread)."""


def read_member(uri: str, offset: int, size: int, max_bytes: int, storage_options: Mapping[str, Any] | None = None,
                http_allowed: Sequence[str] | None = None, timeout_s: float = 30.0, deadline: float | None = None) -> bytes:
    """Exactly ``size`` bytes at byte ``offset`` of the shard at ``uri``.

    Raises ``MemberTooLarge`` when ``size > max_bytes`` (nothing is read), ``InputError``
    for a negative offset or size, ``ShardNotFoundError`` when the shard is gone and
    ``ShardReadError`` when it is shorter than ``offset + size`` or the store fails.
    ``http_allowed``: URI prefixes an HTTP(S) shard and its redirects must stay under
    (None: redirects followed freely). ``deadline`` (``time.monotonic()`` seconds): an
    HTTP(S) read is cut when it passes, however slowly the server trickles (``ShardReadError``).
    """
    if offset < 0 or size < 0:
        raise InputError(f"bad member span ({offset}, {size}) in {uri!r}", uri=uri)
    if size > max_bytes:
        raise MemberTooLarge(f"member of {size} bytes in {uri!r} is over the {max_bytes}-byte limit", uri=uri)
    if size == 0:
        return b""
    scheme = scheme_of(uri)
    try:
        if scheme in LOCAL_SCHEMES:
            data = _read_local(local_path(uri), offset, size)
        elif scheme in ("http", "https"):
            data = _read_http(uri, offset, size, http_allowed, timeout_s, deadline)
        else:
            data = _read_fsspec(uri, offset, size, storage_options or {})
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri) from exc
    except (OSError, ValueError) as exc:
        raise ShardReadError(f"cannot read {size} bytes at {offset} of {uri!r}: {exc}", uri=uri) from exc
    if len(data) != size:
        raise ShardReadError(f"{uri!r} ends before byte {offset + size} (got {len(data)} of {size} bytes)", uri=uri)
    return data


def _read_local(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise ValueError("not a regular file")
        fh.seek(offset)
        return fh.read(size)


def _read_fsspec(uri: str, offset: int, size: int, storage_options: Mapping[str, Any]) -> bytes:
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **storage_options)
    return bytes(fs.cat_file(path, start=offset, end=offset + size))  # one ranged GET


def _read_http(uri: str, offset: int, size: int, allowed: Sequence[str] | None, timeout_s: float,
               deadline: float | None = None) -> bytes:
    """A ``Range`` request; a server that ignores the range (200) is refused rather than
    downloading the whole shard."""
    import urllib.error
    import urllib.request

    def check(url: str) -> None:
        if allowed is not None and not any(under_prefix(url, prefix) for prefix in allowed):
            raise ShardReadError(f"{uri!r} leads outside the allowed locations", uri=uri)  # the target is not named

    class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            check(newurl)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    check(uri)
    request = urllib.request.Request(uri, headers={"Range": f"bytes={offset}-{offset + size - 1}"})
    watch = SocketWatch(deadline)
    try:
        with watched_opener(watch, _CheckedRedirects()).open(request, timeout=watch.timeout(timeout_s)) as response:
            if response.status != 206:
                raise ShardReadError(f"{uri!r}: the server does not answer range requests (HTTP {response.status})", uri=uri)
            data = bytes(response.read(size + 1))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise FileNotFoundError(uri) from exc
        raise ShardReadError(f"cannot read {uri!r}: HTTP {exc.code}", uri=uri) from exc
    except OSError as exc:
        if watch.expired:
            raise ShardReadError(f"{uri!r} did not answer before the deadline", uri=uri) from exc
        raise
    finally:
        watch.close()
    if watch.expired and len(data) < size:
        raise ShardReadError(f"{uri!r} did not answer before the deadline", uri=uri)
    return data
