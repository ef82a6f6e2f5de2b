"""The durable job store: SQLAlchemy over SQLite (default) or PostgreSQL (by URL).

Schema changes are numbered migrations applied in order at start-up and recorded in
``schema_version`` (a small equivalent of Alembic: the service owns its two tables and
needs no autogeneration). On PostgreSQL the migrating transaction holds an advisory lock,
so API replicas starting together apply each migration once. Every write is its own
short transaction, so a crash loses at most the change in flight.

Tenancy lives in the schema: idempotency keys are unique per owner (``owner, idem_key``),
and a partial unique index lets only one QUEUED or RUNNING job hold an output location
(``output_key``, the sha256 of the resolved output), so two jobs can never write to the
same folder at once, even when two API replicas accept them at the same moment.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, bindparam, create_engine, event, text
from sqlalchemy.exc import IntegrityError

from pairclean.lifecycle import ACTIVE, STATES, TERMINAL, IllegalTransition, can_move

__all__ = ["STATES", "TERMINAL", "ACTIVE", "JobRow", "JobStore", "OutputInUse", "Principal"]

# Random, fixed: the PostgreSQL advisory lock id that serialises migrations.
_MIGRATION_LOCK = 0x70C1EA17

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
    # 4: an admin role on keys (set when the key is created)
    "ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0",
    # 5-7: idempotency keys unique per owner, not across owners (the old column's UNIQUE
    # constraint cannot be dropped portably on SQLite, so keys move to a new column)
    "ALTER TABLE jobs ADD COLUMN idem_key VARCHAR(200)",
    "UPDATE jobs SET idem_key = idempotency_key, idempotency_key = NULL WHERE idempotency_key IS NOT NULL",
    "CREATE UNIQUE INDEX jobs_owner_idem ON jobs (owner, idem_key)",
    # 8-9: one active job per output location
    "ALTER TABLE jobs ADD COLUMN output_key VARCHAR(64)",
    "CREATE UNIQUE INDEX jobs_active_output ON jobs (output_key) WHERE state IN ('QUEUED', 'RUNNING')",
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


_COLUMNS = ", ".join("idem_key AS idempotency_key" if f == "idempotency_key" else f for f in JobRow.__dataclass_fields__)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the API key's name and whether it may see every owner's jobs."""

    name: str
    admin: bool = False


class OutputInUse(Exception):
    """Another QUEUED or RUNNING job holds the output location."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} is already writing to this output")
        self.job_id = job_id


def _states(states: Sequence[str]) -> list[str]:
    return [s for s in states if s in STATES]


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
        """Apply pending migrations; returns the schema version the database now records."""
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                # Replicas starting together: the first migrates, the others wait, then see
                # the new version and apply nothing.
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            conn.execute(text("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"))
            current = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0
            for number, statement in enumerate(_MIGRATIONS, start=1):
                if number > current:
                    conn.execute(text(statement))
                    conn.execute(text("INSERT INTO schema_version (version) VALUES (:v)"), {"v": number})
        return self.schema_version()

    def schema_version(self) -> int:
        """The highest migration recorded in the database."""
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0)

    # -- API keys ---------------------------------------------------------------------
    def add_key(self, key_hash: str, name: str, admin: bool = False) -> None:
        """Store a key's hash under ``name``; an admin key sees every owner's jobs."""
        with self.engine.begin() as conn:
            conn.execute(text("INSERT INTO api_keys (key_hash, name, admin, created_at) VALUES (:h, :n, :a, :t)"),
                         {"h": key_hash, "n": name, "a": int(admin), "t": _now()})

    def key_owner(self, key_hash: str) -> str | None:
        principal = self.principal(key_hash)
        return principal.name if principal else None

    def principal(self, key_hash: str) -> Principal | None:
        """The owner of a key and its role, or None for an unknown key."""
        with self.engine.connect() as conn:
            r = conn.execute(text("SELECT name, admin FROM api_keys WHERE key_hash = :h"), {"h": key_hash}).first()
        return Principal(str(r[0]), bool(r[1])) if r else None

    # -- jobs -----------------------------------------------------------------------------
    def create(self, request: dict[str, Any], owner: str | None, idempotency_key: str | None, shards_total: int,
               output_key: str | None = None) -> tuple[JobRow, bool]:
        """Insert a QUEUED job; with an idempotency key this owner already used, return that job instead.

        Returns (job, created). Raises ``OutputInUse`` when another QUEUED or RUNNING job
        holds ``output_key``.
        """
        if idempotency_key:
            existing = self.by_idempotency_key(idempotency_key, owner)
            if existing is not None:
                return existing, False
        if output_key:
            holder = self.active_on_output(output_key)
            if holder is not None:
                raise OutputInUse(holder.id)
        job_id = str(uuid.uuid4())
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, state, request, idem_key, owner, shards_total, output_key, created_at) "
                        "VALUES (:id, 'QUEUED', :req, :ik, :owner, :total, :ok, :t)"
                    ),
                    {"id": job_id, "req": json.dumps(request), "ik": idempotency_key, "owner": owner, "total": shards_total,
                     "ok": output_key, "t": _now()},
                )
        except IntegrityError:
            # A concurrent request won the race: the same job (same key) or the output's holder.
            existing = self.by_idempotency_key(idempotency_key, owner) if idempotency_key else None
            if existing is not None:
                return existing, False
            holder = self.active_on_output(output_key) if output_key else None
            if holder is not None:
                raise OutputInUse(holder.id) from None
            raise
        job = self.get(job_id)
        assert job is not None
        return job, True

    def by_idempotency_key(self, key: str, owner: str | None = None) -> JobRow | None:
        """The job ``owner`` created with ``key`` (keys are per owner)."""
        with self.engine.connect() as conn:
            if owner is None:
                r = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE idem_key = :k AND owner IS NULL"), {"k": key}).first()
            else:
                r = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE idem_key = :k AND owner = :o"), {"k": key, "o": owner}).first()
        return _row(r) if r else None

    def active_on_output(self, output_key: str) -> JobRow | None:
        """The QUEUED or RUNNING job that holds an output location, if any."""
        with self.engine.connect() as conn:
            r = conn.execute(
                text(f"SELECT {_COLUMNS} FROM jobs WHERE output_key = :k AND state IN ('QUEUED', 'RUNNING')"), {"k": output_key}
            ).first()
        return _row(r) if r else None

    def get(self, job_id: str) -> JobRow | None:
        with self.engine.connect() as conn:
            r = conn.execute(text(f"SELECT {_COLUMNS} FROM jobs WHERE id = :id"), {"id": job_id}).first()
        return _row(r) if r else None

    def list(self, limit: int, offset: int, state: str | None = None, owner: str | None = None) -> tuple[list[JobRow], int]:
        """A page of jobs, newest first, and the total count; only ``owner``'s when given."""
        conditions, params = [], {}
        if state:
            conditions.append("state = :s")
            params["s"] = state
        if owner is not None:
            conditions.append("owner = :owner")
            params["owner"] = owner
        where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
        with self.engine.connect() as conn:
            total = conn.execute(text(f"SELECT COUNT(*) FROM jobs {where}"), params).scalar() or 0
            rows = conn.execute(
                text(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY created_at DESC, id LIMIT :l OFFSET :o"),
                {**params, "l": limit, "o": offset},
            ).all()
        return [_row(r) for r in rows], int(total)

    def in_states(self, states: Sequence[str]) -> list[JobRow]:
        query = text(f"SELECT {_COLUMNS} FROM jobs WHERE state IN :states ORDER BY created_at, id").bindparams(
            bindparam("states", expanding=True))
        with self.engine.connect() as conn:
            rows = conn.execute(query, {"states": _states(states)}).all()
        return [_row(r) for r in rows]

    def update(self, job_id: str, **fields: Any) -> None:
        """Set columns of one job (names are this module's own, never user input).

        The state is not one of them: it changes only through ``transition``.
        """
        if "state" in fields:
            raise IllegalTransition("job states change through JobStore.transition")
        allowed = set(JobRow.__dataclass_fields__) - {"id", "request"} | {"output_key"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown job fields {bad}")
        assignments = ", ".join(f"{k} = :{k}" for k in fields)
        with self.engine.begin() as conn:
            conn.execute(text(f"UPDATE jobs SET {assignments} WHERE id = :id"), {**fields, "id": job_id})

    def transition(self, job_id: str, from_states: Sequence[str], **fields: Any) -> bool:
        """Update only if the job is in one of ``from_states``; returns whether it was.

        Raises ``IllegalTransition`` when ``state`` is not a move the lifecycle
        (``pairclean.lifecycle``) allows from every one of ``from_states``.
        """
        target = fields.get("state")
        if target is not None:
            illegal = [s for s in from_states if not can_move(s, target)]
            if illegal or target not in STATES:
                raise IllegalTransition(f"a job cannot go from {illegal or list(from_states)} to {target!r}")
        allowed = set(JobRow.__dataclass_fields__) - {"id", "request"} | {"output_key"}
        if set(fields) - allowed:
            raise ValueError(f"unknown job fields {set(fields) - allowed}")
        assignments = ", ".join(f"{k} = :{k}" for k in fields)
        query = text(f"UPDATE jobs SET {assignments} WHERE id = :id AND state IN :from_states").bindparams(
            bindparam("from_states", expanding=True))
        with self.engine.begin() as conn:
            result = conn.execute(query, {**fields, "id": job_id, "from_states": _states(from_states)})
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
