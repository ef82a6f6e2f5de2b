"""Shared by the job tests: the tiny real open_clip model (loaded once) and small real shards
cut from the bundled demo sample (no Flickr8k needed)."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pairclean.embed.estimators import TINY_TEST_MODEL, Estimator, EstimatorSpec, load_estimator
from pairclean.lite.evaldata import write_shard
from pairclean.read.decode import DEFAULT_MAX_PIXELS
from pairclean.spec import JobSpec
from pairclean_workers.cli import sample_shard

ShardWriter = Callable[..., list[str]]
SpecMaker = Callable[..., JobSpec]


@pytest.fixture(scope="session")
def tiny_estimator() -> Estimator:
    return load_estimator(EstimatorSpec(TINY_TEST_MODEL, device="cpu", precision="fp32"))


@pytest.fixture(scope="session")
def demo_samples() -> list[dict[str, Any]]:
    """The 10 pairs of the bundled demo shard as ``write_shard`` samples (jpg, txt, json)."""
    samples: dict[str, dict[str, Any]] = {}
    with tarfile.open(sample_shard()) as tar:
        for member in tar.getmembers():
            key, ext = member.name.rsplit(".", 1)
            fh = tar.extractfile(member)
            assert fh is not None
            samples.setdefault(key, {"__key__": key})[ext] = fh.read()
    return list(samples.values())


@pytest.fixture
def write_shards(tmp_path: Path, demo_samples: list[dict[str, Any]]) -> ShardWriter:
    """``write_shards(sizes)``: shards ``part-00000.tar``... of ``sizes[i]`` demo pairs each
    (pairs reused round robin under unique keys); ``bad={i: {member: bytes}}`` replaces members."""

    def write(sizes: list[int], bad: dict[int, dict[str, bytes]] | None = None, folder: str = "shards") -> list[str]:
        paths, n = [], 0
        for s, size in enumerate(sizes):
            samples = []
            for _ in range(size):
                sample = {**demo_samples[n % len(demo_samples)], "__key__": f"p{n:04d}"}
                sample.update((bad or {}).get(n, {}))
                samples.append(sample)
                n += 1
            paths.append(str(write_shard(tmp_path / folder / f"part-{s:05d}.tar", samples)))
        return paths

    return write


def truncate(path: str, keep: float = 0.5) -> bytes:
    """Cut the tar at ``path`` to a fraction of its bytes (a download that stopped); returns
    the whole bytes so that a test can repair it."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep)])
    return data


@pytest.fixture
def corrupt() -> Callable[..., bytes]:
    return truncate


@pytest.fixture
def make_spec() -> SpecMaker:
    def make(shards: list[str], **fields: Any) -> JobSpec:
        values: dict[str, Any] = dict(
            shards=tuple(shards), model=TINY_TEST_MODEL, checkpoint=None, pretrained=None, precision="fp32",
            beta_recipe="random-inputs", beta_k=8, weighting="paper", seed=0, batch_size=4,
            max_pixels=DEFAULT_MAX_PIXELS, caption_field=None, embeddings=False, calibration_pairs=1000,
        )
        values.update(fields)
        return JobSpec(**values)

    return make

