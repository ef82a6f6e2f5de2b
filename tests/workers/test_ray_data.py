"""``pairclean.ray_data.ScorePairs`` in a real local Ray Data pipeline: decoded images as Ray
Data's readers give them, one model per actor, the frozen calibration of an existing job."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import pairclean
from pairclean.read.shards import iter_raw_samples

SAMPLE = Path(pairclean.__file__).parent / "data" / "sample" / "demo-000000.tar"
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_map_batches_scores_with_the_jobs_frozen_calibration(ray_local, tmp_path: Path) -> None:
    from PIL import Image

    from pairclean.ray_data import ScorePairs
    from pairclean_workers.cli import main

    out = tmp_path / "job"
    assert main(["score", str(SAMPLE), "--out", str(out), "--model", "pairclean-tiny-test", "--executor", "local", "--no-progress"]) == 0
    job = pairclean.read_scores(out, columns=["key", "weight", "noisy"]).to_pylist()
    rows = []
    for s in iter_raw_samples(str(SAMPLE)):
        image = np.asarray(Image.open(io.BytesIO(s.files["jpg"])).convert("RGB"))  # decoded, sizes differ
        rows.append({"key": s.key, "image": image, "caption": s.files["txt"].decode()})
    rows.append({"key": "broken", "image": np.zeros((4, 4, 2), np.uint8), "caption": "an image Ray could not have made"})
    got = {}
    for batch_size in (3, 11):
        ds = ray.data.from_items(rows).map_batches(
            ScorePairs, fn_constructor_kwargs={"calibration": str(out), "model": "pairclean-tiny-test", "threads": 1},
            batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1,
        )
        got[batch_size] = {r["key"]: r for r in ds.take_all()}
        assert "image" not in next(iter(got[batch_size].values()))  # dropped: the bulk of a batch
    small, large = got[3], got[11]
    assert sorted(small) == sorted(large) == sorted([r["key"] for r in job] + ["broken"])
    for r in job:  # the job's own weights, whatever the batch
        assert small[r["key"]]["weight"] == pytest.approx(large[r["key"]]["weight"], abs=1e-6)
        assert small[r["key"]]["weight"] == pytest.approx(r["weight"], abs=0.02) and small[r["key"]]["status"] == "ok"
    assert large["broken"]["status"] == "decode_error" and large["broken"]["weight"] == 0
