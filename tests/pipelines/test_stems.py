"""One stem function for the scorer and the trainer side: every URL form open_clip documents."""

from __future__ import annotations

import pytest

from pairclean.errors import InputError
from pairclean.uris import shard_stem, shard_stems

# (URL as a trainer or the scorer sees it, the stem its score table is named by)
STEMS = [
    # forms the scorer has always named this way: must not change (tests rely on part-00000)
    ("/data/shards/part-00000.tar", "part-00000"),
    ("part-00000.tar", "part-00000"),
    ("file:///data/shards/part-00000.tar", "part-00000"),
    ("/x/y/a.b.tar.gz", "a.b"),
    ("/x/y/c.tgz", "c"),
    ("s3://bucket/prefix/shard-001.tar", "shard-001"),
    ("gs://bucket/prefix/shard-001.tar", "shard-001"),
    ("gcs://bucket/prefix/shard-001.tar", "shard-001"),
    ("s3://bucket/hk/x#1.tar", "x#1"),  # "#" is part of an object's key, not a fragment (round 7)
    ("pipe:aws s3 cp s3://bucket/hk/x#1.tar -", "x#1"),
    ("https://host/a/x-002.tar#part", "x-002"),
    ("https://host/d/00000.tar", "00000"),
    # query strings and fragments (Hugging Face, signed URLs)
    ("https://host/d/00000.tar?download=true", "00000"),
    ("https://huggingface.co/datasets/o/n/resolve/main/00017.tar?download=true#frag", "00017"),
    ("https://b.s3.amazonaws.com/00003.tar?X-Amz-Signature=abc&X-Amz-Expires=60", "00003"),
    # open_clip's pipe: commands
    ("pipe:aws s3 cp s3://b/00000.tar -", "00000"),
    ("pipe:aws s3 cp --quiet s3://b/p/00042.tar.gz -", "00042"),
    ("pipe:gsutil cat gs://b/p/00007.tar", "00007"),
    ("pipe:curl -L -s 'https://host/d/00009.tar?download=true'", "00009"),
    ("pipe:curl -s -L https://host/d/00009.tar -H 'Authorization:Bearer x'", "00009"),
    ("pipe:cat /data/shards/part-00001.tar", "part-00001"),
    # other schemes a trainer may read from
    ("hf://datasets/o/n/00002.tar", "00002"),
]


@pytest.mark.parametrize(("url", "stem"), STEMS)
def test_shard_stem_of_every_url_form(url: str, stem: str) -> None:
    assert shard_stem(url) == stem


def test_brace_lists_and_open_clip_source_separator() -> None:
    assert shard_stems("s3://b/{00000..00002}.tar") == ["00000", "00001", "00002"]
    assert shard_stems("pipe:aws s3 cp s3://b/{00000..00001}.tar -::/d/x-{0..1}.tar") == ["00000", "00001", "x-0", "x-1"]
    assert shard_stems(["a/p-1.tar", "https://h/p-2.tar?x=1"]) == ["p-1", "p-2"]


def test_pipe_command_naming_no_shard_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="cannot tell which shard"):
        shard_stem("pipe:cat /dev/stdin")


def test_scorer_and_sampler_use_the_same_function(tmp_path) -> None:
    from pairclean.spec import JobSpec

    spec = JobSpec((str(tmp_path / "part-00000.tar"), "s3://b/part-00001.tar"), "m", None, None, "fp32", "gmm", 4, "paper", 0, 8, 10, None, True, 16)
    assert list(spec.stems().values()) == ["part-00000", "part-00001"]


def test_a_shard_name_that_is_not_utf8_is_refused_and_a_changed_list_is_named(tmp_path) -> None:
    """A glob found a file named with a stray byte: its table is named after it, and the job
    died writing it, with a traceback. A resume typed from another folder was refused as
    "shards: 3 before, 3 now", naming no difference."""
    import dataclasses

    from pairclean.spec import JobSpec, spec_diff

    base = JobSpec(shards=(), model="m", checkpoint=None, pretrained=None, precision="fp32", beta_recipe="gmm", beta_k=8,
                   weighting="osa", seed=0, batch_size=4, max_pixels=1, caption_field=None, embeddings=False,
                   calibration_pairs=8)

    def spec(shards: list[str]) -> JobSpec:
        return dataclasses.replace(base, shards=tuple(shards))

    with pytest.raises(InputError, match=r"'/d/b\\xffad.tar': its name is not UTF-8") as caught:
        spec(["/d/good.tar", "/d/b\udcffad.tar"]).stems()
    str(caught.value).encode("utf-8")
    said = spec_diff(spec(["/abs/s/a.tar", "/abs/s/b.tar"]), spec(["/abs/s/a.tar", "s/b.tar"]))
    assert "shard 2 was '/abs/s/b.tar', now 's/b.tar' (a relative path?" in said, said
