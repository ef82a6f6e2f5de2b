"""Alembic's environment for the job store.

The service runs it through ``pairclean_service.migrations.upgrade``, which passes the
connection it already locked (``config.attributes["connection"]``) so the lock, the
adoption of pre-Alembic databases and every revision share one transaction. Developer
commands (``alembic revision --autogenerate`` with ``sqlalchemy.url`` set) connect here
instead and take no lock.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from pairclean_service.tables import metadata


def _run(connection: Connection) -> None:
    # Batch mode: SQLite cannot ALTER or DROP most things in place, so revisions written
    # with op.batch_alter_table copy the table there and use plain ALTER on PostgreSQL.
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("pairclean's migrations run online only (pairclean_service.migrations.upgrade)")
shared = context.config.attributes.get("connection")
if shared is not None:
    _run(shared)
else:
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url, or run the service's upgrade (pairclean_service.migrations.upgrade)")
    with create_engine(url).connect() as conn:
        _run(conn)
        conn.commit()
