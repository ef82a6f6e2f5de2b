"""Where outputs go: a folder on any filesystem fsspec reaches, written one whole object at a time.

``Store`` wraps an fsspec filesystem and a root folder (a local path, ``file://``,
``s3://``, ``gs://``). Every write is *complete or absent*:

- local files are written under a hidden temporary name in the same folder, fsynced and
  renamed into place (a rename is atomic on POSIX);
- object stores receive the final object in one request (``pipe_file``: a single PUT, or
  for large objects a multipart upload that becomes visible only when completed). Nothing
  is ever appended, because object stores cannot append.

Readers never see a partial file, so a crash at any point leaves either the old object,
the new one, or none.
"""

from __future__ import annotations

import builtins

import contextlib
import errno
import fcntl
import hashlib
import io
import os
import stat
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from pairclean.errors import InputError, UnsupportedSchemeError
from pairclean.uris import LOCAL_WRITE_ROOTS_ENV, check_local_below, check_local_root, raw_scheme

__all__ = ["OUTPUT_SCHEMES", "Store", "WriteInfo", "parquet_bytes", "write_file_atomic", "sha256_file", "open_regular"]

#: Where outputs may go. HTTP has no portable write; pipe: would run a command.
OUTPUT_SCHEMES = frozenset({"", "file", "s3", "gs", "gcs"})
_TMP_MARK = ".tmp-"
#: Exactly the names ``write_file_atomic`` gives its temporaries (".<name>.tmp-<pid>-<8 hex>"):
#: a user's own hidden file with ".tmp-" in its name is not ours to delete.
_TEMPORARY = re.compile(r"\..+\.tmp-([0-9]+)-[0-9a-f]{8}")


@dataclass(frozen=True)
class WriteInfo:
    """What was written: bytes and their sha256 (computed from the bytes sent, no re-read)."""

    bytes: int
    sha256: str


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` serialised as one zstd-compressed Parquet file in memory.

    Serialising first is what makes object-store writes a single complete PUT; score
    tables and sidecars of a shard are tens of MB at most.
    """
    sink = io.BytesIO()
    if table.num_rows == 0:
        # No row group at all, rather than one of 0 rows: Hugging Face datasets sizes its
        # batches by the first row group and fails on an empty one ("BatchSize must be
        # greater than 0"), so an empty shard's table would break OUT for it.
        pq.ParquetWriter(sink, table.schema, compression="zstd").close()
    else:
        pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _scheme(uri: str) -> str:
    return raw_scheme(uri)


#: The most ``Store.get`` reads: a job's own files (state JSON, the contrast bank of at most
#: 8 MiB, the judge's calibration ratios) are far smaller.
MAX_GET_BYTES = 64 * 2**20


def _conditional_puts(fs: Any) -> bool:
    """Whether ``fs`` writes with ``mode="create"`` as one conditional request: s3fs does
    (``If-None-Match: *``, AWS S3 and S3-compatible servers that honour it)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"s3", "s3a"} & set(protocols))


class Store:
    """A folder at ``uri`` (created on demand); names are ``/``-separated paths inside it.

    ``side``: a second folder on the same filesystem (``OUT.pairclean``) that holds the
    names under ``schema.SIDE_FOLDERS`` (``_pairclean/...`` is stored as
    ``side/state/...``, see ``schema.side_name``): callers keep one set of logical names
    whatever the layout. Raises ``UnsupportedSchemeError`` for schemes outputs cannot go to and
    ``InputError`` when the filesystem's package is missing.
    """

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None, side: str | None = None,
                 roots: Sequence[str] | None = None) -> None:
        #: Local folders every path must resolve inside (``path``); None: the job process's
        #: write roots from the environment, if any.
        self.roots = list(roots) if roots is not None else None
        #: Called before each data file is written (``OutputDir.write_table``): the run lock's
        #: ``check`` while a run holds the folder (``RunLock.acquire`` sets it), so a run that
        #: lost its lock while it stalled writes no table after it wakes.
        self.write_guard: Callable[[], None] | None = None
        scheme = _scheme(uri)
        if scheme not in OUTPUT_SCHEMES:
            raise UnsupportedSchemeError(
                f"output {uri!r}: unsupported scheme {scheme!r}; use a local path, file://, s3:// or gs://",
                uri=uri,
            )
        self.uri = uri.rstrip("/") or uri
        self.storage_options = dict(storage_options or {})
        self.local = scheme in ("", "file")
        if self.local:
            path = urlparse(uri).path if scheme == "file" else uri
            self.root = os.path.abspath(path)
            self.fs: Any = None
        else:
            import fsspec

            try:
                # Listings must be fresh: another process (a worker) writes into this folder.
                self.fs, root = fsspec.core.url_to_fs(uri, use_listings_cache=False, **self.storage_options)
            except ImportError as exc:
                raise InputError(f"writing to {uri!r} needs an extra package: {exc}", uri=uri) from exc
            self.root = root.rstrip("/")
            self.scheme = scheme
        self.side = side
        self.side_root: str | None = None
        if side is not None:
            if _scheme(side) != scheme:
                raise InputError(f"the side folder {side!r} of {uri!r} must be on the same filesystem", uri=side)
            self.side_root = os.path.abspath(urlparse(side).path if scheme == "file" else side) if self.local else (
                self.fs._strip_protocol(side).rstrip("/"))

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray ships a Store to workers: rebuild the filesystem there rather than pickle it.
        return (Store, (self.uri, self.storage_options, self.side, self.roots))

    # -- names ------------------------------------------------------------------------------
    def _where(self, name: str) -> tuple[str, str]:
        """(root, name inside it) of the logical ``name``: the side folder for side names.
        ``InputError`` for a name that would leave the folder (``_inside``)."""
        _inside(name, self.uri)
        if self.side_root is not None and name:
            from .schema import side_name

            physical = side_name(name)
            if physical is not None:
                return self.side_root, physical
        return self.root, name

    def path(self, name: str = "") -> str:
        """The filesystem path of ``name`` inside the folder (or its side folder).

        Local folders with roots (``roots``, else a job process's ``uris.LOCAL_WRITE_ROOTS_ENV``):
        every read and write goes through here, and the path, resolved now, must lie inside
        them (``InputError`` otherwise); each read, listing, write and delete then checks
        again what it opened (a descriptor: ``_open_checked``, ``write_file_atomic``), so a
        link swapped in between leads nowhere either."""
        root, name = self._where(name)
        path = f"{root}/{name}" if name else root
        if self.local:  # before anything is touched; reads and writes check what they opened again
            check_local_root(path, LOCAL_WRITE_ROOTS_ENV, "output", roots=self.roots)
        return path

    def url(self, name: str = "") -> str:
        """A URI users can paste (``s3://b/out/x.parquet`` or a local path)."""
        if self.local:
            root, physical = self._where(name)
            return os.path.join(root, physical) if physical else root
        return f"{self.scheme}://{self.path(name)}"

    # -- writing ----------------------------------------------------------------------------
    def _check_opened(self, path: str, fd: int) -> None:
        """The root check again on what was opened at ``path`` (a file or a folder): a link
        swapped in between ``path``'s check and the open is refused (``check_local_root``)."""
        try:
            check_local_root(path, LOCAL_WRITE_ROOTS_ENV, "output", fh=fd, roots=self.roots)
        except InputError:
            os.close(fd)
            raise

    def _open_checked(self, path: str, flags: int) -> int:
        """A descriptor of local ``path``, opened and then checked against the roots."""
        fd = os.open(path, flags)
        self._check_opened(path, fd)
        return fd

    def _open_file(self, path: str) -> int:
        """A read-only descriptor of the local regular file ``path``, checked against the
        roots (``_regular_only``: ``OSError`` for anything but a regular file)."""
        return _regular_only(self._open_checked(path, os.O_RDONLY | os.O_NONBLOCK), path)

    def put(self, name: str, data: bytes, replace: bool = True) -> WriteInfo:
        """Write ``data`` as ``name``, complete or not at all; replaces an existing object.
        ``replace=False``: ``FileExistsError`` where ``name`` exists, checked and written in
        one step, on local folders and S3 (a conditional PUT, ``If-None-Match: *``; a store
        that ignores the condition writes as with ``True``); other object stores write as
        with ``True`` (fsspec has no conditional write for them)."""
        if self.local:
            path = self.path(name)
            write_file_atomic(path, data, check_folder=lambda folder, fd: check_local_root(
                folder, LOCAL_WRITE_ROOTS_ENV, "output", fh=fd, roots=self.roots),
                check_new=lambda fd, names: check_local_below(
                    os.path.dirname(path), fd, names, LOCAL_WRITE_ROOTS_ENV, "output", roots=self.roots), replace=replace)
        else:
            create = {} if replace or not _conditional_puts(self.fs) else {"mode": "create"}
            try:
                self.fs.pipe_file(self.path(name), data, **create)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.filename is None:  # s3fs: "The specified bucket does not exist", naming nothing
                    raise type(exc)(exc.errno, exc.strerror or str(exc), self.url(name)) from exc
                raise
        return WriteInfo(len(data), hashlib.sha256(data).hexdigest())

    def put_parquet(self, name: str, table: pa.Table) -> WriteInfo:
        """Write ``table`` as Parquet at ``name`` (see ``put``)."""
        return self.put(name, parquet_bytes(table))

    def rm(self, name: str) -> bool:
        """Delete ``name`` if present; True when something was deleted. Callers decide what is theirs."""
        try:
            if self.local:
                path = self.path(name)
                dfd = self._open_checked(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
                try:  # unlinked in the folder checked, not in wherever a link leads by then
                    os.unlink(os.path.basename(path), dir_fd=dfd)
                finally:
                    os.close(dfd)
            else:
                self.fs.rm_file(self.path(name))
            return True
        except FileNotFoundError:
            return False

    # -- reading ----------------------------------------------------------------------------
    def get(self, name: str, max_bytes: int | None = MAX_GET_BYTES) -> bytes | None:
        """The bytes of ``name``, or None when it does not exist; ``InputError`` past
        ``max_bytes`` (default ``MAX_GET_BYTES``: a job's state files are at most a few MiB,
        and a 3 GiB sparse job.json cost 4 GB of memory and 14 s before its error). None
        reads it whole: for what grows with the job (the manifest of 100,000s of shards)."""
        try:
            if self.local:
                with os.fdopen(self._open_file(self.path(name)), "rb") as fh:
                    data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
            elif max_bytes is None:
                data = bytes(self.fs.cat_file(self.path(name)))
            else:
                data = bytes(self.fs.cat_file(self.path(name), start=0, end=max_bytes + 1))
        except FileNotFoundError:
            return None
        if max_bytes is not None and len(data) > max_bytes:
            raise InputError(f"{self.url(name)} is over {max_bytes >> 20} MiB, which none of the job's own files is: "
                             "damaged or not pairclean's", uri=self.url(name))
        return data

    def exists(self, name: str) -> bool:
        """Whether the object ``name`` exists."""
        if self.local:
            return os.path.exists(self.path(name))
        return bool(self.fs.exists(self.path(name)))

    def is_file(self) -> bool:
        """Whether the folder's own path is a file (an object, remotely): no folder can be there."""
        if self.local:
            return os.path.isfile(self.path())
        return bool(self.fs.isfile(self.root))

    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, None when absent."""
        try:
            if self.local:
                fd = self._open_file(self.path(name))
                try:
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
            return int(self.fs.size(self.path(name)))
        except FileNotFoundError:
            return None

    def list(self, folder: str = "") -> list[str]:
        """Names of the entries directly inside ``folder`` (files and sub-folders), sorted;
        [] when the folder does not exist."""
        try:
            if self.local:
                fd = self._open_checked(self.path(folder), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    return sorted(os.listdir(fd))
                finally:
                    os.close(fd)
            entries = self.fs.ls(self.path(folder), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.path(folder).rstrip("/") + "/"
        return sorted({e.rstrip("/")[len(base):] for e in entries if e.rstrip("/").startswith(base)} - {""})

    def sizes(self, folder: str = "") -> dict[str, int]:
        """Size in bytes of each file directly inside ``folder`` (one listing, also on object
        stores: a resume compares every table with its record without a request per table);
        {} when the folder does not exist. Links count as what they lead to; sub-folders are left out."""
        try:
            if self.local:
                fd = self._open_checked(self.path(folder), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    out = {}
                    for name in os.listdir(fd):
                        try:  # through links, as ``size`` reads them (a folder of cp -rs or DVC links)
                            st = os.stat(name, dir_fd=fd)
                        except OSError:  # a dangling link: as good as gone
                            continue
                        if stat.S_ISREG(st.st_mode):
                            out[name] = st.st_size
                    return out
                finally:
                    os.close(fd)
            entries = self.fs.ls(self.path(folder), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        base = self.path(folder).rstrip("/") + "/"
        return {e["name"].rstrip("/")[len(base):]: int(e["size"]) for e in entries
                if e.get("type") == "file" and e["name"].startswith(base) and e.get("size") is not None}

    def open_read(self, name: str) -> Any:
        """A binary file object for ``name`` (random access; for Parquet footers)."""
        if self.local:
            return os.fdopen(self._open_file(self.path(name)), "rb")
        return self.fs.open(self.path(name), "rb")

    def sha256(self, name: str) -> str | None:
        """Hex sha256 of ``name``, read in blocks (a table of any size: ``get`` reads at most
        ``MAX_GET_BYTES``), or None when it does not exist."""
        digest = hashlib.sha256()
        try:
            with self.open_read(name) as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
        except FileNotFoundError:
            return None
        return digest.hexdigest()

    def read_parquet(self, name: str, columns: builtins.list[str] | None = None) -> pa.Table:
        """Read the Parquet file ``name``."""
        with self.open_read(name) as fh:
            return pq.read_table(fh, columns=columns)

    def parquet_metadata(self, name: str) -> dict[bytes, bytes] | None:
        """Key-value metadata of the Parquet file ``name`` (footer only), or None when the
        object is missing or is not Parquet."""
        try:
            with self.open_read(name) as fh:
                return dict(pq.ParquetFile(fh).schema_arrow.metadata or {})
        except FileNotFoundError:
            return None
        except (pa.ArrowInvalid, OSError):
            return None

    def remove_temporaries(self, folder: str = "", depth: int = 0) -> int:
        """Delete hidden temporaries our own local writes left behind after a crash, in
        ``folder`` and its sub-folders ``depth`` levels down (never through a link)."""
        if not self.local:
            return 0  # object stores have no temporaries: a PUT is all or nothing
        removed = 0
        for name in self.list(folder):
            child = f"{folder}/{name}" if folder else name
            found = _TEMPORARY.fullmatch(name)
            if found and found.group(1) != str(os.getpid()):  # this process's own are writes in flight (the lock's beat)
                removed += self.rm(child)
            elif depth > 0 and not os.path.islink(self.path(child)) and os.path.isdir(self.path(child)):
                removed += self.remove_temporaries(child, depth - 1)
        return removed


def _inside(name: str, uri: str) -> None:
    """``InputError`` unless ``name`` stays inside the folder: no absolute name, no ``..``
    part. Names come from pairclean itself and from its state files (the manifest's
    ``output``, ``exports.json``'s ``written``), which a damaged or hostile folder can hold:
    ``../../x`` there had ``score --overwrite`` delete, and ``rescore`` rewrite, files
    outside the job's folders."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts:
        raise InputError(f"{uri}: the name {name!r} (read from the job's own files) leaves the folder; the folder's state "
                         "is damaged or was tampered with: nothing outside it is touched", uri=uri)


def _regular_only(fd: int, path: str) -> int:
    """``fd`` (opened with ``O_NONBLOCK``) when it is a regular file, the flag cleared; else
    it is closed and ``OSError`` raised. Checked before any read: a FIFO planted under a
    table's name blocked its reader (a trainer's DataLoader worker, every REST poll of the
    job) for good, as ``open()`` without the flag waits for a writer."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str]) -> Any:
    """A binary file object reading the local regular file ``path``; ``OSError`` (never a
    wait) for a FIFO, device or folder there (``_regular_only``)."""
    where = os.fspath(path)
    return os.fdopen(_regular_only(os.open(where, os.O_RDONLY | os.O_NONBLOCK), where), "rb")


def write_file_atomic(final: str | os.PathLike[str], data: bytes, check_folder: Callable[[str, int], None] | None = None,
                      check_new: Callable[[int, Sequence[str]], None] | None = None, replace: bool = True) -> None:
    """Write a local file complete or not at all: hidden temporary, fsync, rename.

    Everything happens relative to the folder opened once (a descriptor): the temporary is
    created ``O_EXCL | O_NOFOLLOW`` there and renamed there, so a link swapped in for the
    folder, or planted at the temporary's name, after a check cannot redirect the write.
    ``check_folder(path, fd)``: raises unless the folder opened is one the caller may write
    (``Store``'s roots). Missing folders are made first (``_open_folder``); ``check_new(fd,
    names)`` raises unless the folders ``names`` may be made below the folder open as ``fd``.
    ``replace=False``: ``FileExistsError`` where ``final`` exists (the temporary is linked to
    its name, which no other writer can have taken meanwhile: an exclusive create)."""
    final = os.fspath(final)
    folder = os.path.dirname(final) or "."
    name = os.path.basename(final)
    dfd = _open_folder(folder, check_new)
    try:
        if check_folder is not None:
            check_folder(folder, dfd)
        # Unique per writer: two processes racing on one name never share a temporary.
        tmp = f".{name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666, dir_fd=dfd)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if replace:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.filename is None or exc.filename in (tmp, name):
                # a failed write (EFBIG, ENOSPC) names no file, a refused create (a read-only
                # folder) the temporary, relative to a folder the message does not say: name
                # the file it was for
                raise OSError(exc.errno, exc.strerror or str(exc), final) from exc
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)


def _open_folder(folder: str, check_new: Callable[[int, Sequence[str]], None] | None = None) -> int:
    """A descriptor of local ``folder``, its missing folders made first.

    They are made from the nearest folder that exists, held by a descriptor: each is made
    and opened relative to its parent's descriptor and never through a link
    (``O_NOFOLLOW``), after ``check_new(fd, names)`` approved them. ``os.makedirs`` walked
    the path by name, so a link swapped in after a caller's check of the path made folders
    wherever it led."""
    missing: list[str] = []
    head = os.path.abspath(folder)
    while True:
        try:
            fd = os.open(head, os.O_RDONLY | os.O_DIRECTORY)
            break
        except FileNotFoundError:
            head, part = os.path.split(head)
            if not part:
                raise
            missing.append(part)
    try:
        names = missing[::-1]
        if names and check_new is not None:
            check_new(fd, names)
        for part in names:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a local file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
