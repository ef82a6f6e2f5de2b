"""Helpers for the job store's migration tests: a database as the pre-Alembic releases left
it, and replicas starting at the same moment as separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import Engine, column, insert, select, table

# The hand-written migrations of the releases before Alembic, verbatim (service/store.py
# up to the switch): ``schema_version`` N means the first N statements ran. Release 1
# shipped 3 of them, later releases all 9.
LEGACY_DDL: list[str] = [
    # 1: jobs and API keys
    """
    CREATE TABLE jobs (
        id VARCHAR(36) PRIMARY KEY,
        state VARCHAR(16) NOT NULL,
        request TEXT NOT NULL,
        idempotency_key VARCHAR(200) UNIQUE,
        owner VARCHAR(100),
        error TEXT,
        pid INTEGER,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        shards_total INTEGER NOT NULL DEFAULT 0,
        shards_done INTEGER NOT NULL DEFAULT 0,
        shards_failed INTEGER NOT NULL DEFAULT 0,
        pairs INTEGER NOT NULL DEFAULT 0,
        noise_rate DOUBLE PRECISION,
        created_at VARCHAR(32) NOT NULL,
        started_at VARCHAR(32),
        finished_at VARCHAR(32)
    )
    """,
    "CREATE INDEX jobs_state ON jobs (state)",
    """
    CREATE TABLE api_keys (
        key_hash VARCHAR(64) PRIMARY KEY,
        name VARCHAR(100) NOT NULL,
        created_at VARCHAR(32) NOT NULL
    )
    """,
    # 4: an admin role on keys
    "ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0",
    # 5-7: idempotency keys unique per owner
    "ALTER TABLE jobs ADD COLUMN idem_key VARCHAR(200)",
    "UPDATE jobs SET idem_key = idempotency_key, idempotency_key = NULL WHERE idempotency_key IS NOT NULL",
    "CREATE UNIQUE INDEX jobs_owner_idem ON jobs (owner, idem_key)",
    # 8-9: one active job per output location
    "ALTER TABLE jobs ADD COLUMN output_key VARCHAR(64)",
    "CREATE UNIQUE INDEX jobs_active_output ON jobs (output_key) WHERE state IN ('QUEUED', 'RUNNING')",
]

# Rows as each legacy release wrote them: alice's finished job with idempotency key "k",
# a queued job holding output "out-1", and alice's (non-admin) key.
_LEGACY_ROWS: dict[int, list[str]] = {
    3: [
        "INSERT INTO jobs (id, state, request, idempotency_key, owner, created_at) "
        "VALUES ('j1', 'SUCCEEDED', '{\"output\": \"/o\"}', 'k', 'alice', '2024-01-01T00:00:00+00:00')",
        "INSERT INTO jobs (id, state, request, owner, created_at) VALUES ('j2', 'QUEUED', '{}', 'alice', '2024-01-02T00:00:00+00:00')",
        "INSERT INTO api_keys (key_hash, name, created_at) VALUES ('h', 'alice', 'x')",
    ],
    9: [
        "INSERT INTO jobs (id, state, request, idem_key, owner, created_at) "
        "VALUES ('j1', 'SUCCEEDED', '{\"output\": \"/o\"}', 'k', 'alice', '2024-01-01T00:00:00+00:00')",
        "INSERT INTO jobs (id, state, request, owner, output_key, created_at) "
        "VALUES ('j2', 'QUEUED', '{}', 'alice', 'out-1', '2024-01-02T00:00:00+00:00')",
        "INSERT INTO api_keys (key_hash, name, admin, created_at) VALUES ('h', 'alice', 0, 'x')",
    ],
}


def build_legacy(engine: Engine, version: int, rows: bool = True) -> None:
    """Make the database a pre-Alembic release left at ``schema_version`` ``version``."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for number, statement in enumerate(LEGACY_DDL[:version], start=1):
            conn.exec_driver_sql(statement)
            conn.execute(insert(table("schema_version", column("version"))).values(version=number))
        for statement in _LEGACY_ROWS.get(version, []) if rows else []:
            conn.exec_driver_sql(statement)


def recorded_revisions(engine: Engine) -> list[str]:
    """Every row of Alembic's version table, read from the database itself."""
    version_table = table("alembic_version", column("version_num"))
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(select(version_table.c.version_num))]


_REPLICA = """
import json, sys, time
from pathlib import Path
from pairclean_service.store import JobStore
url, go = sys.argv[1], Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
try:
    print(json.dumps({"revision": JobStore(url).schema_revision()}), flush=True)
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


def start_replicas(url: str, n: int, folder: Path) -> list[dict[str, str]]:
    """Start ``n`` processes that each open a JobStore on ``url`` at the same moment (after
    their imports); returns what each reported: its revision, or the error it hit."""
    go = folder / f"go-{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, "-c", _REPLICA, url, str(go)], stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        results.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": f"exit {proc.returncode}"})
    return results
