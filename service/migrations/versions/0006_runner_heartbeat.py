"""A heartbeat of the runner that launched a RUNNING job: another replica re-queues the job
only when both this value and the job's run lock have stood still for a grace period (a
replica lost with its host), never on a clock comparison.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER a table in place beyond ADD COLUMN; this keeps both alike
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("heartbeat", sa.String(32)))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("heartbeat")
