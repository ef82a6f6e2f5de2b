"""The durable job store: SQLAlchemy over SQLite (default) or PostgreSQL (by URL).

Schema changes are numbered migrations applied in order at start-up and recorded in
``schema_version`` (a small equivalent of Alembic: the service owns its two tables and
needs no autogeneration). Every write is its own short transaction, so a crash loses at
most the change in flight.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import IntegrityError

__all__ = ["STATES", "TERMINAL", "JobRow", "JobStore"]

STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED")
TERMINAL = frozenset({"SUCCEEDED", "PARTIAL", "FAILED", "CANCELLED"})

_MIGRATIONS: list[str] = [
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
]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class JobRow:
    """A job as stored."""

    id: str
    state: str
    request: dict[str, Any]
    idempotency_key: str | None
    owner: str | None
    error: str | None
    pid: int | None
    cancel_requested: bool
    shards_total: int
    shards_done: int
    shards_failed: int
    pairs: int
    noise_rate: float | None
    created_at: str
    started_at: str | None
    finished_at: str | None


_COLUMNS = ", ".join(JobRow.__dataclass_fields__)


def _row(r: Any) -> JobRow:
    data = dict(r._mapping)
    data["request"] = json.loads(data["request"])
    data["cancel_requested"] = bool(data["cancel_requested"])
    return JobRow(**data)


class JobStore:
    """Jobs and API keys in a real database file (or server)."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = create_engine(url, future=True, pool_pre_ping=True)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.migrate()

    def migrate(self) -> int:
        """Apply pending migrations; returns the schema version."""
        with self.engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"))
            current = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0
            for number, statement in enumerate(_MIGRATIONS, start=1):
                if number > current:
                    conn.execute(text(statement))
                    conn.execute(text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": number})
        return len(_MIGRATIONS)

    # -- API keys ---------------------------------------------------------------------
    def add_key(self, key_hash: str, name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("INSERT INTO api_keys (key_hash, name, created_at) VALUES (:h, :n, :t)"), {"h": key_hash, "n": name, "t": _now()})

    def key_owner(self, key_hash: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT name FROM api_keys WHERE key_hash = :h"), {"h": key_hash}).scalar()

    # -- jobs -----------------------------------------------------------------------------
    def create(self, request: dict[str, Any], owner: str | None, idempotency_key: str | None, shards_total: int) -> tuple[JobRow, bool]:
        """Insert a QUEUED job; with an idempotency key already used, return that job instead.

        Returns (job, created).
        """
        if idempotency_key:
            existing = self.by_idempotency_key(idempotency_key)
            if existing is not None:
                return existing, False
        job_id = str(uuid.uuid4())
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, state, request, idempotency_key, owner, shards_total, created_at) "
                        "VALUES (:id, 'QUEUED', :req, :ik, :owner, :total, :t)"
                    ),
                    {"id": job_id, "req": json.dumps(request), "ik": idempotency_key, "owner": owner, "total": shards_total, "t": _now()},
                )
        except IntegrityError:
            # A concurrent request with the same key won the race: it is the same job.
            existing = self.by_idempotency_key(idempotency_key or "")
            if existing is None:
                raise
            return existing, False
        job = self.get(job_id)
        assert job is not None
        return job, True

    def by_idempotency_key(self, key: str) -> JobRow | None:
        with self.engine.connect() as conn:
            r = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE idempotency_key = :k"), {"k": key}).first()
        return _row(r) if r else None

    def get(self, job_id: str) -> JobRow | None:
        with self.engine.connect() as conn:
            r = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE id = :id"), {"id": job_id}).first()
        return _row(r) if r else None

    def list(self, limit: int, offset: int, state: str | None = None) -> tuple[list[JobRow], int]:
        """A page of jobs, newest first, and the total count."""
        where, params = ("WHERE state = :s", {"s": state}) if state else ("", {})
        with self.engine.connect() as conn:
            total = conn.execute(text(f"SELECT COUNT(*) FROM jobs {where}"), params).scalar() or 0
            rows = conn.execute(
                text(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY created_at DESC, id LIMIT :l OFFSET :o"),
                {**params, "l": limit, "o": offset},
            ).all()
        return [_row(r) for r in rows], int(total)

    def in_states(self, states: Sequence[str]) -> list[JobRow]:
        names = ", ".join(f"'{s}'" for s in states if s in STATES)
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE state IN ({names}) ORDER BY created_at, id")).all()
        return [_row(r) for r in rows]

    def update(self, job_id: str, **fields: Any) -> None:
        """Set columns of one job (names are this module's own, never user input)."""
        allowed = set(JobRow.__dataclass_fields__) - {"id", "request"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown job fields {bad}")
        assignments = ", ".join(f"{k} = :{k}" for k in fields)
        with self.engine.begin() as conn:
            conn.execute(text(f"UPDATE jobs SET {assignments} WHERE id = :id"), {**fields, "id": job_id})

    def transition(self, job_id: str, from_states: Sequence[str], **fields: Any) -> bool:
        """Update only if the job is in one of ``from_states``; returns whether it was."""
        assignments = ", ".join(f"{k} = :{k}" for k in fields)
        names = ", ".join(f"'{s}'" for s in from_states if s in STATES)
        with self.engine.begin() as conn:
            result = conn.execute(text(f"UPDATE jobs SET {assignments} WHERE id = :id AND state IN ({names})"), {**fields, "id": job_id})
        return bool(result.rowcount)

    def counts_by_state(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT state, COUNT(*) FROM jobs GROUP BY state")).all()
        return {state: 0 for state in STATES} | {r[0]: int(r[1]) for r in rows}

    def ping(self) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT 1")).scalar() == 1


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets status readers proceed while the runner writes; a busy timeout instead of
    # "database is locked" errors under concurrent pollers.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


Clock = Callable[[], str]
now_iso: Clock = _now
