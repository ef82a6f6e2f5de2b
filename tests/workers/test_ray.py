"""Scoring on a real local Ray (num_cpus=2): equality with the single-process path, lost
workers, timeouts and quarantine, and a killed driver that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pairclean import schema
from pairclean.embed.estimators import EstimatorSpec
from pairclean.spec import JobSpec
from pairclean.output.folder import OutputDir
from pairclean.job.runner import run_job, score_options
from pairclean_workers.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TINY = ["--model", "pairclean-tiny-test", "--no-progress", "--batch-size", "4", "--threads", "2"]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _committed(out: Path) -> list[str]:
    return [r.stem for r in OutputDir(str(out)).iter_committed()]


def test_ray_path_equals_single_process_path(ray_local, make_shards, tmp_path: Path) -> None:
    shards = [str(s) for s in make_shards(n_shards=3, per_shard=6, extra={4: {"jpg": b"broken"}})]
    for recipe in ("random-inputs", "gmm"):
        local, viaray = tmp_path / f"local-{recipe}", tmp_path / f"ray-{recipe}"
        assert main(["score", *shards, "--out", str(local), *TINY, "--executor", "local", "--beta-recipe", recipe]) == 0
        assert main(["score", *shards, "--out", str(viaray), *TINY, "--executor", "ray", "--beta-recipe", recipe]) == 0
        for stem in ("part-00000", "part-00001", "part-00002"):
            a = pq.read_table(local / f"{stem}.parquet", columns=["key", "status", "similarity", "weight", "noisy"]).to_pylist()
            b = pq.read_table(viaray / f"{stem}.parquet", columns=["key", "status", "similarity", "weight", "noisy"]).to_pylist()
            assert len(a) == len(b) == 6  # zip() below would stop at the shorter table
            assert all(
                x["key"] == y["key"] and x["status"] == y["status"] and x["noisy"] == y["noisy"]
                and (x["weight"] is None) == (y["weight"] is None) and abs((x["weight"] or 0) - (y["weight"] or 0)) < 1e-6
                for x, y in zip(a, b, strict=True)
            )
        assert json.loads(schema.local_side_path(local, schema.CALIBRATION_FILE).read_text())["beta"] == pytest.approx(
            json.loads(schema.local_side_path(viaray, schema.CALIBRATION_FILE).read_text())["beta"], abs=1e-6
        )


def _spec(shards: list[str], **kw) -> JobSpec:
    base = dict(shards=tuple(shards), model="pairclean-tiny-test", checkpoint=None, pretrained=None, precision="fp32",
                beta_recipe="random-inputs", beta_k=16, weighting="paper", seed=0, batch_size=2, max_pixels=64_000_000,
                caption_field=None, embeddings=True, calibration_pairs=64)
    base.update(kw)
    return JobSpec(**base)


class _KillAfterFirst:
    """Progress sink that SIGKILLs every scoring actor's process at the first commit: with two
    actors, one is in the middle of a shard then, the other idle."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.done = pids, 0

    def start(self, total_shards: int, already_done: int) -> None:
        pass

    def shard_done(self, record: Any) -> None:
        self.done += 1
        if self.done == 1:
            for pid in self.pids:
                os.kill(pid, signal.SIGKILL)

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        pass


def test_a_killed_worker_is_replaced_and_every_shard_committed_once(ray_local, make_shards, tmp_path: Path) -> None:
    from pairclean_workers.ray_exec import RayOptions, RaySource

    shards = [str(s) for s in make_shards(n_shards=4, per_shard=24)]
    spec = _spec(shards)
    out = OutputDir(str(tmp_path / "out"))
    source = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, out, score_options(spec), RayOptions(num_actors=2, threads_per_actor=1, backoff_s=0.1))
    victims = source.actor_pids()
    report = run_job(spec, out, lambda: source, progress=_KillAfterFirst(victims))
    assert report.state == "SUCCEEDED" and report.committed == 4
    assert source.retries >= 1 and not set(victims) & set(source.actor_pids())
    stems = _committed(tmp_path / "out")
    assert sorted(stems) == [f"part-{i:05d}" for i in range(4)] and len(stems) == 4
    for stem in stems:
        assert pq.read_table(tmp_path / "out" / f"{stem}.parquet").num_rows == 24
    # the shards the lost workers held say they took more than one try (after compaction too)
    attempts = {r.stem: r.attempts for r in OutputDir(str(tmp_path / "out")).iter_committed()}
    assert set(attempts.values()) <= {1, 2} and sum(a > 1 for a in attempts.values()) == source.retries
    from pairclean.output.report import format_summary, summarize

    shown = format_summary(summarize(OutputDir(str(tmp_path / "out")))).splitlines()[0]
    assert f"; {source.retries} took more than one try (up to 2): " in shown


def _actor_cpu_settings(actor: object) -> dict[str, object]:
    """In the actor: its OpenMP wait policy and whether glibc malloc keeps large blocks."""
    import ray

    def probe(self: object) -> dict[str, object]:
        import ctypes

        from pairclean.embed.cpu_settings import keep_heap_memory

        class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: 10 size_t fields
            _fields_ = [(name, ctypes.c_size_t) for name in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        before = libc.mallinfo2().hblks
        block = libc.malloc(64 << 20)  # far above glibc's default mmap threshold (<= 32 MiB)
        mmapped = libc.mallinfo2().hblks - before
        libc.free(block)
        return {"omp": os.environ.get("OMP_WAIT_POLICY"), "heap": keep_heap_memory(), "mmapped_blocks": mmapped}

    return ray.get(actor.__ray_call__.remote(probe))


def test_actors_run_with_pairclean_cpu_settings(ray_local, make_shards, tmp_path: Path) -> None:
    """Ray was started by someone else here: the actor still gets the OpenMP wait policy
    (runtime_env) and its malloc keeps a 64 MiB block in the heap instead of mmap-ing it."""
    from pairclean_workers.ray_exec import RayOptions, RaySource

    shards = [str(s) for s in make_shards(n_shards=1, per_shard=2)]
    spec = _spec(shards)
    source = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, OutputDir(str(tmp_path / "out")),
                       score_options(spec), RayOptions(num_actors=1, threads_per_actor=1))
    assert _actor_cpu_settings(source.actors[0]) == {"omp": "PASSIVE", "heap": True, "mmapped_blocks": 0}
    mine = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, OutputDir(str(tmp_path / "out2")),
                     score_options(spec), RayOptions(num_actors=1, threads_per_actor=1, runtime_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}))
    assert _actor_cpu_settings(mine.actors[0])["omp"] == "ACTIVE"  # the caller's value wins


def test_stragglers_time_out_and_end_quarantined(ray_local, make_shards, tmp_path: Path) -> None:
    from pairclean_workers.ray_exec import RayOptions, RaySource

    # Shards of 200 pairs take seconds, far beyond the 0.05 s limit, even if the driver is
    # slow to look: no attempt can finish in time, so the outcome does not depend on load.
    shards = [str(s) for s in make_shards(n_shards=2, per_shard=200)]
    spec = _spec(shards)
    opts = RayOptions(num_actors=1, threads_per_actor=1, shard_timeout_s=0.05, max_retries=1, backoff_s=0.05, tasks_per_actor=1)
    out = OutputDir(str(tmp_path / "out"))
    source = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, out, score_options(spec), opts)
    report = run_job(spec, out, lambda: source, max_failed_fraction=0.5)
    assert report.state == "FAILED" and report.committed == 0
    quarantined = out.quarantined()
    assert sorted(quarantined) == ["part-00000", "part-00001"]
    assert all("timed out" in q["error"] and q["attempts"] == 2 for q in quarantined.values())


def test_a_straggler_never_costs_the_shards_behind_it_or_a_replacement_s_model_load(ray_local, make_shards, tmp_path: Path) -> None:
    """A shard's clock ran from when it was sent: a shard queued behind a straggler timed out
    with it, and the next one's clock counted the replacement actor's model load."""
    from pairclean_workers.ray_exec import RayOptions, RaySource

    import io

    import numpy as np
    from PIL import Image

    from pairclean.lite.evaldata import write_shard

    # 24 photos of 4000x3000 px (a grey ramp: 42 kB as PNG): about 0.2 s each to decode and
    # resize, seconds in all, far beyond the limit on any machine; 2-pair shards take a fraction.
    ramp = np.tile(np.linspace(0, 255, 4000, dtype=np.uint8), (3000, 1))
    buf = io.BytesIO()
    Image.fromarray(np.stack([ramp] * 3, axis=2)).save(buf, format="PNG")
    big = [{"__key__": f"big/{i:03d}", "png": buf.getvalue(), "txt": "a grey ramp"} for i in range(24)]
    slow = [str(write_shard(tmp_path / "shards" / "slow-00000.tar", big))]
    fast = [str(s) for s in make_shards(n_shards=3, per_shard=2, prefix="fast")]
    spec = _spec(slow + fast)
    opts = RayOptions(num_actors=1, threads_per_actor=1, shard_timeout_s=0.75, max_retries=0, backoff_s=0.05, tasks_per_actor=2)
    out = OutputDir(str(tmp_path / "out"))
    source = RaySource(EstimatorSpec("pairclean-tiny-test", precision="fp32", device="cpu"), spec, out, score_options(spec), opts)
    report = run_job(spec, out, lambda: source, max_failed_fraction=0.5)
    assert sorted(out.committed()) == ["fast-00000", "fast-00001", "fast-00002"]  # none charged for the straggler
    assert sorted(out.quarantined()) == ["slow-00000"] and "timed out" in out.quarantined()["slow-00000"]["error"]
    assert report.state == "PARTIAL"


def test_killed_driver_resumes_without_redoing_shards(make_shards, tmp_path: Path, crash_mid_job) -> None:
    pytest.importorskip("ray")
    shards = make_shards(n_shards=6, per_shard=16)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", str(shards[0].parent / "part-{00000..00005}.tar"),
           "--out", str(out), *TINY, "--executor", "ray", "--calibration-pairs", "16"]  # the kill lands in the scoring phase
    crash_mid_job(cmd, out, commits=1)
    before = {m: (out / f"{m}.parquet").stat().st_mtime_ns for m in _committed(out)}
    assert 1 <= len(before) < 6
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{len(before)} already done" in rerun.stdout
    assert sorted(_committed(out)) == [f"part-{i:05d}" for i in range(6)]
    assert {m: (out / f"{m}.parquet").stat().st_mtime_ns for m in before} == before  # not redone
