"""Schema migrations of the job store: Alembic revisions in ``versions/``, run at start-up.

``upgrade(engine)`` brings a database to the head revision, safely when several API
replicas start at once:

- PostgreSQL: one transaction holds ``pg_advisory_xact_lock`` on the connection Alembic
  uses, then reads the version, adopts a pre-Alembic database and applies the revisions
  (PostgreSQL's DDL is transactional). A replica that waited on the lock sees the head
  and applies nothing.
- SQLite: one file has no advisory locks, so the same transaction starts with
  ``BEGIN IMMEDIATE``, the database's own write lock (other starters wait on the busy
  timeout, then see the head). pysqlite's implicit transactions would start later and
  commit before DDL, so the migrating connection manages its own (SQLAlchemy's recipe).

Databases made before Alembic (a ``schema_version`` table, no ``alembic_version``) are
stamped with the revision equal to the schema they record, then upgraded like any other.
No ``alembic.ini`` is read: the configuration is built here, and the revisions ship in
the package (``pairclean_service/migrations``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Connection, Engine, Integer, MetaData, Table, create_engine, event, func, inspect, select
from sqlalchemy.pool import NullPool

__all__ = ["LEGACY_VERSIONS", "MigrationError", "config", "current_revision", "head", "upgrade", "use_wal"]

# Random, fixed: the PostgreSQL advisory lock id that serialises migrations.
_LOCK_ID = 0x70C1EA17
# Seconds a starting replica waits for another one's migration on SQLite.
_SQLITE_LOCK_WAIT_S = 120

#: ``schema_version`` of each pre-Alembic release -> the revision with the same schema.
LEGACY_VERSIONS: dict[int, str] = {3: "0001", 9: "0002"}

_schema_version = Table("schema_version", MetaData(), Column("version", Integer, nullable=False))


class MigrationError(RuntimeError):
    """The database is in a state no release of pairclean left behind."""


def config(connection: Connection | None = None) -> Config:
    """Alembic's configuration, built in code; ``connection`` is what env.py migrates."""
    cfg = Config()
    cfg.set_main_option("script_location", "pairclean_service:migrations")
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    """The newest revision shipped with this version of the service."""
    revision = ScriptDirectory.from_config(config()).get_current_head()
    assert revision is not None
    return revision


def current_revision(connection: Connection) -> str | None:
    """The revision a database records (None before any migration)."""
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Migrate the database behind ``engine`` to the head; returns the revision it now records."""
    with _migrating_engine(engine) as migrating, migrating.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Held until this transaction ends: replicas starting together migrate one by one.
            conn.execute(select(func.pg_advisory_xact_lock(_LOCK_ID)))
        cfg = config(conn)
        _adopt_pre_alembic(conn, cfg)
        command.upgrade(cfg, "head")
        revision = current_revision(conn)
    assert revision is not None
    return revision


def _adopt_pre_alembic(conn: Connection, cfg: Config) -> None:
    """Stamp a database the hand-written migrations made with its equal revision."""
    tables = set(inspect(conn).get_table_names())
    if "alembic_version" in tables or "schema_version" not in tables:
        return
    version = conn.execute(select(func.max(_schema_version.c.version))).scalar()
    revision = LEGACY_VERSIONS.get(int(version or 0))
    if revision is None:
        raise MigrationError(f"the database records schema_version {version}, which no release of pairclean "
                             f"left behind (known: {sorted(LEGACY_VERSIONS)}); restore it from a backup")
    command.stamp(cfg, revision)


@contextmanager
def _migrating_engine(engine: Engine) -> Iterator[Engine]:
    """The engine to migrate with: on an SQLite file, one whose transactions take the write lock."""
    url = engine.url
    in_memory = url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"
    if engine.dialect.name != "sqlite" or in_memory:
        yield engine  # PostgreSQL locks on the connection; an in-memory database has one user
        return
    migrating = create_engine(url, poolclass=NullPool, connect_args={"timeout": _SQLITE_LOCK_WAIT_S})
    event.listen(migrating, "connect", _sqlite_manual_transactions)
    event.listen(migrating, "begin", _sqlite_begin_immediate)
    try:
        yield migrating
    finally:
        migrating.dispose()


def _sqlite_manual_transactions(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # pysqlite emits no BEGIN/COMMIT of its own
    use_wal(dbapi_conn, _SQLITE_LOCK_WAIT_S)  # what the store's connections use (store._sqlite_pragmas)


def use_wal(dbapi_conn: Any, wait_s: float) -> None:
    """Put an SQLite file in WAL mode, retrying while another process holds it for up to ``wait_s``.

    Switching the journal mode needs the file to itself, and SQLite can answer "database is
    locked" at once instead of calling the busy handler (seen in CI: one of six replicas
    starting together on a fresh file failed here), so the retry is ours.
    """
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        finally:
            cursor.close()
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _sqlite_begin_immediate(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")
