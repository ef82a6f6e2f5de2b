"""Jobs and API keys, as the first release created them (its ``schema_version`` 3).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_ZERO = sa.text("0")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        # Unique across owners; 0002 moves keys to a per-owner column, 0003 drops this one.
        sa.Column("idempotency_key", sa.String(200), unique=True),
        sa.Column("owner", sa.String(100)),
        sa.Column("error", sa.Text),
        sa.Column("pid", sa.Integer),
        sa.Column("cancel_requested", sa.Integer, nullable=False, server_default=_ZERO),
        sa.Column("shards_total", sa.Integer, nullable=False, server_default=_ZERO),
        sa.Column("shards_done", sa.Integer, nullable=False, server_default=_ZERO),
        sa.Column("shards_failed", sa.Integer, nullable=False, server_default=_ZERO),
        sa.Column("pairs", sa.Integer, nullable=False, server_default=_ZERO),
        sa.Column("noise_rate", sa.Double),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("started_at", sa.String(32)),
        sa.Column("finished_at", sa.String(32)),
    )
    op.create_index("jobs_state", "jobs", ["state"])
    op.create_table(
        "api_keys",
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_index("jobs_state", "jobs")
    op.drop_table("jobs")
