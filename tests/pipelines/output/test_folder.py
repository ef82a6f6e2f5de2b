"""Completion records, compaction and the run lock on a real folder (no model needed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pairclean.output import folder as job_mod
from pairclean import schema
from pairclean.errors import OutputBusyError
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.output.lock import RunLock
from pairclean.storage import Store


def _record(i: int) -> ShardRecord:
    return ShardRecord(shard=f"/data/{i:06d}.tar", stem=f"{i:06d}", size=1000, rows=10, output=f"{i:06d}.parquet",
                       sha256="0" * 64, bytes=123, statuses={"ok": 10}, emb_output=None, emb_bytes=None, timings={"embed": 0.1})


def test_completions_are_compacted_into_the_manifest_and_their_files_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_mod, "COMPACT_EVERY", 10)
    out = OutputDir(str(tmp_path))
    for i in range(25):
        out.record_completion(_record(i))
    # two compactions happened (at 10 and 20): 5 records wait in their own files
    assert len(os.listdir(schema.local_side_path(tmp_path, schema.COMPLETIONS_DIR))) == 5
    fresh = OutputDir(str(tmp_path))  # a resuming run: manifest + 5 records
    assert sorted(fresh.committed()) == [f"{i:06d}" for i in range(25)]
    assert fresh.committed()["000003"] == _record(3)
    out.compact()
    assert os.listdir(schema.local_side_path(tmp_path, schema.COMPLETIONS_DIR)) == []
    assert len(OutputDir(str(tmp_path)).committed()) == 25


def test_a_crash_between_manifest_and_cleanup_leaves_harmless_duplicates(tmp_path: Path) -> None:
    out = OutputDir(str(tmp_path))
    for i in range(3):
        out.record_completion(_record(i))
    out.compact()
    # as if the run died after writing the manifest but before deleting the records
    (schema.local_side_path(tmp_path, schema.COMPLETIONS_DIR) / "000001.json").write_text(json.dumps(_record(1).to_json()))
    committed = OutputDir(str(tmp_path)).committed()
    assert sorted(committed) == ["000000", "000001", "000002"]


def test_a_commit_clears_the_shards_failure_record(tmp_path: Path) -> None:
    out = OutputDir(str(tmp_path))
    out.quarantine("/data/000001.tar", "000001", "boom", 3)
    assert list(OutputDir(str(tmp_path)).quarantined()) == ["000001"]
    out.record_completion(_record(1))
    assert OutputDir(str(tmp_path)).quarantined() == {}


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_or_stale_one(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    first = RunLock(store, ttl_s=30)
    first.acquire()
    try:
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            RunLock(store, ttl_s=30).acquire()
    finally:
        first.release()
    assert not (tmp_path / schema.LOCK_FILE).exists()
    # a holder on this host whose process is gone: taken over at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    lock_doc = {"run_id": "x" * 32, "host": socket.gethostname(), "pid": int(dead), "heartbeat": time.time(), "ttl_s": 600}
    store.put(schema.LOCK_FILE, json.dumps(lock_doc).encode())
    with RunLock(store, ttl_s=30):
        pass
    # a holder on another host: live while its heartbeat is fresh, stale after its TTL
    lock_doc.update(host="another-host", pid=1, heartbeat=time.time(), ttl_s=1.0)
    store.put(schema.LOCK_FILE, json.dumps(lock_doc).encode())
    with pytest.raises(OutputBusyError, match="another-host"):
        RunLock(store, ttl_s=30).acquire()
    time.sleep(1.2)
    with RunLock(store, ttl_s=30) as taken:
        assert json.loads((tmp_path / schema.LOCK_FILE).read_text())["run_id"] == taken.run_id


def test_records_with_keys_of_a_later_release_still_read() -> None:
    """A completion record or manifest row written by a later release (a rolling upgrade, a
    trainer on an older install) carries fields this one does not know: they are ignored."""
    from pairclean.output.folder import ShardRecord

    data = {"shard": "/d/a.tar", "stem": "a", "size": 10, "rows": 2, "output": "a.parquet", "sha256": "0" * 64, "bytes": 5,
            "statuses": {"ok": 2}, "attempts": 2, "a_field_from_the_future": [1, 2]}
    record = ShardRecord.from_json(data)
    assert record.attempts == 2 and record.rows == 2 and "a_field_from_the_future" not in record.to_json()
