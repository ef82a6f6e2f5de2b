"""Which runner launched a RUNNING job (host and state folder), so one replica's restart
leaves another replica's running jobs alone.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER a table in place beyond ADD COLUMN; this keeps both alike
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("runner", sa.String(300)))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("runner")
