"""The REST service over real HTTP (uvicorn on loopback) with a real SQLite file and real jobs.

Hostile input, authentication and the allow-list: tests/security/test_threat_model.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
from pairclean_service.client import PaircleanClient  # noqa: E402


pytestmark = pytest.mark.slow


def _job(shards: list[Path], out: Path) -> dict:
    return {"shards": [str(s) for s in shards], "output": str(out), "estimator": "pairclean-tiny-test", "options": {"batch_size": 4}}


def test_job_lifecycle_progress_shards_metrics_and_idempotency(server, make_shards, tmp_path: Path) -> None:
    shards = make_shards(n_shards=3, per_shard=6, folder=tmp_path / "shards")
    client = PaircleanClient(server.url, server.key)
    body = _job(shards, tmp_path / "out")
    job_id = client.submit(body["shards"], body["output"], estimator=body["estimator"], options=body["options"], idempotency_key="abc")
    again = client.submit(body["shards"], body["output"], estimator=body["estimator"], options=body["options"], idempotency_key="abc")
    assert again == job_id
    done = client.wait(job_id, timeout=300, poll=0.2)
    assert done["state"] == "SUCCEEDED" and done["progress"]["shards_done"] == 3 and done["progress"]["pairs"] == 18
    # the noise-rate estimate is what p_clean expects over every committed pair (1 - its mean)
    import pyarrow.dataset as ds

    table = ds.dataset(str(tmp_path / "out")).to_table(columns=["status", "p_clean"]).to_pandas()
    expected = 1 - table[table.status == "ok"].p_clean.astype(float).mean()
    assert done["noise_rate_estimate"] == pytest.approx(expected, abs=1e-6)
    # the job page says why a pair with a better owner was lowered (18 pairs: the contrast is on)
    pages = httpx.Client(base_url=server.url)
    assert pages.post("/ui/login", data={"api_key": server.key}).status_code == 303
    html = " ".join(pages.get(f"/ui/jobs/{job_id}").text.split())
    assert 'data-why="contrast"' in html and "has a better <i>owner</i>" in html and "keeps 0.1 of its odds of being clean" in html
    assert "a caption that fits no photo well" not in html  # 18 pairs: version 3's contrast, no gate (tests/service/test_contrast_partial.py)
    page = httpx.get(f"{server.url}/v1/jobs/{job_id}/shards", params={"state": "committed"}, headers={"Authorization": f"Bearer {server.key}"}).json()
    assert page["total"] == 3 and all(s["rows"] == 6 for s in page["items"])
    listing = client.list(limit=10)
    assert listing["total"] == 1 and listing["items"][0]["id"] == job_id
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'pairclean_pairs_scored_total{status="ok"} 18.0' in metrics
    assert 'pairclean_jobs{state="SUCCEEDED"} 1.0' in metrics
    assert "pairclean_stage_seconds_bucket" in metrics and "pairclean_pair_weight_count 18.0" in metrics
    report = client.validate(body["shards"], body["output"], estimator="pairclean-tiny-test")
    assert report["shards"] == 3 and report["samples"] == 6 and report["statuses"] == {"ok": 6} and report["problems"] == []
    # The dry run says what score would refuse, and an empty first shard, instead of "no problem"
    inside = client.validate(body["shards"], str(tmp_path / "out" / "nested"), estimator="pairclean-tiny-test")
    assert inside["problems"] == [f"output {str(tmp_path / 'out' / 'nested')!r} lies inside another pairclean job's output"]
    from pairclean.lite.evaldata import write_shard

    empty = write_shard(tmp_path / "shards" / "empty-00000.tar", [])
    report = client.validate([str(empty), *body["shards"]], str(tmp_path / "out2"), estimator="pairclean-tiny-test")
    assert report["samples"] == 0 and "holds no sample" in report["problems"][0]
    # a dry run reads the captions where the job will: a member named by options.caption_field
    moved = make_shards(n_shards=1, per_shard=3, prefix="moved", folder=tmp_path / "shards",
                        extra={i: {"txt": None, "caption": b"a dog"} for i in range(3)})
    plain = client.validate([str(moved[0])], str(tmp_path / "out3"), estimator="pairclean-tiny-test")
    assert plain["statuses"] == {"missing_text": 3}
    member = client.validate([str(moved[0])], str(tmp_path / "out3"), estimator="pairclean-tiny-test",
                             options={"caption_field": ".caption"})
    assert member["statuses"] == {"ok": 3}


def test_cancel_and_retry_rules(server, make_shards, tmp_path: Path) -> None:
    shards = make_shards(n_shards=6, per_shard=16, folder=tmp_path / "shards")
    client = PaircleanClient(server.url, server.key)
    job_id = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test")
    cancelled = client.cancel(job_id)
    assert cancelled["state"] in ("CANCELLED", "RUNNING")
    deadline = time.time() + 60
    while client.status(job_id)["state"] != "CANCELLED" and time.time() < deadline:
        time.sleep(0.2)
    assert client.status(job_id)["state"] == "CANCELLED"
    with pytest.raises(RuntimeError, match="409"):
        client.retry(job_id)


def test_twenty_pollers_while_a_job_runs(server, make_shards, tmp_path: Path) -> None:
    shards = make_shards(n_shards=4, per_shard=16, folder=tmp_path / "shards")
    client = PaircleanClient(server.url, server.key)
    job_id = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test")
    errors: list[str] = []

    def poll() -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}) as http:
            for _ in range(25):
                r = http.get(f"/v1/jobs/{job_id}")
                if r.status_code != 200:
                    errors.append(r.text)
                time.sleep(0.02)

    threads = [threading.Thread(target=poll) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert client.wait(job_id, timeout=300, poll=0.2)["state"] == "SUCCEEDED"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_killed_mid_job_restarts_and_resumes(make_shards, tmp_path: Path) -> None:
    shards = make_shards(n_shards=8, per_shard=24, folder=tmp_path / "shards")
    env = dict(os.environ, PAIRCLEAN_DATABASE_URL=f"sqlite:///{tmp_path / 'jobs.db'}", PAIRCLEAN_ALLOWED_INPUTS=json.dumps([str(tmp_path)]),
               PAIRCLEAN_ALLOWED_OUTPUTS=json.dumps([str(tmp_path)]), PAIRCLEAN_EXECUTOR="local", PAIRCLEAN_POLL_INTERVAL_S="0.2")
    key = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "apikey", "t"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    port = _free_port()
    cmd = [sys.executable, "-m", "pairclean_service.cli", "serve", "--port", str(port), "--state-dir", str(tmp_path / "state")]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("server did not start")

    first = start()
    client = PaircleanClient(f"http://127.0.0.1:{port}", key)
    job_id = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test", options={"batch_size": 2})
    deadline = time.time() + 120
    while client.status(job_id)["progress"]["shards_done"] < 1 and time.time() < deadline:
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    second = start()
    try:
        done = client.wait(job_id, timeout=300, poll=0.3)
        assert done["progress"]["shards_done"] == 8
        from pairclean.output.folder import OutputDir

        stems = [r.stem for r in OutputDir(str(tmp_path / "out")).iter_committed()]
        assert sorted(stems) == sorted(set(stems)) and len(stems) == 8  # each shard committed once
    finally:
        second.send_signal(signal.SIGINT)
        second.wait(timeout=30)


def test_a_request_that_ends_in_a_500_is_counted_in_the_metrics(tmp_path: Path, live_server_cls) -> None:
    """The middleware counted only responses: an exception (the error handler's 500) was
    missing from pairclean_http_requests_total, so no panel could show server errors."""
    with live_server_cls(tmp_path) as srv:
        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("the job store is down")

        srv.app.state.store.list = broken
        for _ in range(3):
            r = httpx.get(f"{srv.url}/v1/jobs", headers={"Authorization": f"Bearer {srv.key}"})
            assert r.status_code == 500 and r.json() == {"detail": "internal error"}
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'pairclean_http_requests_total{code="5xx",route="/v1/jobs"} 3.0' in metrics


def test_a_retry_counts_only_the_shards_it_scores_in_the_metrics(server, make_shards, tmp_path: Path) -> None:
    """A retried (or resumed) job used to count its already-committed shards again."""
    shards = make_shards(n_shards=3, per_shard=6, folder=tmp_path / "shards")
    good = shards[2].read_bytes()
    shards[2].write_bytes(b"not a tar" * 100)  # fails (quarantined): the job ends FAILED (1 of 3 > 5%)
    client = PaircleanClient(server.url, server.key)
    job_id = client.submit([str(s) for s in shards], str(tmp_path / "out"), estimator="pairclean-tiny-test")
    from pairclean_service.client import JobFailed

    with pytest.raises(JobFailed, match="ended FAILED"):
        client.wait(job_id, timeout=300, poll=0.2)
    assert client.status(job_id)["progress"]["shards_done"] == 2
    # `pairclean wait` prints the job however it ended (it printed nothing), exiting as score would
    waited = subprocess.run([sys.executable, "-m", "pairclean_service.cli", "wait", job_id, "--address", server.url,
                             "--api-key", server.key], capture_output=True, text=True, timeout=120)
    assert waited.returncode == 3 and json.loads(waited.stdout)["state"] == "FAILED" and "ended FAILED" in waited.stderr

    def counts() -> tuple[str, str, str]:
        text = httpx.get(f"{server.url}/metrics").text
        return tuple(next((line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name)), "0")
                     for name in ('pairclean_pairs_scored_total{status="ok"}', 'pairclean_shards_total{state="committed"}',
                                  'pairclean_shards_total{state="quarantined"}'))

    assert counts() == ("12.0", "2.0", "1.0")
    shards[2].write_bytes(good)  # repaired
    client.retry(job_id)
    assert client.wait(job_id, timeout=300, poll=0.2)["state"] == "SUCCEEDED"
    assert counts() == ("18.0", "3.0", "1.0")  # the retry scored one shard: 6 pairs more, not 18


def test_starting_a_second_replica_leaves_the_first_ones_running_job_alone(tmp_path: Path, live_server_cls) -> None:
    """Replicas share the job store. A replica's start used to take every RUNNING job for its
    own: it killed the other replica's job process, and that job ended FAILED. Now it takes
    its own, and another replica's on this host only once that job's process is gone."""
    from pairclean_service.store import JobStore

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    store = JobStore(url)
    # A live job process of replica A (its command line is what the runner recognises).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "pairclean_workers.cli"], start_new_session=True)
    try:
        job, _ = store.create({"shards": ["/x/a.tar"], "output": str(tmp_path / "out")}, "tester", None, 1)
        runner_a = f"{socket.gethostname()}:{(tmp_path / 'a' / 'state').resolve()}"
        assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=proc.pid, runner=runner_a)
        (tmp_path / "b").mkdir()
        with live_server_cls(tmp_path / "b", url, max_running_jobs=0):  # replica B starts
            assert store.get(job.id).state == "RUNNING" and proc.poll() is None  # A's job and process untouched
        proc.kill()
        proc.wait()
        with live_server_cls(tmp_path / "b", url, max_running_jobs=0):  # A's process is gone: B resumes the job
            assert store.get(job.id).state == "QUEUED"
    finally:
        if proc.poll() is None:
            proc.kill()



def test_a_replica_lost_with_its_host_leaves_no_job_running_for_ever(tmp_path: Path, live_server_cls,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A RUNNING job launched by a replica on another host stayed RUNNING for good when that
    host was lost: only a restart of the same replica resumed it. Another replica now takes
    it over once its signs of life (its runner's heartbeat in the store, its run lock's
    heartbeat) have stood still for ``orphan_grace_s``: queued again, or CANCELLED where its
    cancellation was asked. Values are compared between looks, never against this host's
    clock, so a job whose lock or runner still beats stays, however far the clocks differ."""
    from pairclean import schema
    from pairclean.output.folder import OutputDir
    from pairclean_service.settings import ServiceSettings
    from pairclean_service.store import JobStore, now_iso

    # the grace must outlast the run lock's TTL (a job queued sooner finds its folder locked)
    with pytest.raises(ValueError, match="must be above the run lock's TTL"):
        ServiceSettings(orphan_grace_s=30.0)
    monkeypatch.setenv("PAIRCLEAN_LOCK_TTL_S", "2")  # so that this test's grace of 3 s may be

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    store = JobStore(url)
    gone, elsewhere = "gone-host.invalid:/srv/state", "live-host.invalid:/srv/state"

    def running_job(name: str, runner: str = gone) -> tuple[str, OutputDir]:
        job, _ = store.create({"shards": [f"/x/{name}.tar"], "output": str(tmp_path / name)}, "tester", None, 1)
        assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=4242, started_at=now_iso(), runner=runner)
        return job.id, OutputDir(str(tmp_path / name))

    def lock(out: OutputDir, heartbeat: float) -> None:
        doc = {"run_id": "r", "host": "other-host.invalid", "pid": 4242, "heartbeat": heartbeat, "ttl_s": 60.0}
        out.store.put(schema.LOCK_FILE, json.dumps(doc).encode())

    stale, stale_out = running_job("stale")  # its process stopped beating an hour ago
    lock(stale_out, time.time() - 3600)
    unlocked, _ = running_job("unlocked")  # no lock at all (its process had ended, or never began)
    cancelled, _ = running_job("cancelled")  # its owner asked to cancel it while its replica was gone
    store.update(cancelled, cancel_requested=1)
    beating, beating_out = running_job("beating")  # its process lives on a host whose clock is a day behind
    lock(beating_out, time.time() - 86_400)
    expanding, _ = running_job("expanding", elsewhere)  # no lock yet (its shards are being listed); its runner beats
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(0.2):
            n += 1
            lock(beating_out, time.time() - 86_400 + n)
            store.beat(elsewhere, f"beat {n}")

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    # the same job, launched again by a third replica after it was seen gone: not moved on the old sighting
    assert not store.transition(stale, ["RUNNING"], expect={"runner": "another:/x", "started_at": None}, state="QUEUED")
    try:
        (tmp_path / "b").mkdir()
        with live_server_cls(tmp_path / "b", url, max_running_jobs=0, orphan_grace_s=3.0, orphan_check_s=0.2) as srv:
            time.sleep(0.5)
            assert store.get(stale).state == "RUNNING"  # one look is not enough: the grace runs from the first
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and {store.get(j).state for j in (stale, unlocked, cancelled)} != {"QUEUED", "CANCELLED"}:
                time.sleep(0.2)
            assert store.get(stale).state == "QUEUED" and store.get(stale).pid is None
            assert store.get(unlocked).state == "QUEUED" and store.get(cancelled).state == "CANCELLED"
            # more than the grace has passed: what still beats stays
            assert store.get(beating).state == "RUNNING" and store.get(expanding).state == "RUNNING"
            assert "pairclean_jobs_requeued_total 3.0" in httpx.get(f"{srv.url}/metrics").text
    finally:
        stop.set()
        beater.join()


def test_a_replica_finishes_only_its_own_launch_of_a_job(tmp_path: Path) -> None:
    """When another replica has taken a job over (queued and launched it again) while this
    one's process still ran, this replica's reap of its process must leave the new launch
    alone: its reap used to move any RUNNING job to its own process's end state."""
    from pairclean_service.metrics import Metrics
    from pairclean_service.runner import JobRunner, _Running
    from pairclean_service.settings import ServiceSettings
    from pairclean_service.store import JobStore, now_iso

    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    runner = JobRunner(store, ServiceSettings(executor="local"), Metrics(), tmp_path / "state")
    job, _ = store.create({"shards": ["/x/a.tar"], "output": str(tmp_path / "out")}, "tester", None, 1)
    proc = subprocess.Popen([sys.executable, "-c", "pass", "pairclean_workers.cli"], start_new_session=True)
    assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=proc.pid, started_at=now_iso(), runner=runner.runner_id)
    runner.running[job.id] = _Running(job.id, proc, tmp_path / "a.log", set())
    proc.wait()
    # meanwhile another replica took it over and runs it
    assert store.transition(job.id, ["RUNNING"], state="QUEUED", pid=None)
    assert store.transition(job.id, ["QUEUED"], state="RUNNING", pid=4242, started_at=now_iso(), runner="other-host:/srv/state")
    runner._reap()
    after = store.get(job.id)
    assert after.state == "RUNNING" and after.runner == "other-host:/srv/state" and after.pid == 4242
    assert job.id not in runner.running  # this replica stops following its own, ended process


def test_a_cancel_between_launch_and_follow_still_ends_the_job(tmp_path: Path, make_shards) -> None:
    """``cancel`` ends the process it finds in ``running``; one that came after the job moved
    to RUNNING but before its process was registered found none, and the job ran to its end
    (then reported CANCELLED, its whole output written)."""
    from pairclean_service.metrics import Metrics
    from pairclean_service.runner import JobRunner
    from pairclean_service.settings import ServiceSettings
    from pairclean_service.store import JobStore

    shards = make_shards(n_shards=4, per_shard=16, folder=tmp_path / "shards")
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    settings = ServiceSettings(executor="local", allowed_inputs=[str(tmp_path)], allowed_outputs=[str(tmp_path)])
    runner = JobRunner(store, settings, Metrics(), tmp_path / "state")
    request = {"shards": [str(s) for s in shards], "output": str(tmp_path / "out"), "estimator": "pairclean-tiny-test",
               "beta_recipe": "random-inputs", "weighting": "p-clean", "options": {}}
    job, _ = store.create(request, "tester", None, 1)
    moved = store.transition

    def transition(job_id: str, *args: Any, **kwargs: Any) -> bool:
        done = moved(job_id, *args, **kwargs)
        if done and kwargs.get("state") == "RUNNING":
            runner.cancel(store.get(job_id))  # the tenant's cancel lands in the window
        return done

    store.transition = transition  # type: ignore[method-assign]
    runner._launch()
    run = runner.running[job.id]
    assert run.proc.wait(timeout=60) != 0  # ended, not run to its end
    runner._reap()
    assert store.get(job.id).state == "CANCELLED"
    assert len(list((tmp_path / "out").glob("*.parquet"))) < 4


def test_readiness_fails_when_the_job_store_file_is_deleted_under_the_service(tmp_path: Path, live_server_cls) -> None:
    """The open connections kept answering from the unlinked file: /readyz stayed green while
    every job written since was bound to vanish at the next start."""
    with live_server_cls(tmp_path) as srv:
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / f"jobs.db{suffix}").unlink(missing_ok=True)
        r = httpx.get(f"{srv.url}/readyz")
        assert r.status_code == 503 and r.json() == {"status": "not ready"}


def test_metrics_from_a_tenants_records_are_bounded_and_a_failure_on_retry_counts_again(tmp_path: Path) -> None:
    """The completion and quarantine records live in the tenant's own folder: an edited one
    made label values of anything, and a negative count raised in the runner (which then
    stopped following the job). A shard that failed again on a ``:retry`` wrote the same
    record as before and was not counted."""
    from pairclean.output.folder import OutputDir
    from pairclean_service.metrics import Metrics

    def unreadable(cols: list[str]) -> None:
        raise OSError("the table is gone")

    metrics = Metrics()
    metrics.shard_committed({"attempts": "-3", "statuses": {"<script>": 2, "ok": -5, "decode_error": 1}}, unreadable)
    metrics.shard_quarantined(-4)
    text = metrics.render().decode()
    assert 'status="other"} 2.0' in text and "<script>" not in text and 'status="decode_error"} 1.0' in text
    assert "pairclean_shard_attempts_failed_total 0.0" in text
    out = OutputDir(str(tmp_path / "out"))
    out.quarantine("/x/a.tar", "a", "unreadable tar", 1)
    first = out.quarantined()["a"]
    time.sleep(0.01)
    out.quarantine("/x/a.tar", "a", "unreadable tar", 1)
    assert out.quarantined()["a"] != first  # the runner tells this run's failure from the earlier one's
