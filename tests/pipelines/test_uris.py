"""Shard URI expansion and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pairclean.errors import InputError, ShardNotFoundError, UnsupportedSchemeError
from pairclean.job import JobSpec
from pairclean.uris import expand_shards, shard_stem


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


def test_brace_glob_and_list_files_expand_in_order_without_duplicates(tmp_path: Path) -> None:
    _touch(tmp_path, "s-00000.tar", "s-00001.tar", "s-00002.tar")
    braces = expand_shards([str(tmp_path / "s-{00000..00002}.tar")])
    assert [Path(p).name for p in braces] == ["s-00000.tar", "s-00001.tar", "s-00002.tar"]
    globbed = expand_shards([str(tmp_path / "*.tar")])
    assert globbed == braces
    listing = tmp_path / "list.txt"
    listing.write_text("# shards\ns-00001.tar\n\nfile://" + str(tmp_path / "s-00002.tar") + "\n")
    listed = expand_shards(["@" + str(listing), str(tmp_path / "s-00001.tar")])
    assert listed == [str(tmp_path / "s-00001.tar"), "file://" + str(tmp_path / "s-00002.tar")]


def test_missing_local_shard_names_the_uri(tmp_path: Path) -> None:
    with pytest.raises(ShardNotFoundError, match="nope.tar"):
        expand_shards([str(tmp_path / "nope.tar")])
    with pytest.raises(ShardNotFoundError, match="no shard matches"):
        expand_shards([str(tmp_path / "*.tar")])


@pytest.mark.parametrize("uri", ["ftp://host/a.tar", "pipe:cat a.tar", "hdfs://x/a.tar"])
def test_unknown_schemes_are_refused(uri: str) -> None:
    with pytest.raises(UnsupportedSchemeError, match="unsupported URI scheme"):
        expand_shards([uri])


def test_remote_uris_pass_through_unchecked() -> None:
    uris = expand_shards(["https://example.org/d/s-{0..1}.tar", "s3://bucket/x.tar"])
    assert uris == ["https://example.org/d/s-0.tar", "https://example.org/d/s-1.tar", "s3://bucket/x.tar"]


def test_stems_and_collisions() -> None:
    assert shard_stem("s3://b/p/shard-001.tar") == "shard-001"
    assert shard_stem("/x/y/a.b.tar.gz") == "a.b"
    spec = JobSpec(("/a/s.tar", "/b/s.tar"), "m", None, None, "fp32", "gmm", 4, "paper", 0, 8, 10, None, True, 16)
    with pytest.raises(InputError, match="share the name"):
        spec.stems()


def test_gs_without_gcsfs_is_a_clear_error(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    from pairclean.shards import iter_pairs

    with pytest.raises(UnsupportedSchemeError, match="extra package"):
        list(iter_pairs("gs://bucket/shard-0.tar"))
