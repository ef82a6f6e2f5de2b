"""Tenants: an admin role on keys, idempotency keys per owner, one active job per output
(the last hand-written migrations, ``schema_version`` 4 to 9).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

# The states as of this revision, frozen here: a later change to pairclean.job.lifecycle
# needs its own revision, not a silent change to this one.
_ACTIVE = ("QUEUED", "RUNNING")
_jobs = sa.table("jobs", sa.column("state", sa.String), sa.column("idempotency_key", sa.String), sa.column("idem_key", sa.String))


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("admin", sa.Integer, nullable=False, server_default=sa.text("0")))
    # The old column's UNIQUE constraint cannot be dropped in place on SQLite, so keys move
    # to a new column with a per-owner unique index.
    op.add_column("jobs", sa.Column("idem_key", sa.String(200)))
    op.execute(_jobs.update().where(_jobs.c.idempotency_key.is_not(None))
               .values(idem_key=_jobs.c.idempotency_key, idempotency_key=None))
    op.create_index("jobs_owner_idem", "jobs", ["owner", "idem_key"], unique=True)
    op.add_column("jobs", sa.Column("output_key", sa.String(64)))
    active = _jobs.c.state.in_(_ACTIVE)
    op.create_index("jobs_active_output", "jobs", ["output_key"], unique=True, sqlite_where=active, postgresql_where=active)


def downgrade() -> None:
    op.drop_index("jobs_active_output", "jobs")
    op.drop_index("jobs_owner_idem", "jobs")
    op.execute(_jobs.update().where(_jobs.c.idem_key.is_not(None)).values(idempotency_key=_jobs.c.idem_key))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("output_key")
        batch.drop_column("idem_key")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("admin")
