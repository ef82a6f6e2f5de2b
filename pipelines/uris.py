"""Shard URIs: expansion (braces, globs, ``@list`` files), validation and streaming opens.

Supported schemes: plain local paths, ``file://``, ``http(s)://`` (streamed, never
downloaded whole) and ``s3://`` / ``gs://`` / ``gcs://`` through fsspec. Remote
credentials and endpoints come from the usual environment (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``) or from ``storage_options``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import re
import socket
import stat
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import unquote, urlparse

from pairclean.errors import InputError, ShardNotFoundError, ShardReadError, UnsupportedSchemeError, causes

__all__ = [
    "LOCAL_SCHEMES",
    "REMOTE_SCHEMES",
    "scheme_of",
    "raw_scheme",
    "expand_shards",
    "shard_stem",
    "shard_stems",
    "local_path",
    "open_shard",
    "shard_size",
    "brace_count",
    "under_prefix",
    "MAX_SHARDS_ENV",
    "HTTP_ALLOWED_ENV",
    "LOCAL_READ_ROOTS_ENV",
    "LOCAL_WRITE_ROOTS_ENV",
    "local_roots",
    "check_local_root",
    "check_local_below",
    "SocketWatch",
    "watched_opener",
    "SHARD_EXTENSIONS",
]

#: When ``expand_shards`` gets no ``max_shards``, this variable (if set) is the limit: the
#: service sets it for the job processes it starts; the CLI alone has no limit.
MAX_SHARDS_ENV = "PAIRCLEAN_MAX_SHARDS"
#: A JSON list of URI prefixes HTTP(S) reads may be redirected to (set by the service for
#: its job processes). When set, redirects are followed by hand and each hop is checked.
HTTP_ALLOWED_ENV = "PAIRCLEAN_HTTP_ALLOWED_PREFIXES"
#: JSON lists of local folders a job process may read shards and list files from, and write
#: its output (and side) folder into. The service sets them for the job processes it starts:
#: it checks a job's paths when the job is submitted, and a symlink made after that (an
#: input swapped for a link out of the input allow-list, an output folder for a link to
#: another folder) must not lead the job outside. Each path is resolved (symlinks, ``..``)
#: when it is touched and must lie inside one of the roots; unset, nothing is checked.
LOCAL_READ_ROOTS_ENV = "PAIRCLEAN_LOCAL_READ_ROOTS"
LOCAL_WRITE_ROOTS_ENV = "PAIRCLEAN_LOCAL_WRITE_ROOTS"

LOCAL_SCHEMES = frozenset({"", "file"})
REMOTE_SCHEMES = frozenset({"http", "https", "s3", "gs", "gcs"})
_GLOB_CHARS = frozenset("*?[")
# Suffixes stripped from a shard's file name to get the stem its outputs are named by.
_SHARD_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def raw_scheme(uri: str) -> str:
    """The lower-case scheme of ``uri`` as written ('' for a plain path), supported or not.

    The one home of the drive-letter rule: a one-letter "scheme" (``C:\\data``) is a
    Windows drive, i.e. a plain path."""
    scheme = urlparse(uri).scheme
    return scheme.lower() if len(scheme) > 1 else ""


def scheme_of(uri: str) -> str:
    """The lower-case scheme of ``uri`` ('' for a plain path); raises for unsupported ones."""
    scheme = raw_scheme(uri)
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
    """The output stem of a shard: its file name without ``.tar`` (``a/b/x-001.tar`` -> ``x-001``).

    The one function that names a shard's outputs, used by the scorer (``JobSpec.stems``,
    ``work.py``) and by the trainer side (``pairclean.sampler``, ``pairclean.pseudo.pairing``), so a
    sample's ``__url__`` joins to ``OUT/<stem>.parquet`` whichever form it was read by:
    plain paths, ``file://``, ``s3://``, ``gs://``, ``http(s)://`` (query string and
    fragment ignored: ``https://h/00000.tar?download=true`` -> ``00000``) and open_clip's
    ``pipe:`` commands (``pipe:aws s3 cp s3://b/00000.tar -`` -> ``00000``: the last
    argument naming a ``.tar``/``.tgz`` file). Brace lists are expanded first
    (``shard_stems``). Raises ``InputError`` for a ``pipe:`` command naming no shard.
    """
    if uri.startswith("pipe:"):
        uri = _pipe_target(uri)
    # Lenient about the scheme (hf://, ais://...): a trainer may read from anywhere, and
    # the scorer validated its own URIs when it expanded them.
    parsed = urlparse(uri)
    name = PurePosixPath(_url_path(uri) if len(parsed.scheme) > 1 else uri).name
    for suffix in _SHARD_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def shard_stems(urls: str | Sequence[str]) -> list[str]:
    """Stems of open_clip-style ``--train-data``: brace patterns expanded, ``::`` joining
    several sources (open_clip's separator), each URL through ``shard_stem``."""
    import braceexpand

    specs = [urls] if isinstance(urls, str) else list(urls)
    return [shard_stem(u) for spec in specs for part in spec.split("::") for u in braceexpand.braceexpand(part)]


def _url_path(uri: str) -> str:
    """The path of ``uri``: an http(s) URL's without query and fragment, an object key's with
    any "#" it holds (``s3://b/x#1.tar`` and ``x#2.tar`` were both ``x``)."""
    parsed = urlparse(uri)
    if parsed.fragment and parsed.scheme.lower() not in ("http", "https"):
        return f"{parsed.path}#{parsed.fragment}"
    return parsed.path


def _pipe_target(uri: str) -> str:
    """The shard a ``pipe:`` command reads: its last argument that names a tar file."""
    import shlex

    command = uri[len("pipe:") :]
    try:
        args = shlex.split(command)
    except ValueError:
        args = command.split()
    for arg in reversed(args):
        path = _url_path(arg) if raw_scheme(arg) else arg
        if path.endswith(_SHARD_SUFFIXES):
            return arg
    raise InputError(f"cannot tell which shard {uri!r} reads: no argument ends with .tar, .tar.gz or .tgz", uri=uri)


def expand_shards(
    specs: Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    max_shards: int | None = None,
    check: Callable[[str], None] | None = None,
    deadline: float | None = None,
) -> list[str]:
    """Expand shard specs into a de-duplicated, ordered list of shard URIs.

    Each spec is a URI, a brace range (``shard-{00000..00127}.tar``), a glob
    (``/data/*.tar``, ``s3://b/p/*.tar``), a folder (a local one, or a remote one ending
    with ``/``: its ``.tar``/``.tar.gz``/``.tgz`` files, sorted by name) or ``@list.txt``
    (one spec a line; ``#`` comments).
    Local shards must exist (checked here, so a typo fails before any work); remote
    shards are checked when opened. Raises ``InputError`` subclasses naming the spec.

    ``max_shards`` (default: ``$PAIRCLEAN_MAX_SHARDS`` when set, else no limit) is enforced
    while expanding: a brace pattern is counted before it is expanded, globs and list files
    stop as soon as the limit is passed, so ``{0..999999999}`` costs nothing.
    ``check(uri)`` is called on every location before it is touched (a list file before it
    is opened, a glob pattern before it is listed, a local shard before its existence is
    tested, every glob match): a caller's allow-list raises from it. ``deadline``
    (``time.monotonic()`` seconds): ``InputError`` once expanding has run past it.
    """
    limit = max_shards if max_shards is not None else _env_limit()
    if check is None and local_roots(LOCAL_READ_ROOTS_ENV) is not None:
        check = _check_read  # a job process the service started: its read roots
    budget = _Budget(limit, deadline)
    out: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        for uri in _expand_one(spec.strip(), storage_options or {}, 0, budget, check):
            if uri not in seen:
                seen.add(uri)
                out.append(uri)
    if not out:
        raise InputError("no shards given")
    return out


def _env_limit() -> int | None:
    raw = os.environ.get(MAX_SHARDS_ENV, "").strip()
    if not raw:
        return None
    try:
        return max(1, int(raw))
    except ValueError as exc:
        raise InputError(f"{MAX_SHARDS_ENV}={raw!r} is not a whole number") from exc


class _Budget:
    """Counts every URI produced (duplicates too: they cost time as well) against the limit,
    and the time spent against ``deadline`` (``time.monotonic()`` seconds; None: none)."""

    def __init__(self, limit: int | None, deadline: float | None = None) -> None:
        self.limit, self.used, self.deadline = limit, 0, deadline

    def take(self, n: int = 1, spec: str = "") -> None:
        self.used += n
        if self.limit is not None and self.used > self.limit:
            where = f" (at {spec!r})" if spec else ""
            raise InputError(
                f"more than {self.limit} shards{where}: split the job, or raise the limit", uri=spec or None
            )
        self.check_time(spec)

    def check_time(self, spec: str = "") -> None:
        """``InputError`` once the deadline has passed: a 46-byte ``{00000..N}.t[a]r`` made N
        globs over an N-file folder, N**2 work under the shard limit (3 s at N = 2,000)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            where = f" (at {spec!r})" if spec else ""
            raise InputError(f"expanding the shard specs took too long{where}: name the shards in an @list file, or "
                             "use one glob instead of a brace range of globs", uri=spec or None)


def _expand_one(
    spec: str, storage_options: Mapping[str, Any], depth: int, budget: _Budget, check: Callable[[str], None] | None
) -> Iterator[str]:
    if not spec:
        raise InputError("empty shard spec")
    if spec.startswith("@"):
        yield from _expand_list_file(spec[1:], storage_options, depth, budget, check)
        return
    import braceexpand  # webdataset's own dependency; the same brace syntax users know

    try:
        count = brace_count(spec)
    except braceexpand.UnbalancedBracesError as exc:  # type: ignore[attr-defined]  # exported, not declared
        raise InputError(f"unbalanced braces in {spec!r}", uri=spec) from exc
    if budget.limit is not None and budget.used + count > budget.limit:
        budget.take(count, spec)  # raises before braceexpand materialises anything
    for uri in braceexpand.braceexpand(spec):
        scheme = scheme_of(uri)
        if _GLOB_CHARS & set(uri):
            budget.check_time(spec)
            if check is not None:
                check(uri)
            yield from _expand_glob(uri, scheme, storage_options, budget, check)
            continue
        if check is not None:
            check(uri)
        if scheme in LOCAL_SCHEMES and os.path.isdir(local_path(uri)):
            yield from _expand_folder(uri, budget, check)
            continue
        if scheme in REMOTE_SCHEMES - {"http", "https"} and uri.endswith("/"):
            yield from _expand_glob(uri + "*", scheme, storage_options, budget, check, folder=True)
            continue
        budget.take(1, spec)
        if scheme in LOCAL_SCHEMES:
            path = local_path(uri)
            if not os.path.isfile(path):
                raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri)
        elif scheme in ("http", "https") and _url_path(uri).endswith("/"):
            raise InputError(f"{uri!r} is an HTTP folder, which cannot be listed: name its shards (a brace range such as "
                             f"'{uri}{{00000..00127}}.tar', or an @list file)", uri=uri)
        elif scheme in REMOTE_SCHEMES - {"http", "https"} and not uri.endswith(SHARD_EXTENSIONS):
            _refuse_remote_folder(uri, scheme, storage_options)  # one request, for names no shard has
        yield uri


def _refuse_remote_folder(uri: str, scheme: str, storage_options: Mapping[str, Any]) -> None:
    """``InputError`` where ``uri`` (an object store's, not named like a shard) is a folder:
    read as a shard, it failed as an "empty file". Other errors are the read's to report."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri, **storage_options)
        is_dir = fs.isdir(path)
    except Exception:  # noqa: BLE001 - credentials, network: reported where the shard is read, in its words
        return
    if is_dir:
        raise InputError(f"{uri!r} is a folder: end it with '/' to score its shards ({uri}/)", uri=uri)


#: What a folder given as input expands to: its WebDataset shards (not recursive).
SHARD_EXTENSIONS = (".tar", ".tar.gz", ".tgz")


def _expand_folder(uri: str, budget: _Budget, check: Callable[[str], None] | None) -> Iterator[str]:
    """A local folder -> its shards (``SHARD_EXTENSIONS``, hidden files skipped), sorted by
    name; img2dataset's other files beside them (``.parquet``, ``_stats.json``) are not shards.
    Raises ``ShardNotFoundError`` saying what to type when the folder holds none."""
    folder = local_path(uri)
    prefix = "file://" if scheme_of(uri) == "file" else ""
    found = []
    with os.scandir(folder) as entries:  # lazily: the limit stops a huge folder early
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(SHARD_EXTENSIONS) or not entry.is_file():
                continue
            budget.take(1, uri)
            found.append(entry.name)
    if not found:
        base = uri.rstrip("/")
        raise ShardNotFoundError(
            f"{uri!r} is a folder with no shards in it (*.tar, *.tar.gz, *.tgz); name the shards instead, "
            f"e.g. '{base}/*.tar', '{base}/{{00000..00127}}.tar' or @list.txt", uri=uri,
        )
    for name in sorted(found):
        match = prefix + os.path.join(folder, name)
        if check is not None:
            check(match)  # a match may be a symlink that leads elsewhere
        yield match


_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_ALPHABET = string.ascii_uppercase + string.ascii_lowercase


#: Brace groups nested deeper than this are refused (``brace_count`` recurses per level).
MAX_BRACE_DEPTH = 16
#: Path components after a glob's first wildcard (``_glob_below`` recurses per component).
MAX_GLOB_PARTS = 64


def brace_count(pattern: str) -> int:
    """How many strings ``braceexpand(pattern)`` yields, computed without expanding.

    Mirrors braceexpand 0.1.7's grammar (sequences, integer and letter ranges with steps,
    nesting, backslash escapes); raises its ``UnbalancedBracesError`` like it does.
    """
    import braceexpand

    total, start, pos, depth = 1, 0, 0, 0
    while pos < len(pattern):
        char = pattern[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            if depth == 0:
                start = pos
            depth += 1
            if depth > MAX_BRACE_DEPTH:  # counted by recursion: 500 nested groups were a RecursionError (a 500)
                raise InputError(f"braces nested deeper than {MAX_BRACE_DEPTH} in {pattern[:80]!r}", uri=pattern[:200])
        elif char == "}":
            depth -= 1
            if depth == 0:
                expr = pattern[start + 1 : pos]
                n = _expression_count(expr)
                total *= brace_count(expr) if n is None else n
        pos += 1
    if depth != 0:
        raise braceexpand.UnbalancedBracesError(f"Unbalanced braces: {pattern!r}")  # type: ignore[attr-defined]
    return total


def _expression_count(expr: str) -> int | None:
    match = _INT_RANGE.match(expr)
    if match:
        first, last, step = int(match.group(1)), int(match.group(2)), int(match.group(3) or 1) or 1
        return abs(last - first) // step + 1
    match = _CHAR_RANGE.match(expr)
    if match:
        step = int(match.group(3) or 1) or 1
        a, b = _ALPHABET.index(match.group(1)), _ALPHABET.index(match.group(2))
        if a < b:
            return len(_ALPHABET[a : b + 1 : step])
        return len(_ALPHABET[a : (b or -len(_ALPHABET)) - 1 : -step])
    # A sequence: the sum over its top-level comma-separated parts; None if not a sequence.
    parts, start, pos, depth = [], 0, 0, 0
    while pos < len(expr):
        char = expr[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not parts:
        return None
    parts.append(expr[start:])
    return sum(brace_count(p) for p in parts)


def _expand_list_file(
    path: str, storage_options: Mapping[str, Any], depth: int, budget: _Budget, check: Callable[[str], None] | None
) -> Iterator[str]:
    if depth > 4:
        raise InputError(f"@list files nested too deeply at {path!r}", uri=path)
    if check is not None:
        check(path)
    base = os.path.dirname(local_path(path)) if scheme_of(path) in LOCAL_SCHEMES else ""
    try:
        with _open_any(path, storage_options) as fh:
            # Line by line: a list of millions of URIs is never held whole, and the shard
            # limit stops the read as soon as it is passed.
            # utf-8-sig: a list saved by an editor that writes a byte-order mark
            for raw in io.TextIOWrapper(fh, encoding="utf-8-sig"):
                line = raw.split("#", 1)[0].strip()
                if not line:
                    continue
                # Relative local entries are relative to the list file, like a playlist.
                if base and scheme_of(line) == "" and not os.path.isabs(line) and not line.startswith("@"):
                    line = os.path.join(base, line)
                yield from _expand_one(line, storage_options, depth + 1, budget, check)
    except FileNotFoundError as exc:
        raise ShardNotFoundError(f"shard list not found: {path!r}", uri=path) from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"shard list {path!r} is not UTF-8 text", uri=path) from exc


def _expand_glob(
    uri: str, scheme: str, storage_options: Mapping[str, Any], budget: _Budget, check: Callable[[str], None] | None,
    folder: bool = False,
) -> Iterator[str]:
    """Matches of a glob, sorted; ``folder``: ``uri`` is ``PREFIX/*`` made from a remote
    folder given as input, so only ``SHARD_EXTENSIONS`` files count."""
    if scheme in LOCAL_SCHEMES:
        prefix = "file://" if scheme == "file" else ""
        matches = []
        for match in _local_glob(local_path(uri)):  # lazily: the limit stops a huge folder early
            budget.take(1, uri)
            matches.append(match)
        found = [prefix + m for m in sorted(matches)]
    elif scheme in ("http", "https"):
        raise InputError(f"globs are not supported over HTTP: {uri!r}", uri=uri)
    else:
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(uri, **storage_options)
        except ImportError as exc:
            raise UnsupportedSchemeError(f"reading {uri!r} needs an extra package: {exc}", uri=uri) from exc
        # files only: an object store's "folders" (prefixes) match a ``**`` or ``name*`` too,
        # and were read as empty shards (or collided with ``name.tar``'s stem)
        found = [f"{scheme}://{p}" for p, info in sorted(fs.glob(path, detail=True).items()) if info.get("type") != "directory"]
        if folder:
            found = [f for f in found if f.endswith(SHARD_EXTENSIONS) and not PurePosixPath(f).name.startswith(".")]
        budget.take(len(found), uri)
    if not found and folder:
        base = uri[: -len("/*")]
        raise ShardNotFoundError(f"{base + '/'!r} holds no shards (*.tar, *.tar.gz, *.tgz); name them instead, "
                                 f"e.g. '{base}/*.tar' or '{base}/{{00000..00127}}.tar'", uri=uri)
    if not found:
        raise ShardNotFoundError(f"no shard matches {uri!r}", uri=uri)
    for match in found:
        if check is not None:
            check(match)  # a match may be a symlink that leads elsewhere
        yield match


def _local_glob(pattern: str) -> Iterator[str]:
    """Regular files matching ``pattern``, found without ever going through a symlink.

    Hand-written rather than ``glob.iglob``, which descends into symlinked folders: a
    wildcard matching a link (``in/l*nk/p*``) would list and name files of the link's
    target, outside any allow-list checked on the pattern. Here the components before the
    first wildcard are taken as written (the caller's check resolves them), and every
    folder after it is entered only when it is a real folder (``lstat``), so matches
    always lie inside the pattern's literal prefix. A match that is itself a symlink to a
    file is returned (the caller's check resolves it); one to a folder is not. Hidden
    names match only a pattern part starting with ``.``, as ``glob`` does.
    """
    parts = pattern.split("/")
    first = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    base = "/".join(parts[:first]) or ("/" if pattern.startswith("/") else ".")
    rest = [p for p in parts[first:] if p]  # doubled slashes name nothing (1,500 of them were a RecursionError)
    if len(rest) > MAX_GLOB_PARTS:
        raise InputError(f"a glob with more than {MAX_GLOB_PARTS} path components after its first wildcard: "
                         f"{pattern[:80]!r}...", uri=pattern[:200])
    yield from _glob_below(base, rest)


def _glob_below(folder: str, parts: list[str]) -> Iterator[str]:
    part, rest = parts[0], parts[1:]
    if not part:  # a doubled or trailing slash
        if rest:
            yield from _glob_below(folder, rest)
        return
    if _GLOB_CHARS & set(part):
        try:
            with os.scandir(folder) as entries:
                names = sorted(e.name for e in entries)
        except OSError:
            return
        names = [n for n in names if fnmatch.fnmatchcase(n, part) and (part.startswith(".") or not n.startswith("."))]
    else:
        names = [part]
    for name in names:
        path = os.path.join(folder, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if rest:
            if stat.S_ISDIR(mode):  # never a symlink to a folder
                yield from _glob_below(path, rest)
        elif stat.S_ISREG(mode) or (stat.S_ISLNK(mode) and os.path.isfile(path)):
            yield path


def under_prefix(uri: str, prefix: str) -> bool:
    """Whether remote ``uri`` lies under ``prefix`` on path-segment boundaries.

    Same scheme and host (case-insensitive); paths compared after percent-decoding, the
    way servers and object stores read them, so ``s3://laion`` admits ``s3://laion/x`` but
    not ``s3://laion-private/x``, and ``https://h/data`` not ``https://h/database``. A path
    with ``.``/``..`` segments (decoded) never matches.
    """
    u, p = urlparse(uri), urlparse(prefix)
    if u.scheme.lower() != p.scheme.lower() or u.netloc.lower() != p.netloc.lower():
        return False
    segments = unquote(u.path).split("/")
    if "." in segments or ".." in segments:
        return False
    path, root = unquote(u.path), unquote(p.path).rstrip("/")
    return not root or path == root or path.startswith(root + "/")


def local_roots(env: str) -> list[str] | None:
    """The folders of the JSON list in ``$env`` (``LOCAL_READ_ROOTS_ENV`` or
    ``LOCAL_WRITE_ROOTS_ENV``); None when the variable is unset or "" (no check). ``[]``
    allows no local path at all (a service whose outputs are all remote)."""
    raw = os.environ.get(env)
    if not raw:
        return None
    try:
        roots = json.loads(raw)
    except ValueError as exc:
        raise InputError(f"{env} is not a JSON list") from exc
    if not isinstance(roots, list) or not all(isinstance(r, str) and r.startswith("/") for r in roots):
        raise InputError(f"{env} must be a JSON list of absolute paths")
    # Taken as given, already resolved by whoever set them: resolving them here again would
    # follow a root that was re-pointed since (the very link the check is there to catch).
    return [os.path.normpath(r) for r in roots]


def check_local_root(path: str, env: str, what: str, fh: BinaryIO | int | None = None, roots: Sequence[str] | None = None) -> None:
    """``InputError`` unless local ``path``, resolved now, lies inside a root of ``$env``
    (``local_roots``; nothing to check when unset). ``fh``: the file (or a descriptor, a
    folder's say) opened at ``path``, which must be the resolved file itself (a link swapped between the open and
    the check is refused too). ``what`` names the path in the message (never where it
    resolves to: that may be another tenant's). ``roots``: these folders instead of ``$env``'s."""
    roots = [os.path.normpath(r) for r in roots] if roots is not None else local_roots(env)
    if roots is None:
        return
    real = os.path.realpath(path)
    inside = _inside(real, roots)
    if inside and fh is not None:
        try:
            opened, there = os.fstat(fh if isinstance(fh, int) else fh.fileno()), os.stat(real)
            inside = (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)
        except (OSError, ValueError):
            inside = False
    if not inside:
        raise InputError(f"{what} {path!r} is outside the locations this job may use", uri=path)


def _inside(real: str, roots: Sequence[str]) -> bool:
    """Whether the resolved path ``real`` is one of ``roots`` or below one."""
    return any(root == "/" or real == root or real.startswith(root + "/") for root in roots)


def check_local_below(path: str, folder_fd: int, names: Sequence[str], env: str, what: str,
                      roots: Sequence[str] | None = None) -> None:
    """``InputError`` unless the folders ``names`` (one inside the other) would be made inside
    a root of ``$env`` (``roots``: these instead), made below the folder open as ``folder_fd``.

    That folder is located by its descriptor (``/proc/self/fd``), not by a path, so a link
    swapped in after it was opened cannot move the check away from where the folders will
    be made (relative to that descriptor). ``path`` (the folder meant, as given) names it in
    the message; where it resolves is never said."""
    roots = [os.path.normpath(r) for r in roots] if roots is not None else local_roots(env)
    if roots is None:
        return
    try:
        real = os.readlink(f"/proc/self/fd/{folder_fd}")
    except OSError:  # no /proc (not Linux): its path now, if it is still the folder opened
        real = _still_opened(path, len(names), folder_fd)
    if not real.startswith("/"):
        raise InputError(f"{what} {path!r} cannot be located to be made: not made", uri=path)
    if not _inside(os.path.join(real, *names), roots):
        raise InputError(f"{what} {path!r} is outside the locations this job may use", uri=path)


def _still_opened(path: str, made: int, folder_fd: int) -> str:
    """The resolved path of the folder ``made`` levels above ``path``, if it is the folder
    open as ``folder_fd`` (same device and inode); "" otherwise."""
    head = os.path.abspath(path)
    for _ in range(made):
        head = os.path.dirname(head)
    real = os.path.realpath(head)
    try:
        opened, there = os.fstat(folder_fd), os.stat(real)
    except OSError:
        return ""
    return real if (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino) else ""


def _check_read(uri: str) -> None:
    """The job process's read roots on a local ``uri`` (``expand_shards``' default check)."""
    if scheme_of(uri) in LOCAL_SCHEMES:
        check_local_root(local_path(uri), LOCAL_READ_ROOTS_ENV, "input")


def _http_allowed_from_env() -> list[str] | None:
    raw = os.environ.get(HTTP_ALLOWED_ENV)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"{HTTP_ALLOWED_ENV} is not a JSON list") from exc
    return [str(v) for v in value]


class SocketWatch:
    """A whole-request deadline for blocking HTTP reads.

    Socket timeouts bound each ``recv`` only: a server that sends a byte now and then, or
    stalls mid-body, keeps a read going for ever. The watch shuts down every socket
    registered with it when ``deadline`` (``time.monotonic()``) passes, from a timer
    thread; a read blocked on one then returns at once (end of data), so the thread and
    whatever slot it holds are free at the deadline. ``close()`` stops the timer.
    """

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if deadline is not None:
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self.expire)
            self._timer.daemon = True
            self._timer.start()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shutdown(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shutdown(sock)

    def timeout(self, default: float) -> float:
        """A per-``recv`` timeout no longer than what is left of the deadline."""
        if self.deadline is None:
            return default
        return max(0.05, min(default, self.deadline - time.monotonic()))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def watched_opener(watch: SocketWatch, *handlers: Any) -> Any:
    """A ``urllib`` opener whose HTTP(S) connections register their sockets with ``watch``."""
    import http.client
    import urllib.request

    def watched(base: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
        class Watched(base):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                super().connect()
                watch.add(self.sock)

        return Watched

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):  # type: ignore[no-untyped-def]
            return self.do_open(watched(http.client.HTTPConnection), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):  # type: ignore[no-untyped-def]
            return self.do_open(watched(http.client.HTTPSConnection), req, context=self._context)  # type: ignore[attr-defined]

    return urllib.request.build_opener(HTTP(), HTTPS(), *handlers)


def _open_http_checked(uri: str, allowed: Sequence[str], deadline: float | None = None) -> BinaryIO:
    """A forward-only HTTP(S) stream whose redirects are followed only to allowed URLs;
    with a ``deadline`` (monotonic seconds) the connection is cut when it passes."""
    import urllib.error
    import urllib.request

    class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            if not any(under_prefix(newurl, prefix) for prefix in allowed):
                # The target is not named: it is outside what this caller may see.
                raise ShardReadError(f"{uri!r} redirects outside the allowed locations", uri=uri)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    if not any(under_prefix(uri, prefix) for prefix in allowed):
        raise ShardReadError(f"{uri!r} is outside the allowed locations", uri=uri)
    watch = SocketWatch(deadline)
    opener = watched_opener(watch, _CheckedRedirects())
    try:
        response = opener.open(uri, timeout=watch.timeout(60))
    except urllib.error.HTTPError as exc:
        watch.close()
        if exc.code == 404:
            raise FileNotFoundError(uri) from exc
        raise ShardReadError(f"cannot open shard {uri!r}: HTTP {exc.code}", uri=uri) from exc
    except OSError as exc:
        watch.close()
        if watch.expired:
            raise ShardReadError(f"{uri!r} did not answer before the deadline", uri=uri) from exc
        raise
    except BaseException:
        watch.close()
        raise
    close = response.close

    def close_and_stop() -> None:
        watch.close()
        close()

    response.close = close_and_stop
    return response  # type: ignore[no-any-return]


#: Seconds to connect to an HTTP(S) shard's server, and at most between two reads of its body.
HTTP_CONNECT_S = 30.0
HTTP_READ_S = 120.0


@contextlib.contextmanager
def _open_any(uri: str, storage_options: Mapping[str, Any], http_allowed: Sequence[str] | None = None,
              deadline: float | None = None, read_timeout_s: float | None = None) -> Iterator[BinaryIO]:
    scheme = scheme_of(uri)
    if scheme in LOCAL_SCHEMES:
        # Checked before the open (nothing outside is opened, a FIFO included) and after it
        # on the file opened (a link swapped in between is refused).
        check_local_root(local_path(uri), LOCAL_READ_ROOTS_ENV, "input")
        with open(local_path(uri), "rb") as fh:
            check_local_root(local_path(uri), LOCAL_READ_ROOTS_ENV, "input", fh)
            yield fh
        return
    if scheme in ("http", "https"):
        allowed = http_allowed if http_allowed is not None else _http_allowed_from_env()
        if allowed is not None:
            with contextlib.closing(_open_http_checked(uri, allowed, deadline)) as fh:
                yield fh
            return
    import fsspec

    opts = dict(storage_options)
    if scheme in ("http", "https"):
        # block_size=0 gives a forward-only stream: a shard is never downloaded whole and
        # servers without Range support work too.
        opts.setdefault("block_size", 0)
        if "client_kwargs" not in opts:
            # aiohttp's default is 300 s for the whole response: every shard that took longer
            # to score than that failed each try ("unreadable tar: "). Time per read instead.
            import aiohttp

            # A shard time limit below that also bounds one stalled read: a server that went
            # quiet held a `--shard-timeout 20` job 120 s.
            read_s = HTTP_READ_S if read_timeout_s is None else max(1.0, min(HTTP_READ_S, read_timeout_s))
            opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=min(HTTP_CONNECT_S, read_s),
                                                                      sock_read=read_s)}
    with fsspec.open(uri, "rb", **opts) as fh:
        yield fh


@contextlib.contextmanager
def open_shard(
    uri: str, storage_options: Mapping[str, Any] | None = None, http_allowed: Sequence[str] | None = None,
    deadline: float | None = None, read_timeout_s: float | None = None,
) -> Iterator[BinaryIO]:
    """Open a shard for sequential reading; translate "not there" into ``ShardNotFoundError``.

    ``http_allowed``: URI prefixes HTTP(S) redirects may lead to (default: the JSON list in
    ``$PAIRCLEAN_HTTP_ALLOWED_PREFIXES`` when set, else redirects are followed freely).
    ``deadline`` (``time.monotonic()`` seconds; HTTP(S) with ``http_allowed`` only): the
    connection is cut when it passes, so a stalled server cannot hold the reader longer.
    ``read_timeout_s`` (HTTP(S) through fsspec): the longest wait for one read of the body,
    where it is below ``HTTP_READ_S`` (a shard's time limit: see ``read.shards.iter_pairs``).
    """
    stack = contextlib.ExitStack()
    try:
        fh = stack.enter_context(_open_any(uri, storage_options or {}, http_allowed, deadline, read_timeout_s))
    except FileNotFoundError as exc:
        unreachable = _unreachable(exc)
        if unreachable:  # fsspec's HTTP reports a refused connection as FileNotFoundError
            raise ShardReadError(f"cannot reach shard {uri!r}: {unreachable}", uri=uri) from exc
        raise ShardNotFoundError(f"shard not found: {uri!r}", uri=uri) from exc
    except ImportError as exc:
        raise UnsupportedSchemeError(f"reading {uri!r} needs an extra package: {exc}", uri=uri) from exc
    except PermissionError as exc:
        raise ShardReadError(f"permission denied reading shard {uri!r}", uri=uri) from exc
    except OSError as exc:
        raise ShardReadError(f"cannot open shard {uri!r}: {exc}", uri=uri) from exc
    with stack:
        yield fh


def _unreachable(exc: BaseException) -> str | None:
    """What failed when a "not found" was really a connection that could not be made
    (refused, timed out, no such host), from the exception it was raised from; else None."""
    for cause in list(causes(exc))[1:]:
        if isinstance(cause, (ConnectionError, TimeoutError)) or type(cause).__name__.startswith(("ClientConnector", "ServerTimeout")):
            inner = getattr(cause, "os_error", None) or cause
            return f"{type(cause).__name__}: {getattr(inner, 'strerror', None) or inner}"
    return None


def shard_size(uri: str, storage_options: Mapping[str, Any] | None = None) -> int | None:
    """The size of a shard in bytes, or None when the store does not say."""
    scheme = scheme_of(uri)
    if scheme in LOCAL_SCHEMES:
        check_local_root(local_path(uri), LOCAL_READ_ROOTS_ENV, "input")
        return os.path.getsize(local_path(uri))
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        size = fs.size(path)
        return int(size) if size is not None else None
    except Exception:  # noqa: BLE001 - size is informational only
        return None
