"""``pairclean.output.lock``: one run per output folder, on a real local folder and real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pairclean import schema
from pairclean.errors import OutputBusyError
from pairclean.output.lock import DEFAULT_TTL_S, RunLock, lock_ttl_from_env
from pairclean.storage import MAX_GET_BYTES, Store, WriteInfo

# A separate process that takes the lock of argv[1] and holds it until killed.
HOLDER = """
import sys, time
from pairclean.output.lock import RunLock
from pairclean.storage import Store
lock = RunLock(Store(sys.argv[1]), ttl_s=30)
lock.acquire()
print(lock.run_id, flush=True)
time.sleep(120)
"""


def _doc(path: Path) -> dict:
    return json.loads((path / schema.LOCK_FILE).read_text())


def _plant(store: Store, **fields: object) -> dict:
    """Write a lock document as another run would."""
    doc = {"run_id": "f" * 32, "host": "another-host", "pid": 1, "started": time.time(), "heartbeat": time.time(), "ttl_s": 30.0}
    doc.update(fields)
    store.put(schema.LOCK_FILE, json.dumps(doc).encode())
    return doc


@pytest.fixture
def holder(tmp_path: Path):
    """A real process on this host holding the lock of ``tmp_path``: (process, run id)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip() if proc.stdout else ""
        assert len(run_id) == 32, "the holder process did not take the lock"
        yield proc, run_id
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def test_a_lock_is_a_document_naming_its_holder_and_release_deletes_it(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    with RunLock(store, ttl_s=30) as lock:
        doc = _doc(tmp_path)
        assert doc["run_id"] == lock.run_id
        assert (doc["host"], doc["pid"], doc["ttl_s"]) == (socket.gethostname(), os.getpid(), 30)
        assert abs(doc["heartbeat"] - time.time()) < 5
        assert lock.read() == doc
    assert not (tmp_path / schema.LOCK_FILE).exists()
    assert RunLock(store).read() is None
    # released: the next run takes it at once
    with RunLock(store, ttl_s=30):
        pass


def test_a_second_lock_is_refused_naming_the_live_holder(tmp_path: Path, holder) -> None:
    proc, run_id = holder
    with pytest.raises(OutputBusyError) as err:
        RunLock(Store(str(tmp_path)), ttl_s=30).acquire()
    message = str(err.value)
    assert f"run {run_id[:12]}" in message
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message
    assert "expires 30 s after its last heartbeat" in message
    assert _doc(tmp_path)["run_id"] == run_id  # the refused run wrote nothing


def test_same_host_holder_whose_process_died_is_taken_over_at_once(tmp_path: Path, holder) -> None:
    proc, run_id = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    doc = _doc(tmp_path)
    assert doc["run_id"] == run_id and time.time() - doc["heartbeat"] < doc["ttl_s"]  # its heartbeat is still fresh
    with RunLock(Store(str(tmp_path)), ttl_s=30) as lock:
        assert _doc(tmp_path)["run_id"] == lock.run_id


def test_a_holder_on_another_host_is_live_until_its_ttl_passes_without_heartbeat(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    # the holder's own TTL counts (1 s), not the newcomer's (30 s)
    _plant(store, ttl_s=1.0)
    with pytest.raises(OutputBusyError, match="another-host"):
        RunLock(store, ttl_s=30).acquire()
    time.sleep(1.2)
    with RunLock(store, ttl_s=30) as lock:
        assert _doc(tmp_path)["run_id"] == lock.run_id


def test_a_stale_heartbeat_is_taken_over_and_a_fresh_one_is_not(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    _plant(store, heartbeat=time.time() - 31, ttl_s=30.0)
    with RunLock(store, ttl_s=30):
        pass
    _plant(store, heartbeat=time.time() - 29, ttl_s=30.0)
    with pytest.raises(OutputBusyError):
        RunLock(store, ttl_s=30).acquire()


def test_a_same_host_holder_with_a_live_pid_is_not_taken_over(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    _plant(store, host=socket.gethostname(), pid=os.getpid())  # this very process: alive
    with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}"):
        RunLock(store, ttl_s=30).acquire()


def test_of_two_racing_runs_the_last_write_wins(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    lock = RunLock(store, ttl_s=30, settle_s=0.6)
    # another run writes its lock while this one waits to read its own back
    rival = threading.Timer(0.2, _plant, args=(store,))
    rival.start()
    try:
        with pytest.raises(OutputBusyError, match="another-host"):
            lock.acquire()
    finally:
        rival.join()
    assert _doc(tmp_path)["run_id"] == "f" * 32


def test_release_leaves_another_runs_lock_alone(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    lock = RunLock(store, ttl_s=30)
    lock.acquire()
    _plant(store)  # taken over behind our back
    lock.release()
    assert _doc(tmp_path)["run_id"] == "f" * 32


def test_the_heartbeat_refreshes_the_lock_and_check_reports_a_takeover(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    lock = RunLock(store, ttl_s=0.3)
    lock.acquire()
    try:
        first = _doc(tmp_path)["heartbeat"]
        time.sleep(0.45)
        assert _doc(tmp_path)["heartbeat"] > first
        lock.check()  # still ours: no error
        # Another run takes over. Without conditional writes a beat already past its read
        # may land once more over the rival's document (the rival's read-back then refuses
        # the rival); so the rival here keeps its document in place until the beat sees it.
        deadline = time.time() + 5
        while not lock.lost.is_set() and time.time() < deadline:
            _plant(store)
            time.sleep(0.03)
        with pytest.raises(OutputBusyError, match="lost the lock"):
            lock.check()
        time.sleep(0.2)  # the heartbeat stopped: it no longer overwrites the new holder
        assert _doc(tmp_path)["run_id"] == "f" * 32
    finally:
        lock.release()


def test_a_lock_gone_while_the_run_stalled_is_lost_not_written_back(tmp_path: Path) -> None:
    """A run stopped (Ctrl-Z) past its TTL: another run took the folder over, finished and
    released the lock. The stalled run's heartbeat found no lock, wrote its own back, and the
    run went on rewriting tables over the other run's finished work (both exited 0)."""
    import pyarrow as pa
    from pairclean.output.folder import OutputDir

    out = OutputDir(str(tmp_path))
    lock = RunLock(out.store, ttl_s=0.3)
    lock.acquire()
    try:
        lock_file = schema.local_side_path(tmp_path, schema.LOCK_FILE)
        lock_file.unlink()  # taken over and released while this run was stopped
        deadline = time.time() + 5
        while not lock.lost.is_set() and time.time() < deadline:
            time.sleep(0.02)
        with pytest.raises(OutputBusyError, match="lost the lock"):
            lock.check()
        time.sleep(0.2)
        assert not lock_file.exists()  # never written back
        # and no table is written once it woke: the check runs inside each table write too
        with pytest.raises(OutputBusyError, match="lost the lock"):
            out.write_table("part-00000.parquet", pa.table({"key": ["a"]}))
        assert not (tmp_path / "part-00000.parquet").exists()
    finally:
        lock.release()
    assert out.store.write_guard is None


class _Unreachable(Exception):
    """What botocore raises when S3 cannot be reached (EndpointConnectionError): no OSError."""


class _FlakyStore(Store):
    """A real local store whose lock file cannot be read or written while ``down`` is set
    (fault injection: an object store's outage)."""

    down = False

    def get(self, name: str, max_bytes: int | None = MAX_GET_BYTES) -> bytes | None:
        if self.down and name == schema.LOCK_FILE:
            raise _Unreachable("Could not connect to the endpoint URL")
        return super().get(name, max_bytes)

    def put(self, name: str, data: bytes, replace: bool = True) -> WriteInfo:
        if self.down and name == schema.LOCK_FILE:
            raise _Unreachable("Could not connect to the endpoint URL")
        return super().put(name, data, replace)

    def rm(self, name: str) -> bool:
        if self.down and name == schema.LOCK_FILE:
            raise _Unreachable("Could not connect to the endpoint URL")
        return super().rm(name)


def test_a_storage_outage_stops_the_run_once_its_lock_may_have_expired(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """botocore's EndpointConnectionError (no OSError) ended the heartbeat thread for good:
    the run went on committing while its lock aged past the TTL, a second run was let in,
    and both reported success over one folder. Beats now retry, and ``check`` stops the run
    once none has landed for a TTL; ``release`` never hides the run's own error."""
    store = _FlakyStore(str(tmp_path))
    lock = RunLock(store, ttl_s=0.4)
    lock.acquire()
    try:
        store.down = True
        time.sleep(0.7)
        assert lock._thread is not None and lock._thread.is_alive()  # still trying
        with pytest.raises(OutputBusyError, match="could not be refreshed"):
            lock.check()
        assert "heartbeat" in caplog.text and "Traceback" not in caplog.text
        store.down = False
        time.sleep(0.4)
        lock.check()  # beats landed again: ours, nobody took it meanwhile
        store.down = True
    finally:
        lock.release()  # the store is down: a warning, not an error hiding the run's own
    assert "could not be removed" in caplog.text


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_that_saw_the_lock_free_too_late_is_refused(tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    """Taking the lock was read, write, wait, read back: a run whose write landed after the
    wait of another (a slow disk, NFS, an object store) took the folder from it and both ran.
    A free lock is now created exclusively on a local folder, and on S3 by a conditional
    PUT (``If-None-Match: *``, the loopback S3 server)."""

    class LateReader(Store):
        first = True

        def get(self, name: str, max_bytes: int | None = MAX_GET_BYTES) -> bytes | None:
            if name == schema.LOCK_FILE and self.first:  # it read before the other run's lock landed
                self.first = False
                return None
            return super().get(name, max_bytes)

    uri, options = str(tmp_path), None
    if where == "s3":
        import s3fs

        options = {"endpoint_url": request.getfixturevalue("s3_endpoint")}
        bucket = f"locks-{os.getpid()}-{time.monotonic_ns()}"  # moto's buckets outlive its server in this process
        s3fs.S3FileSystem(**options).mkdir(bucket)
        uri = f"s3://{bucket}/job"
    a = RunLock(Store(uri, options), ttl_s=30)
    a.acquire()
    try:
        b = RunLock(LateReader(uri, options), ttl_s=30)
        with pytest.raises(OutputBusyError, match="in use by another pairclean run"):
            b.acquire()
        assert RunLock(Store(uri, options)).read()["run_id"] == a.run_id  # type: ignore[index]
        a.check()
    finally:
        a.release()


def test_an_unreadable_lock_document_counts_as_free(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.put(schema.LOCK_FILE, b"{not json")
    with RunLock(store, ttl_s=30) as lock:
        assert _doc(tmp_path)["run_id"] == lock.run_id


def test_ttl_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAIRCLEAN_LOCK_TTL_S", raising=False)
    assert lock_ttl_from_env() == DEFAULT_TTL_S
    monkeypatch.setenv("PAIRCLEAN_LOCK_TTL_S", "7.5")
    assert lock_ttl_from_env() == 7.5
    assert RunLock(Store(str(tmp_path))).ttl_s == 7.5
