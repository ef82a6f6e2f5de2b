"""Drop what only the pre-Alembic store used: the global ``idempotency_key`` column (empty
since 0002) and the ``schema_version`` table; give SQLite files of those releases the
column definitions a fresh database has.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

_ACTIVE = ("QUEUED", "RUNNING")
_jobs = sa.table("jobs", sa.column("state", sa.String))


def _active_output_index() -> None:
    active = _jobs.c.state.in_(_ACTIVE)
    op.create_index("jobs_active_output", "jobs", ["output_key"], unique=True, sqlite_where=active, postgresql_where=active)


def upgrade() -> None:
    # On SQLite the batch copies the table; the partial index is dropped first and made
    # again after, rather than trusting reflection to carry its WHERE clause across.
    op.drop_index("jobs_active_output", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("idempotency_key")
        # The old DDL on SQLite: a PRIMARY KEY that is not an INTEGER admits NULL there, and
        # DOUBLE PRECISION was stored as REAL. No-ops where they were right already.
        batch.alter_column("id", existing_type=sa.String(36), nullable=False)
        batch.alter_column("noise_rate", existing_type=sa.Double(), type_=sa.Double())
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("key_hash", existing_type=sa.String(64), nullable=False)
    _active_output_index()
    if sa.inspect(op.get_bind()).has_table("schema_version"):
        op.drop_table("schema_version")  # only databases made before Alembic have it


def downgrade() -> None:
    op.drop_index("jobs_active_output", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(200)))
        batch.create_unique_constraint("jobs_idempotency_key_key", ["idempotency_key"])
    _active_output_index()
