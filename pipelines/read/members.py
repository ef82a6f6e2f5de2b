"""Random access to one tar member: read ``size`` bytes at ``offset`` of a shard.

The score tables record where each pair's image and caption lie in their tar
(``schema.MEMBER_COLUMNS``, wids-style), so a viewer fetches just those bytes: a local
``seek`` + ``read``, an HTTP ``Range`` request, or a ranged GET on an object store through
fsspec. Nothing else of the shard is read, and a member over ``max_bytes`` is refused
before any byte is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pairclean.errors import InputError, ShardNotFoundError, ShardReadError
from pairclean.uris import LOCAL_SCHEMES, SocketWatch, check_local_root, local_path, scheme_of, under_prefix, watched_opener

__all__ = ["MemberTooLarge", "read_member"]


class MemberTooLarge(InputError):
    """A member larger than the caller's limit (refused unread)."""


def read_member(uri: str, offset: int, size: int, max_bytes: int, storage_options: Mapping[str, Any] | None = None,
                http_allowed: Sequence[str] | None = None, timeout_s: float = 30.0, deadline: float | None = None,
                local_roots: Sequence[str] | None = None, tar_header: bool = False) -> bytes:
    """Exactly ``size`` bytes at byte ``offset`` of the shard at ``uri``.

    ``local_roots``: a local shard must resolve inside one of these folders *as opened* (a
    link swapped between a caller's check and the open leads nowhere). ``tar_header``: the
    512 bytes before ``offset`` must be a tar header (checksum right) of a member of exactly
    ``size`` bytes, as in the shard that was scored: a shard path swapped for a link to
    another file (another tenant's job.json, /etc/passwd) had the pages show its bytes.

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
    head = TAR_BLOCK if tar_header else 0
    if offset < head:
        raise ShardReadError(f"{uri!r}: no tar header before byte {offset}", uri=uri)
    try:
        if scheme in LOCAL_SCHEMES:
            data = _read_local(local_path(uri), offset - head, size + head, local_roots)
        elif scheme in ("http", "https"):
            data = _read_http(uri, offset - head, size + head, http_allowed, timeout_s, deadline)
        else:
            data = _read_fsspec(uri, offset - head, size + head, storage_options or {})
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri) from exc
    except (OSError, ValueError) as exc:
        raise ShardReadError(f"cannot read {size} bytes at {offset} of {uri!r}: {exc}", uri=uri) from exc
    if len(data) != size + head:
        raise ShardReadError(f"{uri!r} ends before byte {offset + size} (got {max(0, len(data) - head)} of {size} bytes)", uri=uri)
    if head:
        _check_tar_header(data[:head], size, uri)
        data = data[head:]
    return data


#: A tar block: a member's header is the block before its data.
TAR_BLOCK = 512


def _check_tar_header(block: bytes, size: int, uri: str) -> None:
    """``ShardReadError`` unless ``block`` is a tar header (its checksum right) of a regular
    member of ``size`` bytes."""
    import tarfile

    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.TarError as exc:
        raise ShardReadError(f"{uri!r}: no tar member header where the scored member was ({exc})", uri=uri) from None
    if info.size != size or not info.isreg():
        raise ShardReadError(f"{uri!r}: the member there is not the one scored ({info.size} bytes, not {size}): "
                             "the shard changed since it was scored", uri=uri)


def _read_local(path: str, offset: int, size: int, roots: Sequence[str] | None = None) -> bytes:
    from pairclean.storage import open_regular

    with open_regular(path) as fh:  # a FIFO or device would block or never end
        if roots is not None:  # what was opened, not what the path named a moment before
            check_local_root(path, "", "shard", fh=fh, roots=roots)
        fh.seek(offset)
        return bytes(fh.read(size))


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
