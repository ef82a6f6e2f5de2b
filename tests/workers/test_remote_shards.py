"""Remote shards over real loopback servers: HTTP (streamed) and S3 (moto's server mode).

No S3-compatible server binary installs from the package registries reachable here
(MinIO ships no PyPI or Debian server package), so S3 runs against moto's real HTTP
server (``ThreadedMotoServer``), spoken to by s3fs exactly as a real bucket would be.
"""

from __future__ import annotations

import functools
import http.server
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pairclean.read.shards import iter_pairs
from pairclean_workers.cli import main

TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--executor", "local"]


class _NoRangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files and records every request, so a test can see how a shard was fetched."""

    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        type(self).requests.append((self.path, self.headers.get("Range")))
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def http_root(tmp_path: Path, loopback_http) -> tuple[str, Path]:
    root = tmp_path / "www"
    root.mkdir()
    _NoRangeHandler.requests = []
    return loopback_http(functools.partial(_NoRangeHandler, directory=str(root))), root


def test_http_shards_stream_and_score(make_shards, http_root: tuple[str, Path], tmp_path: Path) -> None:
    base, root = http_root
    make_shards(n_shards=2, per_shard=5, folder=root)
    out = tmp_path / "out"
    assert main(["score", f"{base}/part-{{00000..00001}}.tar", "--out", str(out), *TINY]) == 0
    rows = pq.read_table(out / "part-00001.parquet")
    assert rows.num_rows == 5 and set(rows.column("status").to_pylist()) == {"ok"}
    # each shard was fetched by one plain GET: streamed, not range-downloaded in pieces
    gets = [(p, r) for p, r in _NoRangeHandler.requests if p.endswith(".tar")]
    assert sorted(p for p, _ in gets) == ["/part-00000.tar", "/part-00001.tar"]
    assert all(r is None for _, r in gets)


def test_http_missing_shard_is_reported_by_uri(http_root: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, _ = http_root
    assert main(["score", f"{base}/nope.tar", "--out", str(tmp_path / "o"), *TINY]) == 3
    assert f"{base}/nope.tar" in capsys.readouterr().err


def test_s3_shards_with_brace_glob_and_list(make_shards, s3_endpoint: str, tmp_path: Path) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir("bucket")
    for path in make_shards(n_shards=3, per_shard=4):
        fs.put(str(path), f"bucket/data/{path.name}")
    opt = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    out = tmp_path / "out"
    assert main(["score", "s3://bucket/data/part-*.tar", "--out", str(out), *TINY, *opt]) == 0
    assert sorted(p.name for p in out.glob("*[0-9].parquet")) == [f"part-{i:05d}.parquet" for i in range(3)]
    listing = tmp_path / "list.txt"
    listing.write_text("s3://bucket/data/part-{00000..00001}.tar\n")
    assert main(["score", f"@{listing}", "--out", str(tmp_path / "o2"), *TINY, *opt]) == 0
    a = pq.read_table(out / "part-00001.parquet").column("similarity").to_pylist()
    b = pq.read_table(tmp_path / "o2/part-00001.parquet").column("similarity").to_pylist()
    assert a == b
    keys = [p.key for p in iter_pairs("s3://bucket/data/part-00002.tar", _read_opts(s3_endpoint))]
    assert keys == pq.read_table(out / "part-00002.parquet").column("key").to_pylist()


def _read_opts(endpoint: str):
    from pairclean.read.shards import ReadOptions

    return ReadOptions(storage_options={"endpoint_url": endpoint})


def test_file_scheme_uris(make_shards, tmp_path: Path) -> None:
    shard = make_shards(n_shards=1, per_shard=3)[0]
    assert main(["score", f"file://{shard}", "--out", f"file://{tmp_path / 'o'}", *TINY]) == 0
    assert pq.read_table(tmp_path / "o" / "part-00000.parquet").num_rows == 3


def test_s3_names_with_glob_characters_are_read_and_deleted_as_names(make_shards, s3_endpoint: str, tmp_path: Path) -> None:
    """fsspec expands the paths of a list ``cat``/``rm`` as globs: a shard ``x[1].tar`` on S3
    made its own completion record unreadable (the job, every rerun and every reader failed
    on it), and a batched delete of ``x[1].json`` would take ``x1.json`` along."""
    import s3fs

    from pairclean.output.folder import OutputDir

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir("globchars")
    first, second = make_shards(n_shards=2, per_shard=4)
    fs.put(str(first), "globchars/in/x[1].tar")
    fs.put(str(second), "globchars/in/y.tar")
    opt = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    assert main(["score", "s3://globchars/in/", "--out", "s3://globchars/out", *TINY, *opt]) == 0
    assert main(["score", "s3://globchars/in/", "--out", "s3://globchars/out", *TINY, *opt]) == 0  # resumed: nothing to do
    assert main(["inspect", "s3://globchars/out", *opt]) == 0
    out = OutputDir("s3://globchars/out", {"endpoint_url": s3_endpoint})
    assert sorted(out.committed()) == ["x[1]", "y"]
    for name in ("x1.json", "x[1].json", "xa.json"):
        out.store.put(f"probe/{name}", b"{}")
    assert out._get_many(["probe/x[1].json", "probe/missing[2].json", "probe/x1.json"]) == [b"{}", None, b"{}"]
    out._rm_many(["probe/x[1].json", "probe/xa.json"])
    assert sorted(out.store.list("probe")) == ["x1.json"]


def test_object_store_folders_are_never_read_as_shards(make_shards, s3_endpoint: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``s3://b/fold/**`` matched the "folders" fold and fold/sub as shards (each failed as an
    empty file, the job FAILED); ``s3://b/fold*`` collided fold with fold.tar; a folder named
    without its trailing "/" failed as an empty file; an HTTP folder "would be named .parquet"."""
    import s3fs

    from pairclean.errors import InputError
    from pairclean.uris import expand_shards

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir("folders")
    first, second, third = make_shards(n_shards=3, per_shard=2)
    fs.put(str(first), "folders/fold/a.tar")
    fs.put(str(second), "folders/fold/sub/b.tar")
    fs.put(str(third), "folders/fold.tar")
    opts = {"endpoint_url": s3_endpoint}
    assert expand_shards(["s3://folders/fold/**"], opts) == ["s3://folders/fold/a.tar", "s3://folders/fold/sub/b.tar"]
    assert expand_shards(["s3://folders/fold*"], opts) == ["s3://folders/fold.tar"]
    with pytest.raises(InputError, match=r"is a folder: end it with '/'"):
        expand_shards(["s3://folders/fold"], opts)
    with pytest.raises(InputError, match="is an HTTP folder, which cannot be listed"):
        expand_shards(["https://example.org/shards/"], opts)
    opt = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    assert main(["score", "s3://folders/fold/**", "--out", str(tmp_path / "out"), *TINY, *opt]) == 0
