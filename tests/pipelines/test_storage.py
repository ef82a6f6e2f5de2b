"""``pairclean.storage``: whole-object writes and a folder's reads on a real local disk."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from pairclean.errors import UnsupportedSchemeError
from pairclean.storage import Store, WriteInfo, parquet_bytes, sha256_file, write_file_atomic

# Writes ``argv[2]`` bytes to ``argv[1]`` under a file-size limit smaller than that: the
# write fails half way (EFBIG), as on a full disk. Prints the error's class.
FAILING_WRITE = """
import resource, signal, sys
from pairclean.storage import write_file_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_file_atomic(sys.argv[1], b"n" * int(sys.argv[2]))
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def _hidden(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_write_file_atomic_writes_whole_files_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "a.bin"
    write_file_atomic(target, b"first")
    assert target.read_bytes() == b"first"
    write_file_atomic(str(target), b"second")  # str or PathLike, replacing
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["a.bin"]


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "scores.parquet"
    target.write_bytes(b"old complete contents")
    done = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(target), str(1 << 20)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] in ("OSError", "FileTooLargeError") and done.stdout.split()[1] == "27"  # EFBIG
    assert target.read_bytes() == b"old complete contents"
    assert sorted(os.listdir(tmp_path)) == ["scores.parquet"]  # the partial temporary was removed


def test_a_failed_first_write_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new.bin"
    done = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(target), str(1 << 20)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert os.listdir(tmp_path) == []


def test_a_rename_that_fails_removes_the_temporary(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a folder where the file should go: the rename fails
    with pytest.raises(OSError):
        write_file_atomic(tmp_path / "taken", b"data")
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert os.listdir(tmp_path / "taken") == []


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    versions = [bytes([v]) * (2 << 20) for v in range(8)]
    write_file_atomic(target, versions[0])
    seen: set[bytes] = set()
    bad: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = target.read_bytes()
            if data not in versions:
                bad.append(len(data))
            seen.add(data[:1])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for version in versions[1:] * 3:
            write_file_atomic(target, version)
    finally:
        stop.set()
        reader.join()
    assert bad == []
    assert len(seen) > 1  # the reader did read while writes happened


def test_store_put_get_exists_size_list_rm_on_a_local_folder(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "out"))  # created on demand
    assert store.local and store.list() == [] and store.get("a.txt") is None
    assert not store.exists("a.txt") and store.size("a.txt") is None
    info = store.put("a.txt", b"hello")
    assert info == WriteInfo(5, hashlib.sha256(b"hello").hexdigest())
    assert (tmp_path / "out" / "a.txt").read_bytes() == b"hello"
    store.put("sub/b.txt", b"x" * 10)
    assert store.exists("a.txt") and store.get("a.txt") == b"hello" and store.size("sub/b.txt") == 10
    assert store.list() == ["a.txt", "sub"]
    assert store.list("sub") == ["b.txt"]
    assert store.list("missing") == [] and store.list("a.txt") == []
    # put replaces an existing object (documented); rm says whether it deleted anything
    assert store.put("a.txt", b"bye").bytes == 3 and store.get("a.txt") == b"bye"
    assert store.rm("a.txt") is True and store.rm("a.txt") is False
    assert not store.exists("a.txt") and store.list() == ["sub"]
    assert _hidden(tmp_path / "out") == [] and _hidden(tmp_path / "out" / "sub") == []


def test_store_names_and_urls(tmp_path: Path) -> None:
    store = Store(str(tmp_path) + "/")
    assert store.root == str(tmp_path)
    assert store.path("x/y.parquet") == f"{tmp_path}/x/y.parquet" and store.path() == str(tmp_path)
    assert store.url("y.parquet") == os.path.join(str(tmp_path), "y.parquet") and store.url() == str(tmp_path)
    via_uri = Store(f"file://{tmp_path}")
    assert via_uri.local and via_uri.root == str(tmp_path)
    via_uri.put("z.bin", b"1")
    assert store.get("z.bin") == b"1"
    relative = Store("rel-out")
    assert relative.root == os.path.abspath("rel-out")


@pytest.mark.parametrize("uri", ["http://example.org/out", "https://h/x", "pipe:cat", "ftp://h/out"])
def test_outputs_refuse_schemes_that_cannot_be_written(uri: str) -> None:
    with pytest.raises(UnsupportedSchemeError, match="unsupported scheme"):
        Store(uri)


def test_parquet_round_trip_and_footer_metadata(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    table = pa.table({"key": ["a", "b"], "weight": [0.5, 1.0]}).replace_schema_metadata({b"pairclean": b"{}"})
    info = store.put_parquet("t.parquet", table)
    assert info.bytes == (tmp_path / "t.parquet").stat().st_size
    assert info.sha256 == sha256_file(tmp_path / "t.parquet") == hashlib.sha256(parquet_bytes(table)).hexdigest()
    assert store.read_parquet("t.parquet").select(["key", "weight"]).equals(table.select(["key", "weight"]))
    assert store.read_parquet("t.parquet", columns=["weight"]).column_names == ["weight"]
    assert store.parquet_metadata("t.parquet") == {b"pairclean": b"{}"}
    store.put("not.parquet", b"plain text")
    assert store.parquet_metadata("not.parquet") is None
    assert store.parquet_metadata("absent.parquet") is None


def test_remove_temporaries_deletes_only_our_leftovers(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    (tmp_path / "sub").mkdir()
    leftovers = [tmp_path / ".a.parquet.tmp-123-abcd1234", tmp_path / "sub" / ".b.json.tmp-9-00000000"]
    kept = [tmp_path / "a.parquet", tmp_path / ".hidden-user-file", tmp_path / "x.tmp-1", tmp_path / "sub" / "b.json"]
    for path in leftovers + kept:
        path.write_bytes(b"?")
    assert store.remove_temporaries() == 1
    assert store.remove_temporaries("sub") == 1
    assert store.remove_temporaries() == 0
    assert [p.exists() for p in leftovers] == [False, False]
    assert all(p.exists() for p in kept)
    # below sub-folders (refine's records in state/refine/<heads>/, left by a kill -9), never
    # a temporary of this very process (a write in flight: the lock's heartbeat)
    (tmp_path / "sub" / "deep").mkdir()
    deep, mine = tmp_path / "sub" / "deep" / ".p.json.tmp-77-0badcafe", tmp_path / "sub" / f".lock.json.tmp-{os.getpid()}-12345678"
    deep.write_bytes(b"?")
    mine.write_bytes(b"?")
    assert store.remove_temporaries("sub") == 0 and deep.exists()
    assert store.remove_temporaries("", depth=2) == 1 and not deep.exists() and mine.exists()


def test_a_store_pickles_to_the_same_folder(tmp_path: Path) -> None:
    store = Store(str(tmp_path), {"anon": True})
    store.put("k", b"v")
    copy = pickle.loads(pickle.dumps(store))
    assert (copy.uri, copy.root, copy.storage_options) == (store.uri, store.root, {"anon": True})
    assert copy.get("k") == b"v"


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)  # more than one read block
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_fifo_under_a_file_name_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    """A FIFO planted where a table or state file belongs blocked every reader in open()
    (the REST job's warnings, the pages) until a writer came: now each read refuses it."""
    store = Store(str(tmp_path / "out"))
    store.put("a.parquet", parquet_bytes(pa.table({"x": [1]})))
    os.mkfifo(tmp_path / "out" / "fifo.parquet")
    results: dict[str, object] = {}

    def read_all() -> None:
        for name, call in (("get", store.get), ("size", store.size), ("open_read", store.open_read)):
            try:
                call("fifo.parquet")
                results[name] = "read"
            except OSError as exc:
                results[name] = str(exc)
        results["parquet_metadata"] = store.parquet_metadata("fifo.parquet")

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a read of a FIFO blocked"
    assert all("not a regular file" in str(results[n]) for n in ("get", "size", "open_read")), results
    assert results["parquet_metadata"] is None
    assert store.parquet_metadata("a.parquet") == {} and store.size("a.parquet") > 0  # regular files read as before


def test_names_that_leave_the_folder_are_refused_before_anything_is_touched(tmp_path: Path) -> None:
    """Names come from pairclean's own state files too (the manifest's output, exports.json's
    written list): '../../victim/notes.txt' there had score --overwrite delete a file outside."""
    from pairclean.errors import InputError

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    store = Store(str(tmp_path / "out"))
    store.put("a..b.parquet", b"x")  # two dots inside a name are a name
    for name in ("../victim.txt", "sub/../../victim.txt", "/etc/hostname", ".."):
        for call in (store.rm, store.get, store.exists, lambda n: store.put(n, b"evil")):
            with pytest.raises(InputError, match="leaves the folder"):
                call(name)
    assert victim.read_text() == "mine"


def test_get_reads_at_most_max_get_bytes(tmp_path: Path) -> None:
    """A 3 GiB sparse job.json (no disk used) cost 4 GB of memory and 14 s before its error."""
    from pairclean.errors import InputError
    from pairclean.storage import MAX_GET_BYTES

    store = Store(str(tmp_path / "out"))
    store.put("small.json", b"{}")
    with open(tmp_path / "out" / "huge.json", "wb") as fh:
        fh.truncate(MAX_GET_BYTES + 1)
    with pytest.raises(InputError, match="is over 64 MiB"):
        store.get("huge.json")
    assert store.get("small.json") == b"{}"


def test_a_refused_write_names_the_file_it_was_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a read-only folder the error named the temporary, relative to a folder it did not
    say (``Read-only file system: '.lock.json.tmp-...'``)."""
    import errno

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(path, str) and ".tmp-" in path:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError) as refused:
        Store(str(tmp_path)).put("state.json", b"{}")
    assert refused.value.errno == errno.EROFS and refused.value.filename == str(tmp_path / "state.json")
