"""The audit loop (issue 22): a frozen labelling queue per job and the human labels.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "audit_queues",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("tenant", sa.String(100)),
        sa.Column("seed", sa.Integer, nullable=False),
        sa.Column("sample", sa.Integer, nullable=False),
        sa.Column("design", sa.Text, nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
    )
    op.create_table(
        "audit_labels",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("tenant", sa.String(100)),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        # the label is an enum: a CHECK constraint reads the same on SQLite and PostgreSQL
        sa.Column("label", sa.String(8), sa.CheckConstraint("label IN ('clean', 'noisy', 'unsure')", name="audit_label_value"),
                  nullable=False),
        sa.Column("who", sa.String(100), nullable=False),
        sa.Column("labelled_at", sa.String(32), nullable=False),
    )
    op.create_index("audit_labels_job", "audit_labels", ["job_id", "position"])
    op.create_index("audit_labels_who", "audit_labels", ["job_id", "who", "id"])


def downgrade() -> None:
    op.drop_index("audit_labels_who", "audit_labels")
    op.drop_index("audit_labels_job", "audit_labels")
    op.drop_table("audit_labels")
    op.drop_table("audit_queues")
