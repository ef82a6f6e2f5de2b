"""Shard URI expansion and validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pairclean.errors import InputError, ShardNotFoundError, UnsupportedSchemeError
from pairclean.spec import JobSpec
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
    # a list an editor saved with a byte-order mark (it was read as part of the first name)
    listing.write_bytes(b"\xef\xbb\xbfs-00000.tar\ns-00002.tar\n")
    assert [Path(p).name for p in expand_shards(["@" + str(listing)])] == ["s-00000.tar", "s-00002.tar"]


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


@pytest.mark.parametrize("names", [("A-000.tar", "a-000.tar"), ("caf\u00e9.tar", "cafe\u0301.tar"), ("CAF\u00c9.tar", "cafe\u0301.tar")])
def test_names_that_differ_only_in_case_or_normalisation_collide(names: tuple[str, str]) -> None:
    """macOS and Windows take such names for one file: the second table would overwrite the first."""
    spec = JobSpec(tuple(f"/d/{n}" for n in names), "m", None, None, "fp32", "gmm", 4, "paper", 0, 8, 10, None, True, 16)
    with pytest.raises(InputError, match="differ only in case or Unicode normalisation"):
        spec.stems()
    apart = JobSpec(("/d/a-000.tar", "/d/a-001.tar", "/d/STRASSE.tar", "/d/stra\u00dfe.tar"), "m", None, None, "fp32", "gmm", 4, "paper", 0, 8, 10, None, True, 16)
    assert len(set(apart.stems().values())) == 4


def test_one_file_listed_under_two_spellings_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _touch(tmp_path, "s.tar")
    spec = JobSpec(("s.tar", "./s.tar"), "m", None, None, "fp32", "gmm", 4, "paper", 0, 8, 10, None, True, 16)
    with pytest.raises(InputError, match="are the same file, listed twice"):  # not "score them into separate folders"
        spec.stems()


def test_gs_without_gcsfs_is_a_clear_error(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    from pairclean.read.shards import iter_pairs

    with pytest.raises(UnsupportedSchemeError, match="extra package"):
        list(iter_pairs("gs://bucket/shard-0.tar"))


# -- bounded expansion and allow-list hooks (issue 10) -------------------------------------

def test_shard_limit_is_enforced_while_expanding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    started = time.perf_counter()
    with pytest.raises(InputError, match="more than 100 shards"):
        expand_shards([str(tmp_path / "s-{0..999999999}{0..999}.tar")], max_shards=100)  # never materialised
    assert time.perf_counter() - started < 5
    _touch(tmp_path, *(f"g-{i}.tar" for i in range(6)))
    with pytest.raises(InputError, match="more than 5 shards"):
        expand_shards([str(tmp_path / "g-*.tar")], max_shards=5)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"g-{i % 6}.tar\n" for i in range(1000)))
    with pytest.raises(InputError, match="more than 50 shards"):
        expand_shards(["@" + str(listing)], max_shards=50)
    assert len(expand_shards([str(tmp_path / "g-*.tar")], max_shards=6)) == 6
    monkeypatch.setenv("PAIRCLEAN_MAX_SHARDS", "3")  # what the service sets for its job processes
    with pytest.raises(InputError, match="more than 3 shards"):
        expand_shards([str(tmp_path / "g-*.tar")])


def test_brace_count_matches_braceexpand() -> None:
    import braceexpand

    from pairclean.uris import brace_count

    for pattern in ["a", "{a,b}c{1..3}", "{07..10}", "{a..g..2}", "{4..1}", "{2..-1}", "python{2.{5..7},3.{2,3}}",
                    r"{1\{2,3}", "{x}", "{}", "{,}", "{Z..a}", "{0..10..3}", "{a,{b,c}{1..2}}x{}"]:
        assert brace_count(pattern) == len(list(braceexpand.braceexpand(pattern))), pattern


def test_check_runs_before_anything_is_touched(tmp_path: Path) -> None:
    seen: list[str] = []

    def refuse_secret(uri: str) -> None:
        seen.append(uri)
        if "secret" in uri:
            raise PermissionError("refused")

    with pytest.raises(PermissionError):  # the check, not "not found": existence is never tested
        expand_shards(["@" + str(tmp_path / "secret" / "list.txt")], check=refuse_secret)
    with pytest.raises(PermissionError):
        expand_shards([str(tmp_path / "secret" / "*.tar")], check=refuse_secret)
    _touch(tmp_path, "ok.tar", "secret.tar")
    with pytest.raises(PermissionError):  # a glob match is checked too
        expand_shards([str(tmp_path / "*.tar")], check=refuse_secret)


def test_remote_prefixes_match_on_segment_boundaries() -> None:
    from pairclean.uris import under_prefix

    assert under_prefix("s3://laion/x.tar", "s3://laion")
    assert under_prefix("s3://laion/a/b.tar", "s3://laion/")
    assert not under_prefix("s3://laion-private/x.tar", "s3://laion")
    assert not under_prefix("https://h/database/x.tar", "https://h/data")
    assert under_prefix("https://h/data/x.tar", "https://h/data")
    assert not under_prefix("https://h/data/%2e%2e/private/x.tar", "https://h/data")
    assert not under_prefix("gs://laion/x.tar", "s3://laion")


def test_a_refused_connection_is_not_reported_as_a_missing_shard() -> None:
    import socket

    from pairclean.errors import ShardNotFoundError, ShardReadError
    from pairclean.uris import open_shard

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ShardReadError, match="cannot reach shard") as info:
        with open_shard(f"http://127.0.0.1:{port}/a.tar"):
            pass
    assert not isinstance(info.value, ShardNotFoundError)


def test_expansion_is_bounded_in_time_depth_and_components(tmp_path: Path) -> None:
    """A 46-byte '{00000..N}.t[a]r' made N globs over an N-file folder (3 s at N = 2,000,
    hours at 100,000, under the shard limit); 500 nested brace groups and a glob after 1,500
    slashes were RecursionErrors (a 500 in the service)."""
    import time

    from pairclean.errors import InputError
    from pairclean.uris import MAX_BRACE_DEPTH, expand_shards

    for i in range(300):
        (tmp_path / f"{i:05d}.tar").write_bytes(b"")
    spec = str(tmp_path / "{00000..00299}.t[a]r")
    assert len(expand_shards([spec])) == 300  # no deadline: as before
    with pytest.raises(InputError, match="expanding the shard specs took too long"):
        expand_shards([spec], deadline=time.monotonic() - 1)
    with pytest.raises(InputError, match=f"braces nested deeper than {MAX_BRACE_DEPTH}"):
        expand_shards([str(tmp_path / ("{a," * 500 + "b" + "}" * 500))])
    with pytest.raises(InputError, match="more than 64 path components"):
        expand_shards([str(tmp_path) + "/*" + "/x" * 100])
    (found,) = expand_shards([str(tmp_path) + "/" * 1500 + "0000[0].tar"])  # doubled slashes: a RecursionError before
    assert os.path.samefile(found, tmp_path / "00000.tar")
