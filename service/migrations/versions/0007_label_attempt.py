"""Which of a labeller's labels of one pair a label is (``attempt``: 0 the first, 1 the blind
repeat the queue asked for, ...), unique per job, labeller and pair: two replicas that both
check a double-clicked label and store it can no longer both succeed (the database refuses
the second), where a lock per API process could not see the other replica. Upgrade every
replica together: one of an earlier release stores each label as attempt 0, so its blind
repeats would be refused (a 500 there).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_labels") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer, nullable=False, server_default="0"))
    # Labels stored before: numbered in the order they were stored (their id), so the unique
    # index holds them all, repeats and races included.
    labels = sa.table("audit_labels", sa.column("id", sa.Integer), sa.column("job_id", sa.String), sa.column("who", sa.String),
                      sa.column("position", sa.Integer), sa.column("attempt", sa.Integer))
    conn = op.get_bind()
    seen: dict[tuple[str, str, int], int] = {}
    for row in conn.execute(sa.select(labels.c.id, labels.c.job_id, labels.c.who, labels.c.position).order_by(labels.c.id)):
        group = (row.job_id, row.who, row.position)
        attempt = seen.get(group, 0)
        seen[group] = attempt + 1
        if attempt:
            conn.execute(sa.update(labels).where(labels.c.id == row.id).values(attempt=attempt))
    op.create_index("audit_labels_attempt", "audit_labels", ["job_id", "who", "position", "attempt"], unique=True)


def downgrade() -> None:
    op.drop_index("audit_labels_attempt", "audit_labels")
    with op.batch_alter_table("audit_labels") as batch:
        batch.drop_column("attempt")
